"""Processes as the kernel reports them in ``/proc`` (standard library only: serving-check uses it)."""

from __future__ import annotations

import os
from pathlib import Path


def pid_alive(pid: object) -> bool:
    """True while ``pid`` is a live, non-zombie process.

    Never probes process groups or init: anything but an int above 1 is False
    (``kill(0, ...)`` and ``kill(-1, ...)`` address whole groups).
    """
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 1:
        return False
    try:
        waited, _ = os.waitpid(pid, os.WNOHANG)  # reaps our own exited children
        if waited == pid:
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/status") as f:
            state = next((line for line in f if line.startswith("State:")), "")
    except OSError:
        return False
    return "zombie" not in state.lower()


def read_cmdline(pid: int) -> list[str]:
    """A process's argv from ``/proc/PID/cmdline`` (NUL-separated words, undecodable bytes replaced).

    Raises:
        OSError: no such process, or its cmdline is unreadable.
    """
    raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    return [word.decode(errors="replace") for word in raw.split(b"\0")[:-1]]


def read_environ(pid: int) -> dict[str, str]:
    """A process's environment from ``/proc/PID/environ`` (as it was at exec; undecodable bytes replaced).

    Raises:
        OSError: no such process, or its environment is unreadable (another user's process).
    """
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    pairs = (word.decode(errors="replace").partition("=") for word in raw.split(b"\0") if word)
    return {key: value for key, _, value in pairs}
