"""``releases/switching.json``: the journal of a switch in progress.

Written before a switch starts and after every step, atomically (temporary
file, fsync, rename, fsync of the directory), so a killed or disconnected run
leaves a journal that says exactly where it stopped; the next release
finishes that switch first. Removed when the switch is recorded in the history.
The format is a contract (``schema``), described in releases/README.md.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from ..common import durable
from ..common.clock import is_time
from ..common.node_files import JOURNAL, RELEASES
from ..common.protocol import StepState, SwitchKind
from ..common.text import clip, one_line as text_line
from ..common.files import Damaged, parse_json_object, read_bytes
from ..errors import NodeStateError
from ..schema_errors import one_line

#: How far ahead of this node's clock a journal's time may be (seconds): a switch that began is never later.
AHEAD_S = 86400.0


def _time(value: float) -> float:
    if not is_time(value):
        raise ValueError(f"must be a time (Unix seconds, from 1970 to 9999), got {value!r}")
    if value > time.time() + AHEAD_S:
        raise ValueError(f"must be a time that has come (the switch began), got {value!r}, over a day ahead of this "
                         "node's clock")
    return value


#: A time in the journal (Unix seconds, common/clock.py): finite, from 1970 to 9999; NaN, 1e400 or 1e300 is damage.
Time = Annotated[float, AfterValidator(_time)]


class JournalError(NodeStateError):
    """The journal is unreadable: corrupt, truncated or of an unknown schema."""


class StepRecord(BaseModel):
    """One step of the switch and how far it got."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, defer_build=True)
    name: str
    # Not strict: the journal is read from JSON's text, which strict mode refuses for an enum; the values it
    # accepts, and its errors' words, are those of a Literal of the enum's values.
    state: StepState = Field(default=StepState.PENDING, strict=False)
    at: Time | None = None  # Unix seconds of the last change
    error: str | None = None


class Journal(BaseModel):
    """The journal of one switch (schema 2; a journal of another schema is unreadable, and named so)."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True, allow_inf_nan=False,
                              defer_build=True)
    schema_: Literal[2] = Field(default=2, alias="schema")  # common/node_files.py JOURNAL_SCHEMA
    switch: str | None = None  # this switch's id (history records carry it too)
    rollout: str | None = None  # the operator's rollout this switch belongs to
    commit: str | None = None  # the checkout the release was rendered from
    from_: str | None = Field(alias="from")  # the active release when the switch began
    to: str
    node: str
    host: str
    pid: int = Field(gt=0)
    user: str
    started_at: Time
    forced: bool = False
    resumed: int = Field(default=0, ge=0)
    auto: str | None = None  # why the node started this switch by itself (an automatic rollback), else None
    kind: SwitchKind = Field(default=SwitchKind.RELEASE, strict=False)  # not strict: as StepRecord.state
    steps: list[StepRecord]

    def step(self, name: str) -> StepRecord:
        """The record of step ``name``."""
        return next(s for s in self.steps if s.name == name)


def journal_path(state_dir: Path) -> Path:
    """``STATE_DIR/releases/switching.json``."""
    return Path(state_dir) / RELEASES / JOURNAL


def read_journal(state_dir: Path, node: str) -> Journal | None:
    """The journal of an unfinished switch, or None when there is none.

    Args:
        state_dir: the node's state directory.
        node: this node's name: a journal naming another node is damage (never finished here).

    Raises:
        JournalError: the file exists but is not a valid journal (empty, torn, not JSON, nested too
            deeply, too large, a number that is not finite, a time that is no time, wrong shape, a
            directory, link, FIFO or device, unreadable, another node's); the message names the
            damage and says what to do. It is never silently ignored or overwritten.
    """
    path = journal_path(state_dir)
    advice = (f"a switch was interrupted on this node. Check the node (flatshare status), then move the file "
              f"aside (mv {path} {path}.bad) and run 'flatshare release' to switch the node again")
    try:
        raw = read_bytes(path)
    except Damaged as err:
        raise JournalError(f"{path}: damaged journal: {err.form}; {advice}") from None
    if raw is None:
        return None
    try:
        document = parse_json_object(path, raw)
    except Damaged as err:
        raise JournalError(f"{path}: corrupt or truncated journal ({err.form}); {advice}") from None
    try:
        journal = Journal.model_validate(document)
    except ValidationError as err:
        raise JournalError(f"{path}: corrupt or truncated journal ({one_line(err)}); {advice}") from None
    if journal.node != node:
        raise JournalError(f"{path}: damaged journal: it is the journal of node {journal.node!r}, not of "
                           f"{node} (copied from another node?), so it is never finished here; {advice}")
    return journal


def write_journal(state_dir: Path, journal: Journal) -> None:
    """Write the journal atomically (temporary file, fsync, rename, fsync of the directory)."""
    path = journal_path(state_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    durable.write_atomic(path, (journal.model_dump_json(by_alias=True, indent=2) + "\n").encode())


def mark(state_dir: Path, journal: Journal, name: str, state: StepState, error: str | None = None) -> None:
    """Record that step ``name`` is now ``state`` and write the journal."""
    record = journal.step(name)
    record.state, record.at, record.error = state, time.time(), error
    write_journal(state_dir, journal)


def remove_journal(state_dir: Path) -> None:
    """Remove the journal (the switch is recorded in the history) and fsync the directory."""
    durable.remove(journal_path(state_dir))


def journal_summary(journal: Journal) -> str:
    """One line: from, to, and how far it got; an automatic rollback says so, and why (it is not any switch: the
    release before it did not serve)."""
    done = [s.name for s in journal.steps if s.state == StepState.DONE]
    failed = [s for s in journal.steps if s.state == StepState.FAILED]
    stopped = f", failed at {failed[0].name}" if failed else ""
    what = (f"automatic rollback ({clip(text_line(journal.auto), 200)}): switch" if journal.auto else "switch")
    return (f"{what} {journal.from_ or '(no release)'} -> {journal.to} by {journal.user}@{journal.host} pid "
            f"{journal.pid}, {len(done)}/{len(journal.steps)} steps done" + (f" (last: {done[-1]})" if done else "")
            + stopped)
