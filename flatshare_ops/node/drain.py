"""The voice worker's drain protocol, from the release's side.

docs/reference/release-protocol.md ("The voice drain"): the release writes the drain file
with a new drain id; it trusts only a status the worker wrote *after* this
drain began (a status file left from an earlier drain proves nothing); and it
removes the drain file whenever the drain ends early (error, interrupt,
timeout), so the worker takes calls again.

The status file is JSON: ``{"state": "serving"|"draining"|"drained",
"drain_id", "written_at" (Unix seconds), "calls_in_progress"}``.
"""

from __future__ import annotations

import os
import stat
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TypeGuard

from ..common import durable
from ..common.clock import is_time
from ..common.files import Damaged, read_json_object, what_is
from ..common.poll import poll_until
from ..errors import Exit, FlatshareError

POLL_S = 0.02


class DrainError(FlatshareError):
    """The voice worker did not confirm the drain (or its end) in time."""

    exit_code = Exit.FAILED


@dataclass(frozen=True)
class VoiceDrain:
    """One drain of the voice worker.

    Attributes:
        drain_file: the file whose presence asks the worker to drain.
        status_file: the file the worker writes its state to.
        drain_id: this drain's id (written into the drain file).
        began_at: when this drain began (Unix seconds); older statuses are not trusted.
    """

    drain_file: Path
    status_file: Path
    drain_id: str
    began_at: float


def read_status(status_file: Path) -> dict | None:
    """The worker's status, or None if it is missing or damaged (an untrusted file: never trusted, never fatal)."""
    try:
        return read_json_object(status_file)
    except Damaged:
        return None


def begin(drain_file: Path, status_file: Path) -> VoiceDrain:
    """Ask the worker to drain: write the drain file with a new drain id (atomically)."""
    drain = VoiceDrain(drain_file, status_file, uuid.uuid4().hex, time.time())
    drain_file.parent.mkdir(parents=True, exist_ok=True)
    durable.write_atomic(drain_file, (drain.drain_id + "\n").encode())
    return drain


def _written_at(status: dict) -> float:
    """When the worker wrote ``status`` (Unix seconds); 0 (older than any drain) when that is no time."""
    value = status.get("written_at")
    return float(value) if is_time(value) else 0.0


#: How far ahead of this clock a status may say it was written (seconds): more is a time that is no time yet.
AHEAD_S = 5.0


def _trusted(status: dict | None, drain: VoiceDrain) -> TypeGuard[dict]:
    """Written for this drain, after it began, and not in the future (a damaged file's year 9999 is no news)."""
    return bool(status and status.get("drain_id") == drain.drain_id
                and drain.began_at <= _written_at(status) <= time.time() + AHEAD_S)


def wait_drained(drain: VoiceDrain, timeout_s: float, progress=None, check=None, waiting=None) -> dict:
    """Wait until the worker reports ``drained`` for this drain, in a status written after it began.

    Args:
        drain: the drain in progress.
        timeout_s: how long to wait, in seconds.
        progress: called with a line when the number of calls in progress changes, and (without
            ``waiting``) at least every 10 s while waiting.
        waiting: called with the seconds waited, at least every 10 s while waiting (instead of a line).
        check: called at each poll while waiting; what it raises ends the wait (the switch's admission
            decided again).

    Returns:
        The trusted status.

    Raises:
        DrainError: no trusted ``drained`` status within ``timeout_s``.
    """
    seen: dict = {"calls": None}
    path = drain.status_file
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        mode = None
    if mode is not None and not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
        raise DrainError(f"{path}: is {what_is(mode)}, not the voice worker's status file, so no drain can be "
                         f"confirmed; remove it (rm -r {path}) and release again")

    def drained() -> dict | None:
        if check is not None:
            check()
        status = read_status(drain.status_file)
        if not _trusted(status, drain):
            return None
        if status.get("state") == "drained":
            return status
        calls = status.get("calls_in_progress")
        if progress and calls != seen["calls"]:
            progress(f"voice worker draining: {calls} call(s) in progress (up to {timeout_s:g} s)")
            seen["calls"] = calls
        return None

    def still(waited: float) -> None:
        if waiting:
            waiting(waited)
        elif progress:
            progress(f"still waiting for the voice worker to drain ({waited:.0f} s of {timeout_s:g} s)")

    status = poll_until(drained, timeout_s, POLL_S, still)
    if status is None:
        try:
            last = read_json_object(drain.status_file)
            said = f"last status: {last}" if last is not None else f"no status in {drain.status_file}"
        except Damaged as err:
            said = f"its status file is damaged: {err}"
        raise DrainError(f"voice worker did not report drained for drain {drain.drain_id} within {timeout_s:g} s "
                         f"({said})")
    return status


def end(drain_file: Path) -> None:
    """End the drain: remove the drain file (the worker takes calls again)."""
    durable.remove(drain_file)


def end_if_present(drain_file: Path) -> bool:
    """End a drain if its file is there (an early end, a refusal giving calls back); returns whether it was.

    Raises:
        OSError: the file is there but cannot be removed (read-only filesystem...).
    """
    if not (drain_file.exists() or drain_file.is_symlink()):
        return False
    try:
        return durable.remove(drain_file)
    except OSError:
        if drain_file.exists() or drain_file.is_symlink():
            raise
        return True  # removed; only the directory's fsync failed: the worker sees it gone


def wait_serving(drain_file: Path, status_file: Path, since: float, timeout_s: float) -> dict:
    """After :func:`end`: wait for a ``serving`` status written after ``since`` (Unix seconds).

    Raises:
        DrainError: the worker did not say it serves again within ``timeout_s``.
    """

    def serving() -> dict | None:
        status = read_status(status_file)
        if status and status.get("state") == "serving" and _written_at(status) >= since:
            return status
        return None

    status = poll_until(serving, timeout_s, POLL_S)
    if status is None:
        raise DrainError(f"voice worker did not report serving again within {timeout_s:g} s after {drain_file} was removed")
    return status
