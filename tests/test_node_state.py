"""Node state that survives damage and a full disk; rollback only to what served.

On a sandbox fleet of its own (loopback block 51, module-scoped), from a scratch
checkout whose hold value is flipped for every release, so that each release is a real change:

1. every file a node keeps, damaged in every form that applies, is read defensively by the node's
   switch (what ``flatshare release`` runs there), ``rollback --dry-run``, ``status``, ``releases`` and
   ``serving-check``;
2. appends a crash cannot corrupt (a torn history line; a failure between the history record and
   the journal's removal);
3. the one early-end rule whatever durable write fails (tests/faults/ ``fail=PRIMITIVE, nth=N``);
4. a real full disk (tmpfs) and a real read-only filesystem mid-switch;
5. rollback only to a release that served (after a failed start, after SIGINT; a refused rollback
   keeps the interrupted switch);
6. the engine's stop time does not eat its start budget;
7. every command a message suggests exists.

A release here is the node's own switch, run as a local ``flatshare release`` runs it (the same command
line, bundle and admission answer; tests/release_fleet.py's ``node_switch``): what these tests check is
the node's, and a whole operator's release would only add its start-up and its probe of peacock. Where
a test checks what the operator's side says, it runs ``flatshare release`` itself (``operator_release``).

Truth is read independently of the tool's own words where it can be: files on disk, systemd's
ActiveState and InvocationID over D-Bus, the stand-ins' HTTP answers, ``/proc/locks``. Every test
leaves cyan settled (no journal, no drain file, serving-check OK).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import BIN, REPO, faults, loopback_pair, quick_stand_in, run_cli, scratch_sandbox, signal_at
from release_fleet import node_switch

from flatshare_ops.check.run import run_checks
from flatshare_ops.common.http import wait_for_200
from flatshare_ops.common.locks import held_by
from flatshare_ops.control.targets import targets
from flatshare_ops.node.store import release_id
from flatshare_ops.render import render_profile
from flatshare_ops.sandbox.fleet import ENGINE_PORT, GATEWAY_PORT, SandboxNode
from flatshare_ops.common.systemd import (
    ManagerAddress,
    connect,
    daemon_reload,
    run_job,
    unit_property,
)

ADDRESSES = loopback_pair(51)
ENGINE, GATEWAY, VOICE = "flatshare-engine.service", "flatshare-gateway.service", "flatshare-voice.service"
HOLD_FLAG = "--additional-config.make_room.decode_hold_tokens"
#: Groups of this module's tests that run apart (tests/conftest.py, "parallel test processes"), each on a
#: fleet of its own: the failed writes (with the write_calls fixture), the rollbacks, and half of the
#: damaged files (DAMAGED_LOGS, below); the rest is the module's own group.
WRITES = pytest.mark.xdist_group("test_node_state_writes")
ROLLBACKS = pytest.mark.xdist_group("test_node_state_rollbacks")
#: The call recorder (tests/test_node_state_calls/sitecustomize.py): which durable write is the Nth.
CALLS = Path(__file__).resolve().parent / "test_node_state_calls"
CYAN = "cyan"


# --- the fleet ---------------------------------------------------------------------------------------


class Fleet:
    """This module's checkout and sandbox, and what the tests read from them."""

    def __init__(self, checkout: Path, base: Path, scratch: Path) -> None:
        self.checkout, self.base, self.scratch = checkout, base, scratch
        self.inventory = base / "fleet.toml"
        self._fresh = 1000

    def node(self, name: str = CYAN) -> SandboxNode:
        return SandboxNode(name, ADDRESSES[name], self.base)

    def address(self, name: str = CYAN) -> ManagerAddress:
        return ManagerAddress("user", self.node(name).manager.runtime_dir)

    def releases(self, name: str = CYAN) -> Path:
        return self.node(name).state_dir / "releases"

    def journal(self, name: str = CYAN) -> Path:
        return self.releases(name) / "switching.json"

    def drain_file(self, name: str = CYAN) -> Path:
        return self.node(name).run_dir / "voice.drain"

    # commands

    def cli(self, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
        return run_cli(*args, env={"FLATSHARE_INVENTORY": str(self.inventory), **(env or {})})

    def release(self, name: str = CYAN, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
        """The node's own switch to the checkout's release, as a local ``flatshare release`` runs it (the same
        command line, bundle and admission: tests/release_fleet.py's node_switch). What these tests check is
        the node's: its exit code, its lines, its files; the operator's side only passes them on, and
        tests/test_release.py checks that it does. ``args``: ``--no-auto-rollback``."""
        unknown = [a for a in args if a != "--no-auto-rollback"]
        assert not unknown, unknown
        return node_switch(self.inventory, self.checkout, name, env,
                           auto_rollback=False if "--no-auto-rollback" in args else None)

    def operator_release(self, name: str = CYAN, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
        """``flatshare release`` run on the node itself (FLATSHARE_NODE: a local child process), for what the
        operator's side says (its follow-up of a switch that ended without an outcome, its summary)."""
        return self.cli("release", "--root", str(self.checkout), *args, env={"FLATSHARE_NODE": name, **(env or {})})

    def rollback(self, name: str = CYAN, *args: str) -> subprocess.CompletedProcess:
        """``flatshare rollback --node NAME`` (over SSH)."""
        return self.cli("rollback", "--node", name, "--root", str(self.checkout), *args)

    def popen_release(self, name: str = CYAN, env: dict | None = None) -> subprocess.Popen:
        return subprocess.Popen(
            [str(BIN / "flatshare"), "release", "--inventory", str(self.inventory), "--root", str(self.checkout)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "FLATSHARE_NODE": name, **(env or {})})

    def serving_check(self, name: str = CYAN) -> subprocess.CompletedProcess:
        node = self.node(name)
        return run_cli("--state-dir", str(node.state_dir), "--runtime-dir", str(node.manager.runtime_dir),
                       "--node-name", name, program="serving-check")

    def read_everything(self, name: str = CYAN) -> dict[str, subprocess.CompletedProcess]:
        """rollback --dry-run, status, releases and serving-check, at once (none of them takes the lock)."""
        node = self.node(name)
        base = [str(BIN / "flatshare")]
        inv = ["--inventory", str(self.inventory)]
        commands = {
            "rollback --dry-run": (base + ["rollback", "--dry-run", *inv, "--root", str(self.checkout)],
                                   {"FLATSHARE_NODE": name}),
            "status": (base + ["status", "--node", name, *inv], {}),
            "releases": (base + ["releases", "--node", name, *inv], {}),
            "serving-check": ([str(BIN / "serving-check"), "--state-dir", str(node.state_dir), "--runtime-dir",
                               str(node.manager.runtime_dir), "--node-name", name], {}),
        }
        return run_at_once(commands)

    # what the node runs

    def current(self, name: str = CYAN) -> str | None:
        try:
            return os.readlink(self.releases(name) / "current")
        except OSError:
            return None

    def engine(self, name: str = CYAN) -> tuple[list[str], bytes]:
        """(the engine's argv from /proc, its InvocationID), as systemd and the kernel say."""
        with connect(self.address(name)) as bus:
            pid = unit_property(bus, ENGINE, "Service", "MainPID")
            invocation = unit_property(bus, ENGINE, "Unit", "InvocationID")
        try:
            argv = [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1]] if pid else []
        except OSError:
            argv = []
        return argv, invocation

    def hold(self, name: str = CYAN) -> str | None:
        argv = self.engine(name)[0]
        return argv[argv.index(HOLD_FLAG) + 1] if HOLD_FLAG in argv else None

    def active(self, unit: str, name: str = CYAN) -> str:
        with connect(self.address(name)) as bus:
            state = unit_property(bus, unit, "Unit", "ActiveState")
        return state.decode() if isinstance(state, bytes) else str(state)

    def expected_id(self, name: str = CYAN) -> str:
        """The release id the checkout renders for the node (the digest of its files)."""
        (target,) = targets(self.inventory, [name], False)
        return release_id(render_profile(target.loaded).release_files())

    def set_hold(self, value: str) -> None:
        """What ``flatshare profiles set engine.make_room.decode_hold_tokens VALUE --root CHECKOUT`` does
        (edit, validate, render the checkout's files), in this process: it runs before every release."""
        from flatshare_ops.config.edit import set_value
        from flatshare_ops.render.checkout import (
            DEFAULT_PROFILE,
            expected_outputs,
            write_outputs,
        )

        set_value(self.checkout / DEFAULT_PROFILE, "engine.make_room.decode_hold_tokens", value,
                  then=lambda: write_outputs(self.checkout, expected_outputs(self.checkout)), echo=lambda _w: None)

    def change(self, name: str = CYAN) -> str:
        """Make the checkout render a release that differs from what the engine runs; returns its id."""
        self.set_hold("0" if self.hold(name) == "48" else "48")
        return self.expected_id(name)

    def fresh(self, name: str = CYAN) -> str:
        """Make the checkout render a release never stored on the node; returns its id."""
        self._fresh += 1
        self.set_hold(str(self._fresh))
        return self.expected_id(name)

    def history(self, name: str = CYAN) -> list[dict]:
        """The node's history records (lines that are not records skipped)."""
        path = self.releases(name) / "history.jsonl"
        records = []
        for line in path.read_bytes().decode(errors="replace").splitlines() if path.is_file() else []:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                records.append(record)
        return records

    @contextmanager
    def profile_edit(self, name: str, replacements: dict[str, str]):
        """Edit the node's own profile (sandbox-only values) for the block; restored after."""
        path = self.node(name).profile
        original = path.read_text()
        path.write_text(_replaced(original, replacements, path))
        try:
            yield
        finally:
            path.write_text(original)

    # the node's health

    def calls_problems(self, name: str = CYAN, wait_s: float = 15.0) -> list[str]:
        """Why the node does not take calls (empty when it does): the gateway and the engine answer
        /health 200 (waited for, bounded) and no voice drain file is there."""
        node = self.node(name)
        problems = []
        for what, port in (("gateway", GATEWAY_PORT), ("engine", ENGINE_PORT)):
            status = wait_for_200(f"http://{node.address}:{port}/health", wait_s)
            if status != 200:
                problems.append(f"{what} /health answered {status or 'nothing'}")
        if self.drain_file(name).exists() or self.drain_file(name).is_symlink():
            problems.append(f"{self.drain_file(name)} is present")
        return problems

    def settled(self, name: str = CYAN) -> None:
        """The node as every test must leave it: no journal, no drain file, taking calls, serving-check OK."""
        assert not self.journal(name).exists(), f"{self.journal(name)} left behind"
        assert not self.calls_problems(name), self.calls_problems(name)
        report = run_checks(self.node(name).state_dir, name, self.node(name).manager.runtime_dir)
        assert report.status == "OK", [(f.check, f.status, f.summary, f.details) for f in report.findings]

    def restart(self, unit: str, name: str = CYAN) -> None:
        with connect(self.address(name)) as bus:
            run_job(bus, "restart", unit, 60)

    def reload(self, name: str = CYAN) -> None:
        with connect(self.address(name)) as bus:
            daemon_reload(bus)

    def finish(self, name: str = CYAN) -> None:
        """Bring the node back to a settled state after a test left a switch unfinished."""
        if self.journal(name).exists() or self.calls_problems(name, wait_s=2):
            result = self.release(name)
            assert result.returncode in (0, 4), result.stdout + result.stderr
        self.settled(name)


def run_at_once(commands: dict[str, tuple[list[str], dict]]) -> dict[str, subprocess.CompletedProcess]:
    """Run several commands in parallel, each bounded to 120 s (killed then, with what it said so far); name ->
    CompletedProcess (text). Through ``subprocess.run`` in threads: the operator's commands start from the test
    process's zygote (tests/cli_zygote.py)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(argv: list[str], env: dict) -> subprocess.CompletedProcess:
        try:
            return subprocess.run(argv, capture_output=True, text=True, env={**os.environ, **env}, timeout=120)
        except subprocess.TimeoutExpired as err:
            said = [x.decode(errors="replace") if isinstance(x, bytes) else x or "" for x in (err.stdout, err.stderr)]
            return subprocess.CompletedProcess(argv, -signal.SIGKILL, *said)

    with ThreadPoolExecutor(max_workers=max(1, len(commands))) as pool:
        running = {name: pool.submit(one, argv, env) for name, (argv, env) in commands.items()}
        return {name: future.result() for name, future in running.items()}


def text_of(result: subprocess.CompletedProcess) -> str:
    return (result.stdout or "") + (result.stderr or "")


def wait_for_step(journal: Path, step: str, timeout_s: float = 60.0) -> None:
    """Wait until the journal on disk says ``step`` is running (the switch is inside it)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            steps = {s["name"]: s["state"] for s in json.loads(journal.read_text())["steps"]}
            if steps.get(step) == "running":
                return
        except (OSError, ValueError, KeyError, TypeError):
            pass
        time.sleep(0.02)
    raise AssertionError(f"{journal} never said {step} is running")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    with scratch_sandbox(tmp_path_factory, "node_state", ADDRESSES) as (scratch, checkout, base):
        f = Fleet(checkout, base, scratch)
        quick_stand_in(f.node(CYAN).profile)
        # Both ends of a hold change stored on cyan, and both have served.
        for _ in range(2):
            f.change()
            result = f.release()
            assert result.returncode == 0, result.stdout + result.stderr
        f.settled()
        yield f


# --- 1. every node file read defensively ---------------------------------------------------------------


#: Record-shaped JSON with the wrong types, per file.
WRONG_TYPES = {
    "serving.json": {"schema": 1, "engine": 5, "vllm_release": [], "module": "x", "units": 3, "services": "all",
                     "layout": None, "voice": 1},
    "switching.json": {"schema": 2, "from": 5, "to": ["x"], "node": None, "host": 1, "pid": "me", "user": 2,
                       "started_at": "now", "steps": {}},
    "history.jsonl": {"schema": 2, "switch": ["s"], "served": "yes", "result": 7, "after": 5, "before": [],
                      "target": {}, "started_at": "soon", "rollout": ["r"], "duration_s": "x"},
    "voice.status": {"schema": 1, "state": 5, "drain_id": [], "written_at": "soon", "calls_in_progress": "many"},
}
#: A release id that no node stores.
NOT_STORED = "0123456789abcdef"

#: How a line says what the damage is, per form.
DAMAGE = {
    "missing": r"missing|not found|no such|does not exist|not stored",
    "empty": r"empty|not JSON|corrupt|truncated|EOF",
    "torn": r"not JSON|torn|truncated|corrupt|EOF",
    "not-json": r"not JSON|corrupt|invalid",
    "wrong-shape": r"wrong shape|not a record|not an object|should be an object|corrupt|not a release",
    "wrong-types": r"wrong type|should be a valid|not a valid|corrupt|invalid|not a release",
    "not-utf8": r"UTF-8|utf-8|codec|not JSON|not text",
    "directory": r"directory|EISDIR|not a regular file",
    "symlink": r"symlink|link|not a regular file",
    "absolute-link": r"symlink|link|points at",
    "dangling": r"symlink|link|not stored|not found|no such|not a regular file",
    "regular-file": r"regular file|not a link|not a symlink",
    "left-behind": r"present|left behind|drained",
}
UNREADABLE = r"|unreadable|damaged"

#: How a line names the file.
NAMES = {
    "serving.json": r"serving\.json",
    "units": r"flatshare-engine\.service|releases/[0-9a-f]{16}\b",
    "current": rf"releases/current\b|{NOT_STORED}",
    "switching.json": r"switching\.json",
    "lock.json": r"lock\.json",
    ".lock": r"releases/\.lock\b",
    "history.jsonl": r"history\.jsonl",
    "release.log": r"release\.log",
    "voice.drain": r"voice\.drain",
    "voice.status": r"voice\.status",
}


@dataclass(frozen=True)
class Case:
    """One file in one form of damage, and what each command must do about it.

    Attributes:
        file: which file (a key of NAMES).
        form: which damage (a key of DAMAGE).
        release: the exit codes ``flatshare release`` may give (errors.Exit).
        dry: the exit codes ``flatshare rollback --dry-run`` may give.
        named: which commands must print one line naming the file and the damage: R release,
            D rollback --dry-run, S status, H releases (the history listing), C serving-check.
            A command that does not read the file is not asked to name it, and must answer as on a
            healthy node (status 0, serving-check 0).
        serving: the node must take calls right after the commands.
        named_if_failing: commands that may end well or fail on this damage, but name it when they fail.
    """

    file: str
    form: str
    release: tuple[int, ...] = (0,)
    dry: tuple[int, ...] = (0,)
    named: str = ""
    serving: bool = True
    named_if_failing: str = ""

    @property
    def id(self) -> str:
        return f"{self.file}-{self.form}"


#: The damaged files of the history, the log and the voice worker: a group of their own (the first half of
#: the cases stays in the module's group), so that the two halves run apart.
DAMAGED_LOGS = pytest.mark.xdist_group("test_node_state_damaged_logs")


def case(file, form, release=(0,), dry=(0,), named="", serving=True, named_if_failing=""):
    marks = [DAMAGED_LOGS] if file in ("history.jsonl", "release.log", "voice.drain", "voice.status") else []
    return pytest.param(Case(file, form, release, dry, named, serving, named_if_failing), id=f"{file}-{form}",
                        marks=marks)


# Exit codes (flatshare_ops/errors.py): 0 released/done, 1 failed mid-switch (journal kept), 3 refused,
# 5 damaged node state. A damaged *old* release (the active one's files) is not a reason to refuse: the
# release plans a whole switch and names the damage in a note (exit 0). A damaged journal, history file or
# current link is refused before any change with exit 5 (the node's own record cannot be trusted).
CASES = [
    # The active release's serving.json: the release replaces that release (whole switch, a note), the dry
    # run plans around it, serving-check (which reads it) is UNKNOWN naming it.
    case("serving.json", "missing", named="RDSC"),
    case("serving.json", "empty", named="RDSC"),
    case("serving.json", "torn", named="RDSC"),
    case("serving.json", "wrong-shape", named="RDSC"),
    case("serving.json", "wrong-types", named="RDSC"),
    case("serving.json", "directory", named="RDSC"),
    # serving-check reads serving.json through links on purpose (current is one): a link to intact content
    # is no damage to it (exit 0); the release and status, which must trust the file, name it.
    case("serving.json", "symlink", named="RDS"),
    case("serving.json", "dangling", named="RDSC"),
    # The active release's engine unit: status and serving-check read the active release whole, checked against
    # its id (issue 22), so they name it too.
    case("units", "missing", named="RDSC"),
    case("units", "empty", named="RDSC"),
    case("units", "torn", named="RDSC"),
    case("units", "not-utf8", named="RDSC"),
    case("units", "directory", named="RDSC"),
    case("units", "dangling", named="RDSC"),
    # releases/current: not a link to a release id -> exit 5 and 'move it aside' (release, rollback);
    # serving-check reads it by the same rule (common/current_link.py): UNKNOWN, naming it.
    case("current", "regular-file", release=(5,), dry=(5,), named="RDSC"),
    case("current", "directory", release=(5,), dry=(5,), named="RDSC"),
    case("current", "absolute-link", release=(5,), dry=(5,), named="RDSC"),
    case("current", "dangling", named="RDSC"),
    case("current", "missing", named="SC"),
    # The journal: never trusted when damaged, never overwritten: exit 5; serving-check WARNING.
    case("switching.json", "empty", release=(5,), dry=(5,), named="RDSC"),
    case("switching.json", "torn", release=(5,), dry=(5,), named="RDSC"),
    case("switching.json", "wrong-shape", release=(5,), dry=(5,), named="RDSC"),
    case("switching.json", "wrong-types", release=(5,), dry=(5,), named="RDSC"),
    case("switching.json", "directory", release=(5,), dry=(5,), named="RDSC"),
    case("switching.json", "dangling", release=(5,), dry=(5,), named="RDSC"),
    # lock.json with no release holding the lock: a dead holder's note, only ever overwritten (the kernel's
    # lock is what holds); nothing reads it then. (Held: test_a_damaged_lock_record_is_named_...)
    case("lock.json", "not-json"),
    case("lock.json", "directory"),
    case("lock.json", "dangling"),
    # The lock's own file: a release must take the lock, so it cannot go on (exit 5, or 3); nothing else takes it.
    case(".lock", "directory", release=(3, 5), named="R"),
    case(".lock", "dangling", release=(3, 5), named="R"),
    # The history: a damaged line is skipped and named; the file itself unusable -> exit 5. With no history
    # (missing, empty) a rollback has nothing that served to return to: refused, exit 3.
    case("history.jsonl", "missing", dry=(3,)),
    case("history.jsonl", "empty", dry=(3,)),
    case("history.jsonl", "torn", named="RDSH"),
    case("history.jsonl", "not-json", named="RDSH"),
    case("history.jsonl", "not-utf8", named="RDSH"),
    case("history.jsonl", "wrong-types", named="RDSH"),
    case("history.jsonl", "directory", release=(5,), dry=(5,), named="RDSH"),
    case("history.jsonl", "dangling", release=(5,), dry=(5,), named="RDSH"),
    # release.log: written, never read; output never ends a switch (a note says the log is not kept).
    case("release.log", "missing"),
    case("release.log", "directory", named="R"),
    case("release.log", "symlink", named="R"),
    case("release.log", "dangling", named="R"),
    # voice.drain left behind: calls are given back by the release, which names it (so do the dry run,
    # status and serving-check); a directory cannot be removed: the drain step fails (exit 1), named. A
    # dangling link drains nobody (the worker reads no file), so it is no damage.
    case("voice.drain", "left-behind", named="RDSC"),
    case("voice.drain", "empty", named="RDSC"),
    case("voice.drain", "symlink", named="RDSC"),
    case("voice.drain", "directory", release=(1,), named="RDSC", serving=False),
    case("voice.drain", "dangling"),
    # voice.status: the worker's file, rewritten by the worker (atomically, replacing whatever entry is
    # there) as the drain begins: the release may wait for that fresh status and end well (0), or distrust
    # the damaged one and end the drain early (1) naming it. A directory cannot be replaced: exit 1, named.
    case("voice.status", "torn", release=(0, 1), named_if_failing="R"),
    case("voice.status", "wrong-types", release=(0, 1), named_if_failing="R"),
    case("voice.status", "dangling", release=(0, 1), named_if_failing="R"),
    case("voice.status", "directory", release=(1,), named="R"),
]


class Kept:
    """What was at a path before a test damaged it, to put back."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.kind = "link" if path.is_symlink() else "file" if path.is_file() else None
        assert not (path.is_dir() and not path.is_symlink()), f"{path} is a directory"
        # the link's text (a link) or the file's bytes (a file), else None
        self.data: Any = os.readlink(path) if self.kind == "link" else path.read_bytes() if self.kind == "file" else None

    def restore(self) -> None:
        clear(self.path)
        if self.kind == "link":
            os.symlink(self.data, self.path)
        elif self.kind == "file":
            self.path.write_bytes(self.data)


def clear(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def locate(fleet: Fleet, file: str) -> Path:
    releases = fleet.releases()
    active = releases / (fleet.current() or "")
    return {
        "serving.json": active / "serving.json",
        "units": active / "units" / ENGINE,
        "current": releases / "current",
        "switching.json": releases / "switching.json",
        "lock.json": releases / "lock.json",
        ".lock": releases / ".lock",
        "history.jsonl": releases / "history.jsonl",
        "release.log": releases / "release.log",
        "voice.drain": fleet.drain_file(),
        "voice.status": fleet.node().run_dir / "voice.status",
    }[file]


def damage(fleet: Fleet, c: Case, path: Path, original: bytes) -> None:
    """Put ``c.form`` of damage at ``path`` (whose bytes were ``original``)."""
    spare = fleet.scratch / "elsewhere"
    spare.mkdir(exist_ok=True)
    form = c.form
    if c.file == "history.jsonl" and form in ("torn", "not-json", "not-utf8", "wrong-types"):
        tail = {"torn": b'{"schema": 2, "switch": "torn-by-a-crash", "result": "rel',  # no newline
                "not-json": b"this is not JSON\n",
                "not-utf8": b"\xff\xfe\xfd not text\n",
                "wrong-types": json.dumps(WRONG_TYPES["history.jsonl"]).encode() + b"\n"}[form]
        path.write_bytes(original + tail)
        return
    clear(path)
    if form == "missing":
        return
    if form == "directory":
        path.mkdir()
        (path / "left-here").write_text("x\n")
    elif form in ("symlink", "left-behind") and c.file == "voice.drain":
        if form == "symlink":
            (spare / "a-drain-id").write_text("stale-drain\n")
            path.symlink_to(spare / "a-drain-id")
        else:
            path.write_text("stale-drain\n")
    elif form == "symlink":
        (spare / f"copy-of-{path.name}").write_bytes(original)
        path.symlink_to(spare / f"copy-of-{path.name}")
    elif form == "dangling":
        path.symlink_to(NOT_STORED if c.file == "current" else spare / f"gone-{path.name}")
    elif form == "absolute-link":
        path.symlink_to(fleet.releases() / original.decode())
    elif form == "regular-file":
        path.write_bytes(original + b"\n")
    else:
        path.write_bytes({
            "empty": b"",
            "torn": original[: len(original) * 2 // 3],
            "not-json": b"this is not JSON {\n",
            "wrong-shape": b"[1, 2, 3]\n",
            "not-utf8": b"\xff\xfe\xfd not text\n",
            "wrong-types": json.dumps(WRONG_TYPES.get(c.file, {})).encode() + b"\n",
        }[form])


def keep_stored_releases(fleet: Fleet) -> Path:
    """A copy of every stored release directory (a release with no history to keep it, e.g. when the
    history is missing, is pruned by the next release: the repair puts it back)."""
    copy = fleet.scratch / "stored-releases"
    shutil.rmtree(copy, ignore_errors=True)
    copy.mkdir()
    for directory in fleet.releases().iterdir():
        if re.fullmatch(r"[0-9a-f]{16}", directory.name) and directory.is_dir() and not directory.is_symlink():
            shutil.copytree(directory, copy / directory.name, symlinks=True)
    return copy


def repair(fleet: Fleet, c: Case, path: Path, kept: Kept, stored: Path) -> None:
    """Undo the damage, keeping what the commands rightly did meanwhile (a new history record, a switched
    current link), then bring the node back to settled."""
    for directory in stored.iterdir():
        if not (fleet.releases() / directory.name).exists():
            shutil.copytree(directory, fleet.releases() / directory.name, symlinks=True)
    if c.file == "history.jsonl":
        known = {r.get("switch") for r in json_lines(kept.data or b"")}
        new = [r for r in (json_lines(path.read_bytes()) if path.is_file() and not path.is_symlink() else [])
               if isinstance(r.get("switch"), str) and r.get("switch") not in known and r.get("schema") == 2]
        kept.restore()
        if new:
            with open(path, "ab") as f:
                if kept.data and not kept.data.endswith(b"\n"):
                    f.write(b"\n")
                f.write(b"".join(json.dumps(r, sort_keys=True).encode() + b"\n" for r in new))
    elif c.file == "current" and path.is_symlink() and (fleet.releases() / os.readlink(path)).is_dir() \
            and re.fullmatch(r"[0-9a-f]{16}", os.readlink(path)):
        pass  # the release pointed it at a stored release: that is the repair
    else:
        kept.restore()
    if c.file in ("voice.drain", "voice.status"):
        fleet.restart(VOICE)  # the stand-in worker's watcher stops on a directory where its file belongs
    fleet.finish()


def json_lines(raw: bytes) -> list[dict]:
    records = []
    for line in raw.decode(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


COMMANDS = {"R": "release", "D": "rollback --dry-run", "S": "status", "H": "releases", "C": "serving-check"}


def judge(c: Case, results: dict[str, subprocess.CompletedProcess]) -> list[str]:
    """What the commands did wrong for this case (empty: nothing)."""
    failures = []
    named = {COMMANDS[letter] for letter in c.named}
    named |= {COMMANDS[letter] for letter in c.named_if_failing if results[COMMANDS[letter]].returncode != 0}
    allowed = {
        "release": c.release,
        "rollback --dry-run": c.dry,
        # status: exit 5 when a node's state is damaged, 1 when it is otherwise unwell (a drain file left) (cli.py
        # docstring; test_node_damage.py holds each code to its case); serving-check: Nagios codes,
        # WARNING/CRITICAL/UNKNOWN for what it reads. The history listing's exit code is
        # test_flatshare_releases_exits_non_zero_when_a_history_cannot_be_read's subject.
        "status": (1, 5) if "status" in named else (0,),
        "serving-check": (1, 2, 3) if "serving-check" in named else (0,),
        "releases": None if "releases" in named else (0,),
    }
    name_re = re.compile(NAMES[c.file])
    # A voice drain file's damage is that it is there (the worker takes no calls); serving-check, a plugin
    # reading one path, names the path and why it cannot use it.
    damage_re = re.compile(DAMAGE[c.form] + UNREADABLE + ("|present" if c.file == "voice.drain" else ""))
    check_re = re.compile(damage_re.pattern + "|not found|no active release")
    for command, result in results.items():
        text = text_of(result)
        said = check_re if command == "serving-check" else damage_re
        if "Traceback" in text:
            failures.append(f"{command}: a traceback:\n{text[-3000:]}")
        if (codes := allowed[command]) is not None and result.returncode not in codes:
            failures.append(f"{command}: exit {result.returncode}, expected one of {allowed[command]}:\n{text[-1500:]}")
        if command in named and not any(name_re.search(line) and said.search(line) for line in text.splitlines()):
            failures.append(f"{command}: no line names {c.file} and its damage ({c.form}):\n{text[-1500:]}")
    return failures


@pytest.mark.parametrize("c", CASES)
def test_every_node_file_is_read_defensively(fleet, c):
    expected = fleet.change()  # the release below is a real change
    path = locate(fleet, c.file)
    kept = Kept(path)
    original = os.readlink(path).encode() if kept.kind == "link" else (kept.data or b"")
    stored = keep_stored_releases(fleet)
    try:
        damage(fleet, c, path, original)
        if c.file.startswith("voice."):
            time.sleep(0.3)  # the worker polls its drain file every 50 ms
        results = fleet.read_everything()
        results["release"] = fleet.release()
        failures = judge(c, results)
        if results["release"].returncode == 0 and fleet.current() != expected:
            failures.append(f"release: exit 0 but releases/current is {fleet.current()}, not {expected}")
        if c.serving:
            failures += [f"after the commands the node does not take calls: {p}" for p in fleet.calls_problems()]
    finally:
        repair(fleet, c, path, kept, stored)
    assert not failures, "\n\n".join(failures)


def test_a_history_line_42_does_not_stop_releases_rollback_or_a_release_that_switches_and_prunes(fleet):
    history = fleet.releases() / "history.jsonl"
    original = history.read_bytes()
    # A release directory no history names (never served): the next release's prune removes it.
    unserved = fleet.releases() / "00000000000000aa"
    shutil.copytree(fleet.releases() / fleet.current(), unserved)
    expected = fleet.change()
    try:
        history.write_bytes(original + b"42\n")
        line = len(original.decode(errors="replace").splitlines()) + 1
        note = f"history.jsonl:{line}: not a record"
        listing = fleet.cli("releases", "--node", CYAN)
        assert listing.returncode == 0 and note in listing.stdout, text_of(listing)
        assert fleet.history()[-1]["result"] in ("released", "rolled back")
        dry = fleet.cli("rollback", "--dry-run", "--root", str(fleet.checkout), env={"FLATSHARE_NODE": CYAN})
        assert dry.returncode == 0 and note in dry.stdout, text_of(dry)
        result = fleet.release()
        assert result.returncode == 0, text_of(result)
        assert "Traceback" not in text_of(result)
        assert fleet.current() == expected
        assert f"removed old release {unserved.name}" in result.stdout and not unserved.exists()
        last = fleet.history()[-1]
        assert (last["result"], last["after"], last["served"]) == ("released", expected, True)
        assert b"\n42\n" in history.read_bytes()  # the damaged line is kept, never rewritten
    finally:
        shutil.rmtree(unserved, ignore_errors=True)
        history.write_bytes(b"".join(line + b"\n" for line in history.read_bytes().splitlines() if line != b"42"))
    fleet.settled()


def test_a_current_link_replaced_by_a_regular_file_is_refused_in_one_line_saying_to_move_it_aside(fleet):
    link = fleet.releases() / "current"
    active = os.readlink(link)
    before = fleet.engine()[1]
    fleet.change()
    link.unlink()
    link.write_text(active + "\n")
    try:
        result = fleet.release()
        assert result.returncode == 5, text_of(result)  # damaged node state
        lines = [line for line in text_of(result).splitlines() if "releases/current" in line]
        assert len(lines) == 1, lines
        assert "regular file" in lines[0] and "move it aside" in lines[0] and f"mv {link} " in lines[0]
        assert "Traceback" not in text_of(result)
        assert link.is_file() and not link.is_symlink() and fleet.engine()[1] == before  # nothing changed
        assert not fleet.calls_problems()
    finally:
        link.unlink()
        link.symlink_to(active)
    fleet.settled()


def test_a_damaged_lock_record_is_named_while_a_release_holds_the_lock(fleet):
    from filelock import FileLock

    record = fleet.releases() / "lock.json"
    lock = FileLock(str(fleet.releases() / ".lock"))
    lock.acquire(timeout=0)  # a release holding the node, as the kernel's lock table shows it
    failures = []
    try:
        for content in (b"not JSON {\n", json.dumps({"host": 5, "pid": "me", "user": [], "release": {},
                                                      "started_at": "yesterday"}).encode()):
            record.write_bytes(content)
            fleet.change()
            refused = fleet.release()
            check = fleet.serving_check()
            assert refused.returncode == 3 and f"pid {os.getpid()}" in refused.stdout, text_of(refused)  # the kernel's
            assert "Traceback" not in text_of(refused) + text_of(check)
            for name, result in (("release", refused), ("serving-check", check)):
                if not any("lock.json" in line and re.search(r"damaged|not JSON|wrong", line)
                           for line in text_of(result).splitlines()):
                    failures.append(f"{name} does not name the damaged lock.json:\n{text_of(result)[-800:]}")
    finally:
        lock.release()
        record.unlink(missing_ok=True)
    fleet.settled()
    assert not failures, "\n".join(failures)


def test_serving_check_names_a_serving_json_of_the_wrong_types(fleet):
    path = fleet.releases() / fleet.current() / "serving.json"
    original = path.read_bytes()
    path.write_text(json.dumps(WRONG_TYPES["serving.json"]))
    try:
        check = fleet.serving_check()
    finally:
        path.write_bytes(original)
    fleet.settled()
    assert check.returncode == 3 and "Traceback" not in text_of(check)
    assert any("serving.json" in line and re.search(DAMAGE["wrong-types"], line)
               for line in check.stdout.splitlines()), check.stdout


def test_flatshare_releases_exits_non_zero_when_a_history_cannot_be_read(fleet):
    history = fleet.releases() / "history.jsonl"
    original = history.read_bytes()
    history.unlink()
    history.mkdir()
    try:
        listing = fleet.cli("releases", "--node", CYAN)
    finally:
        history.rmdir()
        history.write_bytes(original)
    assert "history.jsonl: is a directory" in listing.stdout, text_of(listing)
    assert listing.returncode in (1, 5), text_of(listing)


def test_a_history_record_of_the_wrong_types_does_not_crash_finishing_an_interrupted_switch(fleet):
    history = fleet.releases() / "history.jsonl"
    original = history.read_bytes()
    fleet.change()
    killed = fleet.release(env=faults(kill_after_step="stop-gateway"))
    assert fleet.journal().exists(), text_of(killed)
    history.write_bytes(original + json.dumps(WRONG_TYPES["history.jsonl"] | {"served": True}).encode() + b"\n")
    try:
        dry = fleet.cli("rollback", "--dry-run", "--root", str(fleet.checkout), env={"FLATSHARE_NODE": CYAN})
        result = fleet.release()
        serving = fleet.calls_problems(wait_s=5)
    finally:
        history.write_bytes(b"".join(line + b"\n" for line in history.read_bytes().splitlines()
                                     if b'"switch": ["s"]' not in line))
        fleet.finish()
    for command in (dry, result):
        assert "Traceback" not in text_of(command), text_of(command)
        assert command.returncode in (0, 1, 3, 5), text_of(command)
    assert not serving


# --- 2. appends a crash cannot corrupt ----------------------------------------------------------------


def test_a_journal_of_a_kind_the_schema_accepts_is_finished_or_refused_before_any_change(fleet):
    target = fleet.change()
    killed = fleet.release(env=faults(kill_after_step="stop-gateway"))
    assert fleet.journal().exists(), text_of(killed)
    journal = json.loads(fleet.journal().read_text())
    fleet.journal().write_text(json.dumps({**journal, "kind": "resume"}))
    before = fleet.engine()[1]
    try:
        result = fleet.release()
        restarted = fleet.engine()[1] != before
    finally:
        if fleet.journal().exists():
            fleet.journal().write_text(json.dumps({**json.loads(fleet.journal().read_text()), "kind": "release"}))
        fleet.finish()
    assert "Traceback" not in text_of(result)
    finished = result.returncode == 0 and fleet.current() == target
    refused = result.returncode == 5 and not restarted and "switching.json" in result.stdout
    assert finished or refused, text_of(result)


def test_a_torn_last_history_line_does_not_swallow_the_next_record(fleet):
    history = fleet.releases() / "history.jsonl"
    original = history.read_bytes()
    torn = b'{"schema": 2, "switch": "torn-by-a-crash", "result": "rel'
    history.write_bytes(original + torn)  # a crash mid-append: no newline
    expected = fleet.change()
    try:
        result = fleet.release()
        assert result.returncode == 0, text_of(result)
        lines = history.read_bytes().splitlines()
        assert lines[-2] == torn  # the torn fragment stays on a line of its own
        record = json.loads(lines[-1])  # and the new record is whole, on its own line
        assert (record["result"], record["after"], record["served"]) == ("released", expected, True)
        listing = fleet.cli("releases", "--node", CYAN)
        assert "not JSON (a torn or damaged line); skipped" in listing.stdout, text_of(listing)
        assert f"-> {expected}: released" in listing.stdout
    finally:
        history.write_bytes(b"".join(line + b"\n" for line in history.read_bytes().splitlines() if line != torn))
    fleet.settled()


@pytest.fixture(scope="module")
def write_calls(fleet) -> list[tuple[str, str]]:
    """Every durable write (primitive, path) of one release between two stored releases, in call order,
    as the call recorder saw them: the Nth of them is what ``faults(fail=..., nth=N)`` fails."""
    record = fleet.scratch / "calls.tsv"
    # Both ends of a hold change stored again first: the module's fleet may come from tests of another group run
    # in this process before (xdist can give one process both), whose releases' prunes removed one end.
    for _ in range(2):
        fleet.change()
        stored = fleet.release()
        assert stored.returncode == 0, text_of(stored)
    fleet.change()
    result = fleet.release(env={"PYTHONPATH": str(CALLS), "FLATSHARE_TEST_CALLS": str(record)})
    assert result.returncode == 0, text_of(result)
    calls = [tuple(line.split("\t", 1)) for line in record.read_text().splitlines()]
    assert calls and not any("/releases/." in path for _, path in calls), calls  # both ends already stored
    # (the kept preflight, releases/.preflight/, is a cache written without these primitives)
    fleet.settled()
    return calls


@WRITES
def test_a_crash_between_the_history_record_and_the_journal_removal_never_records_a_switch_twice(fleet, write_calls):
    removes = [path for primitive, path in write_calls if primitive == "remove"]
    k = next(i for i, path in enumerate(removes, 1) if path.endswith("/releases/switching.json"))
    # (the journal's removal: right after the history append, in record-history)
    expected = fleet.change()
    since = len(fleet.history())  # the module's fleet may carry other tests' records (write_calls says why)
    crashed = fleet.release(env=faults(fail="remove", nth=k, errno="ENOSPC"))
    assert "Traceback" not in text_of(crashed)
    assert fleet.journal().exists(), text_of(crashed)  # the fault fell between the two
    switch = json.loads(fleet.journal().read_text())["switch"]
    assert any(r.get("switch") == switch and r.get("result") == "released" for r in fleet.history())
    after = fleet.release()
    assert after.returncode in (0, 4), text_of(after)
    assert fleet.current() == expected
    fleet.settled()
    written = fleet.history()[since:]  # what the crashed release and the one after it recorded
    assert any(r.get("switch") == switch for r in written), written
    twice = {s: n for s, n in Counter(r.get("switch") for r in written).items() if n > 1}
    assert not twice, [r for r in written if r.get("switch") in twice]


# --- 3. the one early-end rule, whatever write fails --------------------------------------------------


def fail_each_write(fleet: Fleet, primitive: str, ns: list[int], calls: list[tuple[str, str]]) -> list[str]:
    """Release with the Nth ``primitive`` call failing (ENOSPC), for each N; after each failure check the
    early-end rule and that the next release finishes. Returns what went wrong."""
    mine = [c for c in calls if primitive == "any" or c[0] == primitive]
    failures = []
    for n in ns:
        expected = fleet.change()
        before = (fleet.current(), len(fleet.history()))
        result = fleet.release(env=faults(fail=primitive, nth=n, errno="ENOSPC"))
        text = text_of(result)
        where = mine[n - 1] if n <= len(mine) else None
        label = f"fail={primitive} nth={n} ({where[0]} {where[1]})" if where else f"fail={primitive} nth={n}"
        if "Traceback" in text:
            failures.append(f"{label}: a traceback:\n{text[-2000:]}")
        if where is None:  # past the last write: the fault cannot fire, the release passes, the loop ends
            if result.returncode != 0 or fleet.current() != expected:
                failures.append(f"{label}: no fault to fire, yet exit {result.returncode}:\n{text[-1500:]}")
            break
        if where[1].endswith("/outcomes.jsonl"):
            # What the command ended with, kept for a follow-up after the switch ended: a failed write is
            # said and the release's own result stands.
            if (result.returncode, fleet.current()) != (0, expected) or "outcome could not be kept" not in text:
                failures.append(f"{label}: exit {result.returncode}, expected 0 and a note:\n{text[-1500:]}")
            continue
        if where[1].endswith("/lock.json"):
            # lock.json only tells people who holds the lock (the kernel's lock is what holds): a failed
            # write or removal of it is ignored and the release goes on.
            if result.returncode != 0 or fleet.current() != expected:
                failures.append(f"{label}: exit {result.returncode}, expected 0:\n{text[-1500:]}")
            continue
        recorded = where[0] == "remove" and where[1].endswith("/releases/switching.json")
        if recorded and result.returncode == 0:
            # The journal's removal comes after the history record: the switch is done and recorded, so the
            # release may end well and say the journal is left (the next run removes it), as long as it says so.
            if "journal could not be removed" not in text or fleet.current() != expected:
                failures.append(f"{label}: exit 0 without saying the journal is left:\n{text[-1500:]}")
        elif result.returncode not in (1, 3, 5):
            failures.append(f"{label}: exit {result.returncode}, expected 1 (or 3/5 before the switch began):\n"
                            f"{text[-1500:]}")
        if result.returncode in (3, 5) and (fleet.journal().exists() or (fleet.current(), len(fleet.history())) != before):
            failures.append(f"{label}: exit {result.returncode} but the journal/history say something changed")
        if fleet.drain_file().exists():
            failures.append(f"{label}: {fleet.drain_file()} left behind")
        gateway = fleet.active(GATEWAY)
        if gateway != "active":
            failures.append(f"{label}: the gateway is {gateway} after the early end")
        failures += [f"{label}: {p}" for p in fleet.calls_problems(wait_s=10)]
        finished = fleet.release()
        check = fleet.serving_check()
        if finished.returncode not in (0, 4) or fleet.current() != expected or check.returncode != 0 \
                or fleet.journal().exists():
            # 4: the failed write came after the switch was complete and recorded (nothing left to do)
            failures.append(f"{label}: the next release did not finish it (exit {finished.returncode}, current "
                            f"{fleet.current()}, serving-check {check.returncode}):\n{text_of(finished)[-1500:]}\n"
                            f"{check.stdout[-800:]}")
            fleet.finish()
    return failures


@WRITES
def test_a_failed_write_anywhere_in_a_switch_ends_it_early_and_the_next_release_finishes(fleet, write_calls):
    # Every durable write of a switch fails once, in turn (every primitive counted together, so this is
    # each write_atomic, append_line, replace_symlink and remove), then one past the end.
    ns = list(range(1, len(write_calls) + 2))
    failures = fail_each_write(fleet, "any", ns, write_calls)
    fleet.settled()
    assert not failures, "\n\n".join(failures)


@WRITES
@pytest.mark.parametrize("primitive, nth", [("rename", 1), ("write_atomic", 2)])
def test_a_failed_write_while_storing_the_release_is_one_line_not_a_traceback(fleet, primitive, nth):
    expected = fleet.fresh()  # a release the node has not stored: it is written first
    before = fleet.current()
    result = fleet.release(env=faults(fail=primitive, nth=nth, errno="ENOSPC"))
    problems = fleet.calls_problems(wait_s=5)
    still, stored = fleet.current(), (fleet.releases() / expected).exists()
    fleet.finish()
    assert "Traceback" not in text_of(result), text_of(result)
    assert result.returncode in (1, 3, 5), text_of(result)
    assert not problems and still == before and not stored


@WRITES
def test_a_failed_first_journal_write_does_not_claim_a_journal_is_kept(fleet, write_calls):
    n = next(i for i, (name, path) in enumerate([c for c in write_calls if c[0] == "write_atomic"], 1)
             if path.endswith("/releases/switching.json"))
    fleet.change()
    before = (fleet.current(), fleet.history())
    result = fleet.release(env=faults(fail="write_atomic", nth=n, errno="ENOSPC"))
    assert result.returncode in (1, 3, 5) and not fleet.journal().exists(), text_of(result)
    assert "Traceback" not in text_of(result)
    assert (fleet.current(), fleet.history()) == before  # nothing changed...
    assert "is kept" not in result.stdout, result.stdout  # ...and it does not claim a journal was kept
    assert not fleet.calls_problems()
    fleet.finish()


# --- 4. a real full disk and a real read-only filesystem ------------------------------------------------


def _du(path: Path) -> int:
    return sum(p.lstat().st_size for p in path.rglob("*"))


@contextmanager
def tmpfs_over_releases(fleet: Fleet):
    """The node's releases directory on a small tmpfs of its own, its content copied in (and what the node
    left there copied back out at the end); yields the directory. Always unmounted."""
    releases = fleet.releases()
    before = fleet.scratch / "releases-before-tmpfs"
    after = fleet.scratch / "releases-on-tmpfs"
    for d in (before, after):
        shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(releases, before, symlinks=True)
    size = (_du(before) // (1 << 20) + 2) << 20  # what it holds, plus a MiB or two of room
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(releases)], check=True)
    try:
        shutil.copytree(before, releases, symlinks=True, dirs_exist_ok=True)
        yield releases
    finally:
        source = before
        try:
            (releases / ".filler").unlink(missing_ok=True)
            shutil.copytree(releases, after, symlinks=True)
            source = after
        finally:
            if subprocess.run(["umount", str(releases)], check=False).returncode != 0:
                subprocess.run(["umount", "-l", str(releases)], check=True)
            for entry in releases.iterdir():
                clear(entry)
            shutil.copytree(source, releases, symlinks=True, dirs_exist_ok=True)
            shutil.rmtree(before, ignore_errors=True)
            shutil.rmtree(after, ignore_errors=True)


def fill(directory: Path) -> None:
    """Fill the filesystem of ``directory`` until it says ENOSPC."""
    fd = os.open(directory / ".filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * (1 << 16))
    except OSError as err:
        assert err.errno == 28, err
    finally:
        os.close(fd)
    fd = os.open(directory / ".filler", os.O_WRONLY | os.O_APPEND)  # and the last partial page
    try:
        while True:
            os.write(fd, b"\0" * 512)
    except OSError:
        pass
    finally:
        os.close(fd)


def _early_end_then_finish(fleet: Fleet, process: subprocess.Popen, expected: str, errno_name: str,
                           free) -> None:
    out, _ = process.communicate(timeout=180)
    assert process.returncode == 1, out
    assert "Traceback" not in out, out
    assert errno_name in out, out
    # The early-end rule: calls given back, the gateway started again, the engine serving.
    assert not fleet.drain_file().exists()
    assert fleet.active(GATEWAY) == "active"
    assert not fleet.calls_problems(), fleet.calls_problems()
    free()
    finished = fleet.release()
    assert finished.returncode == 0, text_of(finished)
    assert fleet.current() == expected
    assert fleet.serving_check().returncode == 0


@WRITES
def test_a_disk_that_fills_mid_switch_ends_it_early_and_the_next_release_finishes(fleet):
    expected = fleet.change()
    with tmpfs_over_releases(fleet) as releases:
        process = fleet.popen_release(env=faults(sleep_in_step="restart-engine", seconds=3))
        try:
            wait_for_step(fleet.journal(), "restart-engine")
            fill(releases)
        except BaseException:
            process.kill()
            process.communicate()
            raise
        _early_end_then_finish(fleet, process, expected, "ENOSPC", lambda: (releases / ".filler").unlink())
    fleet.settled()


@WRITES
def test_a_state_directory_that_turns_read_only_mid_switch_ends_it_early_and_the_next_release_finishes(fleet):
    releases = fleet.releases()
    expected = fleet.change()
    mounted = False
    process = fleet.popen_release(env=faults(sleep_in_step="restart-engine", seconds=3))
    try:
        wait_for_step(fleet.journal(), "restart-engine")
        # The directory as it is now, bound over itself read-only (a remount of the directory's own
        # mount would be refused while the switch holds release.log and .lock open for writing).
        subprocess.run(["mount", "--bind", str(releases), str(releases)], check=True)
        mounted = True
        subprocess.run(["mount", "-o", "remount,bind,ro", str(releases)], check=True)

        def writable_again() -> None:
            subprocess.run(["umount", str(releases)], check=True)

        _early_end_then_finish(fleet, process, expected, "EROFS", writable_again)
        mounted = False
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
        if mounted and subprocess.run(["umount", str(releases)], check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(releases)], check=True)
    fleet.settled()


@WRITES
def test_a_disk_full_before_a_release_gives_one_line_and_changes_nothing(fleet):
    fleet.fresh()  # a release the node has not stored: storing it is the first write
    before = fleet.current()
    with tmpfs_over_releases(fleet) as releases:
        fill(releases)
        result = fleet.release()
        problems = fleet.calls_problems(wait_s=5)
        still = fleet.current()
        (releases / ".filler").unlink()
    fleet.finish()
    assert "Traceback" not in text_of(result), text_of(result)
    assert result.returncode in (1, 3, 5) and "ENOSPC" in result.stdout, text_of(result)
    assert still == before and not problems


# --- 5. rollback only to what served --------------------------------------------------------------------


def _served(fleet: Fleet) -> list[str]:
    """Releases that served, newest first (from the history file itself)."""
    seen = []
    for r in reversed(fleet.history()):
        if r.get("result") in ("released", "rolled back") and r.get("served") and r.get("after") not in seen:
            seen.append(r.get("after"))
    return seen


def _rollbacks_skip_the_release_that_never_served(fleet: Fleet, left: str, failed: str, start: int,
                                                  reason: str) -> None:
    """After ``failed`` ended early (its journal kept): the first rollback goes back to ``left``, the second
    never to ``failed``; the history says failed / abandoned / rolled back with before and after."""
    assert fleet.journal().exists()
    assert failed not in _served(fleet)
    first = fleet.rollback()
    assert first.returncode == 0, text_of(first)
    assert fleet.current() == left and not fleet.journal().exists()
    assert fleet.serving_check().returncode == 0
    records = fleet.history()[start:]
    by_result = {r["result"]: r for r in records}
    assert set(by_result) == {"failed", "abandoned", "rolled back"}, records
    assert (by_result["failed"]["before"], by_result["failed"]["target"], by_result["failed"]["served"]) == \
        (left, failed, False)
    assert reason in by_result["failed"]["reason"], by_result["failed"]
    assert by_result["abandoned"]["target"] == failed and by_result["abandoned"]["switch"] == by_result["failed"]["switch"]
    rolled = by_result["rolled back"]
    assert (rolled["kind"], rolled["after"], rolled["served"]) == ("rollback", left, True)
    assert rolled["before"] in (failed, left)
    earlier = [r for r in _served(fleet) if r not in (left, failed)]
    second = fleet.rollback()
    assert fleet.current() != failed
    if second.returncode == 0:
        assert fleet.current() == earlier[0], (fleet.current(), earlier)
        assert fleet.history()[-1]["result"] == "rolled back" and fleet.history()[-1]["before"] == left
    else:
        assert second.returncode == 3 and fleet.current() == left, text_of(second)
    assert not fleet.calls_problems()
    assert fleet.serving_check().returncode == 0


@ROLLBACKS
def test_a_rollback_after_a_failed_start_returns_to_what_served_never_to_the_failed_release(fleet):
    left = fleet.current()
    start = len(fleet.history())
    # The engine loads for longer than its start budget: the release fails at restart-engine.
    with fleet.profile_edit(CYAN, {"start_timeout_s = 60": "start_timeout_s = 5",
                                   'FLATSHARE_STANDIN_LOAD_S = "0.2"': 'FLATSHARE_STANDIN_LOAD_S = "8"'}):
        failed = fleet.fresh()
        result = fleet.release(CYAN, "--no-auto-rollback")
    try:
        assert result.returncode == 1, text_of(result)
        assert re.search(r"step \d+/\d+ restart-engine failed", result.stdout), result.stdout
        _rollbacks_skip_the_release_that_never_served(fleet, left, failed, start, "start budget")
    finally:
        fleet.finish()


@ROLLBACKS
def test_a_rollback_after_a_switch_interrupted_by_sigint_returns_to_what_served(fleet):
    left = fleet.current()
    start = len(fleet.history())
    failed = fleet.fresh()  # a release that never served
    process = fleet.popen_release(env=faults(sleep_in_step="restart-engine", seconds=10))
    try:
        wait_for_step(fleet.journal(), "restart-engine")
        switcher = held_by(fleet.releases() / ".lock")  # the node-side switch, from the kernel's lock table
        assert switcher, "no process holds the release lock"
        os.kill(switcher, signal.SIGINT)
        out, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    try:
        assert process.returncode == 1, out
        assert "interrupted by SIGINT" in out and "Traceback" not in out, out
        assert not fleet.calls_problems()  # the early end gave calls back
        _rollbacks_skip_the_release_that_never_served(fleet, left, failed, start, "SIGINT")
    finally:
        fleet.finish()


@ROLLBACKS
def test_a_release_whose_switch_failed_on_a_full_disk_after_its_engine_served_stays_a_rollback_target(fleet):
    # The switch to `failed` fails at switch-current (a full disk), after its engine started and answered: no
    # verdict on the release (node/history.py served_releases), which served once and does serve: a second
    # rollback may go back to it. (A failure that is a verdict: the node's rule, tests/test_plan.py.)
    left = fleet.current()
    failed = fleet.change()  # the other stored release: it served once, earlier
    assert failed in _served(fleet) and failed != left
    result = fleet.release(env=faults(fail="replace_symlink", nth=1, errno="ENOSPC"))
    try:
        assert result.returncode == 1 and fleet.journal().exists(), text_of(result)
        record = fleet.history()[-1]
        assert (record["result"], record["target"], record["verdict"]) == ("failed", failed, False), record
        first = fleet.rollback()
        assert first.returncode == 0 and fleet.current() == left, text_of(first)
        second = fleet.rollback()
        went = fleet.current()
    finally:
        fleet.finish()
    assert second.returncode == 0 and went == failed, text_of(second)


@ROLLBACKS
def test_a_refused_rollback_keeps_the_interrupted_switch_and_gives_calls_back(fleet):
    failed = fleet.change()
    killed = fleet.operator_release(env=faults(kill_after_step="stop-gateway"))
    assert "ended without its outcome" in killed.stdout, text_of(killed)
    journal = json.loads(fleet.journal().read_text())
    assert journal["to"] == failed
    assert fleet.active(GATEWAY) != "active" and fleet.drain_file().exists()  # killed mid-drain
    node = fleet.node()
    target = node.root / "bench/e2/point-3.conf"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text('[Service]\nEnvironment="E2_POINT=3"\n')
    link = node.manager.unit_dir / f"{ENGINE}.d/e2.conf"
    link.parent.mkdir(exist_ok=True)
    link.symlink_to(target)
    fleet.reload()
    try:
        refused = fleet.rollback()
        out = text_of(refused)
        assert refused.returncode == 3, out
        assert f"{ENGINE}.d/e2.conf -> {target}" in out and "Traceback" not in out
        assert "'flatshare-bench e2 reset' (not part of flatshare-ops)" in out and "by hand" in out
        # The interrupted switch is kept, not abandoned...
        assert json.loads(fleet.journal().read_text())["switch"] == journal["switch"]
        assert not any(r.get("result") == "abandoned" and r.get("switch") == journal["switch"] for r in fleet.history())
        # ...and calls were given back.
        assert not fleet.drain_file().exists()
        assert fleet.active(GATEWAY) == "active"
        assert not fleet.calls_problems()
        status = fleet.cli("status", "--node", CYAN)
        assert status.returncode == 1 and "UNFINISHED switch" in status.stdout and failed in status.stdout, \
            text_of(status)
    finally:
        link.unlink()
        fleet.reload()
    finished = fleet.release()
    assert finished.returncode == 0, text_of(finished)
    assert fleet.current() == failed
    fleet.settled()


@ROLLBACKS
def test_a_damaged_stored_release_is_rewritten_or_refused_before_any_drain(fleet):
    left, left_hold = fleet.current(), fleet.hold()
    back = fleet.change()  # another release: stored unless it never served (then pruned)
    if not (fleet.releases() / back).is_dir():
        assert fleet.release().returncode == 0  # leave left, which stays stored; then render it again
        fleet.set_hold(left_hold)
        left, back = back, fleet.expected_id()
    path = fleet.releases() / back / "serving.json"
    original = path.read_bytes()
    assert back != left and path.exists()
    path.write_bytes(original[: len(original) // 2])  # torn
    before = fleet.engine()[1]
    try:
        result = fleet.release()
        restarted = fleet.engine()[1] != before
        try:
            now_valid = isinstance(json.loads(path.read_bytes()), dict)
        except ValueError:
            now_valid = False
    finally:
        path.write_bytes(original)
        fleet.finish()
    assert "Traceback" not in text_of(result)
    assert (result.returncode == 0 and now_valid) or (result.returncode == 5 and not restarted), text_of(result)


@ROLLBACKS
def test_a_rollback_never_installs_a_truncated_unit_from_a_stored_release(fleet):
    left = fleet.current()
    target = next(r for r in _served(fleet) if r != left and (fleet.releases() / r).is_dir())
    unit = fleet.releases() / target / "units" / ENGINE
    original = unit.read_bytes()
    unit.write_bytes(original[: len(original) * 2 // 3])
    try:
        result = fleet.rollback()
        problems = fleet.calls_problems(wait_s=5)
    finally:
        unit.write_bytes(original)
        fleet.finish()
    assert "Traceback" not in text_of(result)
    assert result.returncode == 5 and any(ENGINE in line for line in result.stdout.splitlines()), text_of(result)
    assert not problems, problems


# --- 6. the engine's stop time does not eat its start budget -------------------------------------------


@ROLLBACKS
def test_the_engine_start_budget_counts_from_the_start_job_not_from_the_stop(fleet):
    drop_in = fleet.node().manager.unit_dir / f"{ENGINE}.d" / "50-slow-stop.conf"
    drop_in.parent.mkdir(exist_ok=True)
    # Stopping takes 11 s (a regular drop-in, not an E2 link: the release goes ahead with it), longer than the
    # whole start budget of 10 s; loading takes the stand-in's 0.2 s, leaving most of the budget to a loaded
    # machine's start-up (a Python start took over 4 s beside three other test processes). Counted from the stop,
    # the budget would be spent before /health answers.
    drop_in.write_text("[Service]\nExecStopPost=/bin/sleep 11\n")
    fleet.reload()
    log = fleet.releases() / "release.log"
    mark = log.stat().st_size
    try:
        with fleet.profile_edit(CYAN, {"start_timeout_s = 60": "start_timeout_s = 10"}):
            expected = fleet.change()
            before = fleet.engine()[1]
            result = fleet.release()
    finally:
        drop_in.unlink()
        fleet.reload()
    assert result.returncode == 0, text_of(result)
    assert fleet.current() == expected and fleet.engine()[1] != before
    assert "engine ready in" in result.stdout
    # The precondition held: stopping the engine took longer than the whole start budget (release.log's own
    # timestamps).
    text = log.read_bytes()[mark:].decode(errors="replace")
    stamps = {what: re.search(rf"^(\S+)   {what} {ENGINE}", text, re.MULTILINE) for what in ("stop", "start")}
    assert all(stamps.values()), text
    took = [time.mktime(time.strptime(stamps[w].group(1), "%Y-%m-%dT%H:%M:%SZ")) for w in ("stop", "start")]
    assert took[1] - took[0] >= 11, text
    fleet.settled()


# --- 7. every suggested command exists ------------------------------------------------------------------

SUGGESTED = re.compile(r"'((?:flatshare-node|flatshare|make) [^'\n]*)'")
#: A rollout's suggestions made by ``Rollout.command('WORDS')`` (control/rollout.py): ``flatshare WORDS``, with
#: ``--inventory`` when the run's inventory is not the default.
COMMANDED = re.compile(r"\bcommand\((?:f?)'([^'\n]*)'\)")


def _suggestions() -> dict[tuple[str, ...], set[str]]:
    """Every command the package's messages suggest in single quotes: (program, subcommand...) -> the
    options it names, placeholders ({...}, NAME, HEX) and values left out."""
    found: dict[tuple[str, ...], set[str]] = {}
    for source in sorted((REPO / "flatshare_ops").rglob("*.py")):
        code = source.read_text()
        for text in SUGGESTED.findall(code) + [f"flatshare {words} --inventory" for words in COMMANDED.findall(code)]:
            program, *words = text.split()
            command, options = [], set()
            for word in words:
                if word.startswith("--"):
                    options.add(word.split("=")[0])
                elif options or "{" in word or "=" in word or not re.fullmatch(r"[a-z][a-z0-9/-]*", word):
                    continue  # placeholders, values, VAR=value
                else:
                    command.append(word)
            # 'flatshare sandbox up/down' suggests both
            alternatives: list[list[str]] = [[]]
            for word in command:
                alternatives = [a + [w] for a in alternatives for w in word.split("/")]
            for alternative in alternatives:
                found.setdefault((program, *alternative), set()).update(options)
    return found


def test_every_command_a_message_suggests_exists():
    suggestions = _suggestions()
    assert ("flatshare", "release") in suggestions and ("make", "profiles") in suggestions, suggestions
    assert "--analysis" in suggestions[("flatshare", "release")], suggestions  # Rollout.command('release ...')
    commands = {}
    for key in suggestions:
        program, *words = key
        if program == "make":
            commands[key] = (["make", "-n", "-C", str(REPO), *words], {})
        else:
            commands[key] = ([str(BIN / program), *words, "--help"], {})
    results = run_at_once(commands)
    failures = []
    for key, result in results.items():
        shown = " ".join(key)
        if result.returncode != 0:
            failures.append(f"'{shown}': exit {result.returncode}: {text_of(result)[-400:]}")
        elif key[0] != "make":
            failures += [f"'{shown}' has no {option}" for option in sorted(suggestions[key])
                         if option not in result.stdout]
    assert not failures, "\n".join(failures)


def test_messages_naming_flatshare_bench_say_it_is_not_part_of_flatshare_ops_and_the_manual_way():
    windows = []
    for source in sorted((REPO / "flatshare_ops").rglob("*.py")):
        lines = source.read_text().splitlines()
        for i, line in enumerate(lines):
            if "flatshare-bench" in line:
                windows.append((f"{source.relative_to(REPO)}:{i + 1}", " ".join(lines[max(0, i - 3): i + 4])))
    assert windows
    for where, window in windows:
        assert "not part of flatshare-ops" in window, where
        assert "by hand" in window and "daemon-reload" in window, where


# --- 8. a release that does not serve backs itself out; a broken interrupted switch is never retried first --


SLOW_START = {"start_timeout_s = 60": "start_timeout_s = 5",
              'FLATSHARE_STANDIN_LOAD_S = "0.2"': 'FLATSHARE_STANDIN_LOAD_S = "8"'}


def _records_of(fleet: Fleet, start: int) -> list[tuple]:
    return [(r.get("switch"), r.get("result"), r.get("target"), r.get("served"), r.get("auto"))
            for r in fleet.history()[start:]]


@ROLLBACKS
@pytest.mark.parametrize("fault", ["the engine never answers /health within its start budget",
                                   "serving-check is CRITICAL after the switch (the module is not the pinned one)",
                                   "the engine answers /health 200 and no call (its first token never comes)"])
def test_a_release_whose_new_engine_does_not_serve_is_rolled_back_by_the_node_itself(fleet, fault):
    # The last: a breaker froze a real engine's core; /health still answered 200 and serving-check said OK.
    left = fleet.current()
    left_invocation = fleet.engine()[1]
    start = len(fleet.history())
    edits = SLOW_START if fault.startswith("the engine never") else {
        'FLATSHARE_STANDIN_LOAD_S = "0.2"': 'FLATSHARE_STANDIN_LOAD_S = "0.2"\nFLATSHARE_STANDIN_TTFT_S = "600"'
    } if fault.startswith("the engine answers") else {
        '\nsha256 = "': '\nsha256 = "0000000000000000000000000000000000000000000000000000000000000001"  # was "'}
    with fleet.profile_edit(CYAN, edits):
        failed = fleet.fresh()
        result = fleet.operator_release()
    assert result.returncode == 9, text_of(result)  # its own code: rolled back automatically
    assert "Traceback" not in text_of(result)
    step = "restart-engine" if fault.startswith("the engine never") else "serving-check"
    assert re.search(rf"^cyan: rolled back automatically: {step} failed: ", result.stdout, re.MULTILINE), result.stdout
    if fault.startswith("the engine answers"):
        assert re.search(r"^cyan: rolled back automatically: serving-check failed: a call through its gateway \S+ "
                         r"failed \(no answer", result.stdout, re.MULTILINE), result.stdout
    # The truth: the node runs what it left (a new engine process of it), serves, no journal.
    assert fleet.current() == left and fleet.engine()[1] != left_invocation
    fleet.settled()
    # The history says both parts, under the one switch id the operator knows.
    records = _records_of(fleet, start)
    assert [r[1:4] for r in records] == [("failed", failed, False), ("rolled back", left, True)], records
    assert records[0][0] == records[1][0] and records[0][0], records
    assert records[1][4] and records[1][4].startswith(f"{step} failed: "), records
    # A rollback from here never goes to the release that did not serve.
    assert failed not in _served(fleet)


@ROLLBACKS
def test_a_release_that_rolled_itself_back_is_refused_from_any_checkout_until_retried(fleet, tmp_path):
    # Issue 34: after an automatic rollback the checkout still renders the failed release, and the next
    # `flatshare release` (a timer, a second operator, the same one pressing up-arrow) drained the node for it
    # again. It is refused, from this checkout or a copy of it, naming when and why it failed, until --retry.
    import shutil

    left = fleet.current()
    edits = {'\nsha256 = "': '\nsha256 = "0000000000000000000000000000000000000000000000000000000000000001"  # was "'}
    with fleet.profile_edit(CYAN, edits):
        failed = fleet.fresh()
        # Two identical releases at once, both with --wait (a breaker's case: the one that waited went ahead
        # once the other had failed and rolled back): one switches and rolls itself back, the other waits for
        # it and is then refused by the guard, asked again after each wait.
        env = {**os.environ, "FLATSHARE_INVENTORY": str(fleet.inventory), "FLATSHARE_NODE": CYAN}
        argv = [str(BIN / "flatshare"), "release", "--root", str(fleet.checkout), "--wait", "90s"]
        runs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
                for _ in range(2)]
        outs = [run.communicate(timeout=300)[0] for run in runs]
        codes = sorted(zip((run.returncode for run in runs), outs))
        assert [c for c, _ in codes] == [3, 9], outs
        waited = codes[0][1]
        assert "waiting (--wait): " in waited and f"this checkout's release for cyan ({failed}) failed there" in \
            waited.split("waiting (--wait)")[-1], waited
        invocation = fleet.engine()[1]
        again = fleet.operator_release()
        other = shutil.copytree(fleet.checkout, tmp_path / "other-checkout")
        from_other = fleet.cli("release", "--node", CYAN, "--root", str(other))
        # cyan taking no calls (its gateway stopped): it asks no admission to drain, and the go-ahead it asks before
        # any change (the guard is read beside its switch) still carries the refusal.
        from flatshare_ops.common import systemd

        log = fleet.releases() / "release.log"
        mark = log.stat().st_size
        systemd.job(fleet.address(CYAN), "stop", GATEWAY, 60)
        try:
            undrained = fleet.operator_release()
        finally:
            systemd.job(fleet.address(CYAN), "start", GATEWAY, 60)
        said = log.read_bytes()[mark:].decode(errors="replace")
        refused_restarted = fleet.engine()[1] != invocation  # systemd's InvocationID: the same engine process
        listed = fleet.cli("releases", "--node", CYAN)
        retried = fleet.operator_release(CYAN, "--retry")
    assert "asking the operator's side whether to go on" in said and "admission to drain" not in said, said
    for refused in (again, from_other, undrained):
        assert refused.returncode == 3, text_of(refused)
        assert (f"this checkout's release for cyan ({failed}) failed there and was taken back (rolled back "
                "automatically, " in text_of(refused)) and "serving-check failed: " in text_of(refused), text_of(refused)
        assert "--retry" in text_of(refused) and "Traceback" not in text_of(refused)
    # Nothing was done for the refused ones: the engine the rollback started runs on, no switch recorded.
    records = fleet.history()
    assert [r["result"] for r in records if r.get("target") == failed].count("failed") == 2, text_of(retried)
    assert re.search(rf"^  FAILED {failed}: rolled back automatically \(serving-check failed: ", listed.stdout,
                     re.MULTILINE), listed.stdout
    # --retry tries it again: it fails as before and is rolled back again.
    assert retried.returncode == 9, text_of(retried)
    assert fleet.current() == left
    assert not refused_restarted and invocation != fleet.engine()[1]  # the retry restarted it; the refusals never
    fleet.settled()


@ROLLBACKS
def test_a_release_whose_guard_was_read_before_another_release_of_its_node_failed_there_is_refused(fleet, tmp_path):
    # The retry guard is read beside a switch, before the node takes its lock. Seen in CI: of two identical
    # releases with --wait, the one that waited read the guard just before the other's failure was recorded and
    # rolled back, took the lock just after, and switched to the release that had failed. Here the second's node
    # side is held before its lock until its guard has read cyan's history and the first has failed.
    left = fleet.current()
    start = len(fleet.history())
    edits = {'\nsha256 = "': '\nsha256 = "0000000000000000000000000000000000000000000000000000000000000001"  # was "'}
    may_switch, read = tmp_path / "may-switch", tmp_path / "histories-read"
    state = str(fleet.node().state_dir)
    with fleet.profile_edit(CYAN, edits):
        failed = fleet.fresh()
        env = {**os.environ, "FLATSHARE_INVENTORY": str(fleet.inventory), "FLATSHARE_NODE": CYAN,
               **faults(slow_command="switch", seconds=240, until=str(may_switch), announce="history", at=str(read))}
        second = subprocess.Popen([str(BIN / "flatshare"), "release", "--root", str(fleet.checkout)], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            from flatshare_ops.common.poll import poll_until

            assert poll_until(lambda: read.exists() and state in read.read_text(), 120, 0.1), "no history read"
            first = fleet.operator_release()
        finally:
            may_switch.touch()
        out = second.communicate(timeout=300)[0]
    assert first.returncode == 9, text_of(first)  # failed, rolled back automatically
    # Its summary row says where it went and where it came back to.
    assert re.search(rf"^\s+cyan\s+{left} -> {failed} -> {left}\s+-\s+rolled back automatically\s",
                     text_of(first), re.MULTILINE), text_of(first)
    assert second.returncode == 3, out
    assert f"this checkout's release for cyan ({failed}) failed there and was taken back" in out, out
    assert fleet.current() == left
    assert [r["result"] for r in fleet.history()[start:] if r.get("target") == failed] == ["failed"], \
        fleet.history()[start:]
    fleet.settled()


def _node_side_ended(fleet: Fleet) -> None:
    """Wait until cyan's switch process has ended by itself (an operator that went away answers it nothing)."""
    from node_processes import switch_pids

    from flatshare_ops.common.poll import poll_until

    assert poll_until(lambda: not switch_pids(fleet.node().state_dir), 60, 0.2), switch_pids(fleet.node().state_dir)


def _release_at_its_go_ahead(fleet: Fleet, tmp_path: Path, act,
                             asks: str = "asking the operator's side whether to go on") -> tuple[int, str]:
    """A release of cyan whose node waits for its go-ahead while the retry guard's read of cyan's history is held;
    ``act(operator, until)`` runs once the operator has printed a line holding ``asks`` (by default the node's
    line saying it asks; a node with nothing to do asks without a line: its "nothing to do" comes just before the
    ask). The guard answers once the file ``until`` exists, or when the operator has ended. Returns (the
    operator's exit code, all it printed)."""
    import tomlkit

    until = tmp_path / "histories-may-answer"  # until then, the guard's read of cyan's history waits
    # The read's bounds (the fault's and command_timeout_s) past the test's own: the operator's side ends with the
    # read still held, never by waiting it out (its threads for the guard once kept it 30 s past its summary).
    inventory = tomlkit.parse(fleet.inventory.read_text())
    inventory.setdefault("transport", tomlkit.table())["command_timeout_s"] = 600
    held = fleet.inventory.with_name("fleet-history-reads-held.toml")  # beside it: its relative paths hold
    held.write_text(tomlkit.dumps(inventory))
    env = {**os.environ, "FLATSHARE_INVENTORY": str(held), "FLATSHARE_NODE": CYAN,
           **faults(slow_command="history", seconds=600, until=str(until))}
    operator = subprocess.Popen([str(BIN / "flatshare"), "release", "--root", str(fleet.checkout)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    said = []
    try:
        assert operator.stdout is not None
        for line in operator.stdout:
            said.append(line)
            if asks in line:
                act(operator, until)
                break
        said.append(operator.communicate(timeout=120)[0])
    finally:
        until.touch()
        if operator.poll() is None:
            operator.kill()
    return operator.returncode, "".join(said)


@ROLLBACKS
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_operator_interrupted_while_its_node_waits_for_the_go_ahead_ends_with_its_summary(fleet, tmp_path, sig):
    # A breaker's case: a signal while the retry guard, read beside a single node's switch, still read the nodes'
    # histories: the summary said the node was "asking for admission to drain", and after it came a line from the
    # guard's thread, about a history that "could not be read (exit None: no output)".
    fleet.change()
    before = (fleet.current(), len(fleet.history()))
    code, out = _release_at_its_go_ahead(fleet, tmp_path, lambda operator, _until: operator.send_signal(sig))
    assert code == 128 + sig, out
    # The summary's line for cyan ends the output (the signal may come before or after the operator's side read
    # the go-ahead request: either way nothing changed there, and the node refuses without an answer).
    last = out.rstrip().splitlines()[-1]
    assert re.match(rf"{CYAN}: (was asking for the go-ahead|deciding on the node when interrupted) \(.*before any "
                    r"change\).* refuses", last), out
    assert "could not be read" not in out and "None" not in out and "Traceback" not in out, out
    # The node refused on its own, changing nothing.
    _node_side_ended(fleet)
    assert (fleet.current(), len(fleet.history())) == before and not fleet.journal().exists()
    fleet.settled()


@ROLLBACKS
def test_an_operator_interrupted_while_its_node_with_nothing_to_do_waits_for_the_go_ahead_says_nothing_to_do(
        fleet, tmp_path):
    # A breaker's case: SIGTERM while a node that had said "nothing to do" waited for the go-ahead (the retry
    # guard's verdict rides on it): the summary said it was "deciding on the node when interrupted (its checks and
    # preflight, before any change)". The node says it has nothing to do (its phase, before the line) and the
    # summary says that.
    synced = fleet.operator_release(CYAN, "--retry")  # on the checkout's release, whatever the tests before left
    assert synced.returncode in (0, 4), text_of(synced)
    before = (fleet.current(), len(fleet.history()))
    code, out = _release_at_its_go_ahead(fleet, tmp_path, lambda operator, _until: operator.send_signal(signal.SIGTERM),
                                         asks=f"already on {before[0]}; nothing to do")
    assert code == 143, out
    last = out.rstrip().splitlines()[-1]
    assert re.match(rf"{CYAN}: had nothing to do on the node when interrupted", last), out
    assert "deciding" not in out and "None" not in out and "Traceback" not in out, out
    _node_side_ended(fleet)
    assert (fleet.current(), len(fleet.history())) == before and not fleet.journal().exists()
    fleet.settled()


@ROLLBACKS
def test_an_operator_interrupted_while_the_automatic_rollback_asks_to_drain_says_the_node_stays_on_the_failed_release(
        fleet):
    # A breaker's case: SIGTERM while the node's automatic rollback (serving-check CRITICAL) asked for admission to
    # drain: the summary said the node "was asking for admission to drain: without an answer it refuses and
    # changes nothing", where the node stayed on the release that did not serve, its journal kept, until
    # 'flatshare rollback'. The node says its phase before the rollback asks; the summary says what is left.
    left = fleet.current()
    edits = {'\nsha256 = "': '\nsha256 = "0000000000000000000000000000000000000000000000000000000000000001"  # was "'}
    with fleet.profile_edit(CYAN, edits):
        failed = fleet.fresh()
        operator = subprocess.run([str(BIN / "flatshare"), "release", "--root", str(fleet.checkout), "--retry"],
                                  env={**os.environ, "FLATSHARE_INVENTORY": str(fleet.inventory), "FLATSHARE_NODE": CYAN,
                                       **signal_at("admission@rolling back")},
                                  capture_output=True, text=True, timeout=300)
    out = operator.stdout + operator.stderr
    assert operator.returncode == 143, out
    last = out.rstrip().splitlines()[-1]
    assert last.startswith(f"{CYAN}: its automatic rollback was asking for admission to drain when interrupted"), out
    assert "the node stays on the release that did not serve" in last and "'flatshare rollback --node cyan'" in last
    assert "Traceback" not in out and "None" not in out, out
    # What it says is so: the node ends by itself on the failed release, its journal kept ...
    _node_side_ended(fleet)
    assert fleet.journal().exists() and fleet.current() == failed, (fleet.current(), failed)
    # ... and the rollback it names takes it back.
    back = fleet.rollback()
    assert back.returncode == 0, text_of(back)
    assert fleet.current() == left
    fleet.settled()


@ROLLBACKS
def test_a_node_side_interrupted_before_its_switch_began_is_a_refusal_not_the_operators_own_signal(fleet, tmp_path):
    # A breaker's case: SIGTERM to the node's switch while it waited for the go-ahead (nothing changed yet) made
    # `flatshare release` exit 143, the code of a SIGTERM to the operator's side itself.
    from node_processes import switch_pids

    fleet.change()
    before = (fleet.current(), len(fleet.history()))

    def terminate_the_node_side(_operator, until: Path) -> None:
        (switch,) = switch_pids(fleet.node().state_dir)
        os.kill(switch, signal.SIGTERM)
        until.touch()  # the guard's verdict comes once the node's side has ended

    code, out = _release_at_its_go_ahead(fleet, tmp_path, terminate_the_node_side)
    assert code == 3, out
    assert "interrupted by SIGTERM before the switch began; nothing was changed" in out, out
    last = out.rstrip().splitlines()[-1]  # the summary's line for cyan says why, as the node said it
    assert last.startswith("cyan: refused: ") and "before the switch began; nothing was changed" in last, out
    assert "Traceback" not in out and "None" not in out, out
    assert (fleet.current(), len(fleet.history())) == before and not fleet.journal().exists()
    fleet.settled()


@ROLLBACKS
@pytest.mark.parametrize("fault", [{"auto_rollback_journal_fails": "ENOSPC"}, {"auto_rollback_journal_fails": "EROFS"},
                                   {"signal_at_auto_rollback": "SIGTERM"}],
                         ids=["full-disk", "read-only", "sigterm"])
def test_an_automatic_rollback_that_cannot_begin_ends_the_failed_switch_early_and_says_so(fleet, fault):
    # Breakers' cases: a full or read-only disk at the rollback's journal was reported "refused: nothing was
    # changed" (exit 3), and a SIGTERM as the rollback began "interrupted before the switch began; nothing was
    # changed" (exit 143), while the node sat drained with the failed switch's journal on disk.
    start = len(fleet.history())
    with fleet.profile_edit(CYAN, SLOW_START):
        broken = fleet.fresh()
        result = fleet.release(CYAN, env=faults(**fault))
    text = text_of(result)
    assert result.returncode == 1, text  # a failed switch, its journal kept: not a refusal, not an interruption
    assert "nothing was changed" not in text and "Traceback" not in text, text
    assert re.search(r"the automatic rollback to \w+ could not begin \(.+\); calls: ", text), text
    assert json.loads(fleet.journal().read_text())["to"] == broken
    assert not fleet.drain_file().exists()  # the early-end rule: the voice worker takes calls again
    assert [r[1:3] for r in _records_of(fleet, start)] == [("failed", broken)]  # recorded once
    fixed = fleet.release()  # the next run finishes: to the checkout's release, which serves
    assert fixed.returncode == 0, text_of(fixed)
    fleet.settled()


@ROLLBACKS
@pytest.mark.parametrize("step", ["install-units", "restart-engine"])
def test_an_interrupted_automatic_rollback_never_disqualifies_the_release_it_was_going_back_to(fleet, step):
    # A breaker's case: SIGTERM in the automatic rollback to A recorded A as failed; `rollback` then had "no
    # earlier release that served" (it excluded A, the interrupted switch's target), and the next release's
    # abandoned record of that rollback distrusted A for good: a later broken release left the node down.
    left = fleet.current()
    start = len(fleet.history())
    with fleet.profile_edit(CYAN, SLOW_START):
        broken = fleet.fresh()
        cut = fleet.release(CYAN, env=faults(signal_in_auto_rollback_step=step, signal="SIGTERM"))
    assert cut.returncode == 1, text_of(cut)  # the rollback ended early: a failed switch, journal kept
    # What it says the next rollback does is what it does (below); a breaker's case: it said rollback abandons it.
    assert f"the next 'flatshare rollback' goes on to {left}" in text_of(cut), text_of(cut)
    journal = json.loads(fleet.journal().read_text())
    assert (journal["kind"], journal["to"], journal["from"]) == ("rollback", left, broken), journal
    # Each part recorded under the one switch id: the release's failure, then the rollback's own early end.
    parts = [(r["switch"], r["kind"], r["result"], r["target"]) for r in fleet.history()[start:]]
    assert parts == [(journal["switch"], "release", "failed", broken),
                     (journal["switch"], "rollback", "failed", left)], parts
    assert "interrupted by SIGTERM" in fleet.history()[-1]["reason"], fleet.history()[-1]
    assert left in _served(fleet)
    shown = fleet.cli("status", "--node", CYAN)  # says what the unfinished switch was: an automatic rollback
    assert re.search(rf"UNFINISHED automatic rollback \(restart-engine failed: .*\): switch {broken} -> {left}",
                     shown.stdout), shown.stdout
    back = fleet.rollback(CYAN)  # goes on to where the interrupted rollback was going
    assert back.returncode == 0, text_of(back)
    assert fleet.current() == left and broken not in _served(fleet) and left in _served(fleet)
    fleet.settled()
    # And a later broken release still has A to go back to, by itself.
    with fleet.profile_edit(CYAN, SLOW_START):
        again = fleet.release(CYAN)
    assert again.returncode == 9, text_of(again)
    assert fleet.current() == left
    fleet.settled()
    assert [r[1] for r in _records_of(fleet, start)][-2:] == ["failed", "rolled back"]


@ROLLBACKS
def test_an_automatic_rollback_killed_midway_is_what_the_follow_up_reports_and_the_next_run_finishes(fleet):
    # A breaker's case: the follow-up after a lost node process reported only the failure the rollback followed
    # ("failed at restart-engine ... the next release finishes it"), never that a rollback began and stopped.
    left = fleet.current()
    start = len(fleet.history())
    with fleet.profile_edit(CYAN, SLOW_START):
        broken = fleet.fresh()
        cut = fleet.operator_release(env=faults(signal_in_auto_rollback_step="restart-engine", signal="SIGKILL"))
    text = text_of(cut)
    assert cut.returncode == 1 and "Traceback" not in text, text
    journal = json.loads(fleet.journal().read_text())
    assert (journal["kind"], journal["to"], journal["auto"] is not None) == ("rollback", left, True), journal
    # What the node says of the switch id the operator knows: the rollback, interrupted, with its cause.
    assert re.search(rf"the node says the switch was interrupted: automatic rollback \(restart-engine failed: "
                     rf".*\): switch {broken} -> {left}", text), text
    assert [(r["kind"], r["result"]) for r in fleet.history()[start:]] == [("release", "failed")]
    finished = fleet.rollback(CYAN)  # goes on to where the interrupted rollback was going: what served
    assert finished.returncode == 0, text_of(finished)
    assert fleet.current() == left and left in _served(fleet) and broken not in _served(fleet)
    fleet.settled()


@ROLLBACKS
def test_with_automatic_rollback_off_a_fixed_release_replaces_the_broken_interrupted_switch_at_once(fleet):
    left = fleet.current()
    start = len(fleet.history())
    with fleet.profile_edit(CYAN, SLOW_START):
        broken = fleet.fresh()
        failed = fleet.release(CYAN, "--no-auto-rollback")
    assert failed.returncode == 1, text_of(failed)
    assert json.loads(fleet.journal().read_text())["to"] == broken
    # The profile is fixed (the engine loads in time again) and the checkout renders another release.
    fixed = fleet.fresh()
    log = fleet.releases() / "release.log"
    mark = log.stat().st_size
    result = fleet.release()
    assert result.returncode == 0, text_of(result)
    text = log.read_bytes()[mark:].decode(errors="replace")
    # One switch, straight to the fixed release: the broken one's engine is never started again.
    assert f"(replacing the interrupted switch to {broken})" in text, text
    assert len(re.findall(r"step \d+/\d+ restart-engine$", text, re.MULTILINE)) == 1, text
    assert len(re.findall(r"step \d+/\d+ drain-voice$", text, re.MULTILINE)) == 1, text
    records = _records_of(fleet, start)
    assert [r[1:3] for r in records] == [("failed", broken), ("abandoned", broken), ("released", fixed)], records
    assert fleet.current() == fixed != left
    fleet.settled()


def test_a_node_left_serving_by_an_interrupted_switch_asks_admission_once_for_its_one_switch(fleet):
    # cyan's switch was killed after its voice drain ended (it takes calls again, its journal kept); the
    # checkout then renders another release, and peacock's gateway is stopped: the one switch that replaces
    # the interrupted one asks for admission before its only drain, and is refused (nothing drains).
    fleet.change()
    killed = fleet.operator_release(env=faults(kill_after_step="end-voice-drain"))
    assert "the node-side command ended without its outcome" in killed.stdout, text_of(killed)
    assert fleet.journal().exists() and not fleet.calls_problems()
    fleet.change()
    log = fleet.releases() / "release.log"
    mark = log.stat().st_size
    from flatshare_ops.common import systemd

    systemd.job(fleet.address("peacock"), "stop", GATEWAY, 60)
    try:
        result = fleet.release()
    finally:
        systemd.job(fleet.address("peacock"), "start", GATEWAY, 60)
    text = log.read_bytes()[mark:].decode(errors="replace")
    assert result.returncode == 3, text_of(result)
    assert "replacing the interrupted switch" in text, text
    assert text.count("asking the operator's side for admission to drain") == 1, text
    assert "may not drain now" in result.stdout and not re.search(r"step \d+/\d+ drain-voice", text), text
    assert not fleet.calls_problems()
    fleet.finish()


def test_a_first_release_that_does_not_serve_has_nothing_to_return_to_and_stays_failed_saying_so(tmp_path_factory):
    # A node with no release that ever served (its first release): the automatic rollback has nowhere to go.
    # The plan says so before the drain, the switch ends early (calls given back, nothing half-switched), the
    # history records the failure, and no rollback is claimed.
    addresses = loopback_pair(59)
    with scratch_sandbox(tmp_path_factory, "first", addresses, release=False) as (_, checkout, base):
        node = SandboxNode(CYAN, addresses[CYAN], base)
        quick_stand_in(node.profile)
        node.profile.write_text(_replaced(node.profile.read_text(), SLOW_START, node.profile))
        result = node_switch(base / "fleet.toml", checkout, CYAN, None)
        text = text_of(result)
        assert "Traceback" not in text and "None" not in text, text
        assert result.returncode == 1, text  # a release failed mid-switch (README, "Exit codes"): not 9
        assert re.search(r"^cyan: automatic rollback: none possible \(no earlier release that served is stored\)",
                         result.stdout, re.MULTILINE), result.stdout
        assert "rolled back automatically" not in result.stdout, result.stdout
        history = [json.loads(line) for line in (node.state_dir / "releases/history.jsonl").read_text().splitlines()]
        assert [(r["result"], r["served"], r.get("auto")) for r in history] == [("failed", False, None)], history
        assert not (node.run_dir / "voice.drain").exists()  # the drain ended: nothing left half-done


def _replaced(text: str, replacements: dict[str, str], path: Path) -> str:
    """``text`` (of ``path``) with each key replaced by its value; each key must be there."""
    for old, new in replacements.items():
        assert old in text, f"{path} has no {old!r}"
        text = text.replace(old, new)
    return text
