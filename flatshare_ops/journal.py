"""``releases/switching.json``: the journal of a switch in progress.

Written before a switch starts and after every step, atomically (temporary
file, fsync, rename, fsync of the directory), so a killed or disconnected run
leaves a journal that says exactly where it stopped; the next release
finishes that switch first. Removed when the switch is recorded in the history.
The format is a contract (``schema``), described in releases/README.md.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .atomic import write_atomic
from .errors import FlatshareError
from .node_files import JOURNAL, RELEASES

StepState = Literal["pending", "running", "done", "failed"]


class JournalError(FlatshareError):
    """The journal is unreadable: corrupt, truncated or of an unknown schema."""

    exit_code = 2


class StepRecord(BaseModel):
    """One step of the switch and how far it got."""

    model_config = ConfigDict(extra="forbid")
    name: str
    state: StepState = "pending"
    at: float | None = None  # Unix seconds of the last change
    error: str | None = None


class Journal(BaseModel):
    """The journal of one switch (schema 1)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    schema_: Literal[1] = Field(default=1, alias="schema")
    from_: str | None = Field(alias="from")
    to: str
    node: str
    host: str
    pid: int
    user: str
    started_at: float
    forced: bool = False
    resumed: int = 0
    kind: Literal["release", "rollback", "repair"] = "release"
    steps: list[StepRecord]

    def step(self, name: str) -> StepRecord:
        """The record of step ``name``."""
        return next(s for s in self.steps if s.name == name)


def journal_path(state_dir: Path) -> Path:
    """``STATE_DIR/releases/switching.json``."""
    return Path(state_dir) / RELEASES / JOURNAL


def read_journal(state_dir: Path) -> Journal | None:
    """The journal of an unfinished switch, or None when there is none.

    Raises:
        JournalError: the file exists but is not a valid journal; the message
            says what to do (it is never silently ignored or overwritten).
    """
    path = journal_path(state_dir)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as err:
        raise JournalError(
            f"{path}: unreadable ({err.strerror or err}); move it aside (mv {path} {path}.bad) "
            "after checking the node (flatshare status)"
        ) from None
    try:
        return Journal.model_validate_json(raw)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        reason = f"{where}: {first['msg']}" if where else first["msg"]
        raise JournalError(
            f"{path}: corrupt or truncated journal ({reason}); a switch was interrupted on this node. "
            f"Check the node (flatshare status), then move the file aside (mv {path} {path}.bad) "
            "and run 'flatshare release' to switch the node again"
        ) from None


def write_journal(state_dir: Path, journal: Journal) -> None:
    """Write the journal atomically (temporary file, fsync, rename, fsync of the directory)."""
    path = journal_path(state_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, (journal.model_dump_json(by_alias=True, indent=2) + "\n").encode())


def mark(state_dir: Path, journal: Journal, name: str, state: StepState, error: str | None = None) -> None:
    """Record that step ``name`` is now ``state`` and write the journal."""
    record = journal.step(name)
    record.state, record.at, record.error = state, time.time(), error
    write_journal(state_dir, journal)


def remove_journal(state_dir: Path) -> None:
    """Remove the journal (the switch is recorded in the history) and fsync the directory."""
    path = journal_path(state_dir)
    path.unlink(missing_ok=True)
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def journal_summary(journal: Journal) -> str:
    """One line: from, to, and the last step done."""
    done = [s.name for s in journal.steps if s.state == "done"]
    return (f"switch {journal.from_} -> {journal.to} by {journal.user}@{journal.host} pid {journal.pid}, "
            f"{len(done)}/{len(journal.steps)} steps done" + (f" (last: {done[-1]})" if done else ""))
