"""Where the suite's CPU goes, test by test: ``FLATSHARE_TEST_CPU=FILE make test`` appends one JSON line per test.

The suite runs on 2 CPUs and is bound by them, so a test's wall time (``--durations``) says little of what it
costs the others: a test that waits costs nothing, one whose fleet starts engines costs much. Each line is
``{"test", "wall_s", "cpu_s"}``: ``cpu_s`` is the CPU time (user and system) the test process and every process
it started spent while the test ran (its setup and teardown included: a module's fleet is counted in the test
that brings it up), read from proc(5) as the whole tree of the test process's descendants, each with the time of
the children it has reaped (``utime + stime + cutime + cstime``). A process reaped by none of them (one that
outlived its parent) is not counted. A test's managers, sshds, engines and node commands are its descendants.

Summarise: ``python tests/cpu_log.py FILE`` (the tests and modules that cost most).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

VARIABLE = "FLATSHARE_TEST_CPU"


def tree_cpu_s(root: int) -> float:
    """CPU seconds spent by ``root`` and its live descendants, each with its reaped children's (proc(5) stat
    fields 14-17, in clock ticks)."""
    tick = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[int]] = {}
    spent: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        pid = int(entry.name)
        children.setdefault(int(fields[1]), []).append(pid)
        spent[pid] = sum(int(x) for x in fields[11:15])
    total, stack = 0, [root]
    while stack:
        pid = stack.pop()
        total += spent.get(pid, 0)
        stack += children.get(pid, [])
    return total / tick


def run_cpu_s(argv: list[str], **run) -> tuple[subprocess.CompletedProcess, float]:
    """``subprocess.run(argv, **run)`` and the CPU seconds (user + system) the child and its reaped descendants
    spent, from ``getrusage(RUSAGE_CHILDREN)`` around it: the machine's load changes the wall time, not this.
    Not thread-safe (another thread's children would count)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(argv, **run)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return done, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


class Recorder:
    """A pytest plugin: one line per test in the file the variable names."""

    def __init__(self, path: str) -> None:
        self.path = path

    def pytest_runtest_protocol(self, item, nextitem):  # a hook wrapper (registered as one below)
        started, spent = time.monotonic(), tree_cpu_s(os.getpid())
        yield
        line = {"test": item.nodeid, "wall_s": round(time.monotonic() - started, 3),
                "cpu_s": round(tree_cpu_s(os.getpid()) - spent, 3)}
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")

    pytest_runtest_protocol.hookwrapper = True  # type: ignore[attr-defined]


def summary(path: Path, top: int = 25) -> None:
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    cpu = sum(x["cpu_s"] for x in lines)
    print(f"{len(lines)} tests, {cpu:.0f} CPU-s, {sum(x['wall_s'] for x in lines):.0f} test-s")
    modules: Counter = Counter()
    bases: Counter = Counter()
    for x in lines:
        modules[x["test"].split("::")[0]] += x["cpu_s"]
        bases[x["test"].split("[")[0]] += x["cpu_s"]
    print("\nby module (CPU-s):")
    for name, value in modules.most_common(top):
        print(f"{value:8.1f}  {name}")
    print("\nby test, its cases together (CPU-s):")
    for name, value in bases.most_common(top):
        print(f"{value:8.1f}  {name}")


if __name__ == "__main__":
    summary(Path(sys.argv[1]))
