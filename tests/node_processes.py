"""The kernel's process table, read for the tests: which processes run a node's switch (standard library only)."""

from __future__ import annotations

from pathlib import Path


def cmdline(pid: int) -> list[str]:
    """``/proc/PID/cmdline``'s words; [] once the process is gone."""
    try:
        return [a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1]]
    except OSError:
        return []


def ppid(pid: int) -> int | None:
    """The parent's pid (``/proc/PID/status``, ``PPid:``); None once the process is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("PPid:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def pids() -> list[int]:
    """Every pid in /proc now."""
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]


def switch_pids(state_dir: Path) -> list[int]:
    """The node-side switch processes of the node whose state directory is ``state_dir`` (``flatshare-node
    switch`` / ``python -m flatshare_ops.node switch``). A switch forks a child with its own command line for each
    exchange with systemd: such a child is not a switch of its own, nor is one that ended while it was looked at
    (its parent unknown: a short exchange's child often has)."""
    state = str(state_dir)
    found = []
    for pid in pids():
        argv = cmdline(pid)
        if "switch" in argv and state in argv and any(
                a == "flatshare_ops.node" or a.endswith("/flatshare-node") or "flatshare_ops.node.cli" in a
                for a in argv):
            found.append(pid)
    parents = {pid: ppid(pid) for pid in found}
    return [pid for pid, parent in parents.items() if parent is not None and parent not in found]
