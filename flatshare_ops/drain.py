"""The voice worker's drain protocol, from the release's side.

FACTS.md ("What a release does on a node"): the release writes the drain file
with a new drain id; it trusts only a status the worker wrote *after* this
drain began (a status file left from an earlier drain proves nothing); and it
removes the drain file whenever the drain ends early (error, interrupt,
timeout), so the worker takes calls again.

The status file is JSON: ``{"state": "serving"|"draining"|"drained",
"drain_id", "written_at" (Unix seconds), "calls_in_progress"}``.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from .atomic import write_atomic
from .errors import FlatshareError

POLL_S = 0.1


class DrainError(FlatshareError):
    """The voice worker did not confirm the drain (or its end) in time."""

    exit_code = 1


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
    """The worker's status, or None if it is missing or unreadable (mid-write is atomic on its side)."""
    try:
        status = json.loads(status_file.read_text())
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return status if isinstance(status, dict) else None


def begin(drain_file: Path, status_file: Path) -> VoiceDrain:
    """Ask the worker to drain: write the drain file with a new drain id (atomically)."""
    drain = VoiceDrain(drain_file, status_file, uuid.uuid4().hex, time.time())
    drain_file.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(drain_file, (drain.drain_id + "\n").encode())
    return drain


def _trusted(status: dict | None, drain: VoiceDrain) -> bool:
    return bool(status) and status.get("drain_id") == drain.drain_id and float(status.get("written_at", 0)) >= drain.began_at


def wait_drained(drain: VoiceDrain, timeout_s: float, progress=None) -> dict:
    """Wait until the worker reports ``drained`` for this drain, in a status written after it began.

    Args:
        drain: the drain in progress.
        timeout_s: how long to wait, in seconds.
        progress: called with a line whenever the number of calls still in progress changes.

    Returns:
        The trusted status.

    Raises:
        DrainError: no trusted ``drained`` status within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    last_calls = None
    while time.monotonic() < deadline:
        status = read_status(drain.status_file)
        if _trusted(status, drain):
            if status.get("state") == "drained":
                return status
            calls = status.get("calls_in_progress")
            if progress and calls != last_calls:
                progress(f"voice worker draining: {calls} call(s) in progress (up to {timeout_s:g} s)")
                last_calls = calls
        time.sleep(POLL_S)
    raise DrainError(
        f"voice worker did not report drained for drain {drain.drain_id} within {timeout_s:g} s "
        f"(last status: {read_status(drain.status_file)})"
    )


def end(drain_file: Path) -> None:
    """End the drain: remove the drain file (the worker takes calls again)."""
    drain_file.unlink(missing_ok=True)


def wait_serving(drain_file: Path, status_file: Path, since: float, timeout_s: float) -> dict:
    """After :func:`end`: wait for a ``serving`` status written after ``since`` (Unix seconds).

    Raises:
        DrainError: the worker did not say it serves again within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = read_status(status_file)
        if status and status.get("state") == "serving" and float(status.get("written_at", 0)) >= since:
            return status
        time.sleep(POLL_S)
    raise DrainError(f"voice worker did not report serving again within {timeout_s:g} s after {drain_file} was removed")
