"""``releases/history.jsonl``: what ran on the node, one record per switch, and what a rollback returns to.

Appended with :func:`common.durable.append_line` (fsynced; a torn last line
never swallows the next record). Each record carries its switch's id, so a
crash between the append and the journal's removal never produces two
records of one switch: the next run sees the id and does not record it again.
Schema 2 (releases/README.md); a record of another schema is named and skipped.

The rollback rule (:func:`rollback_target`): a node's rollback goes to the
last release that was active and passed serving-check before the current
one, never to a failed, abandoned or repair switch.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from ..common import durable
from ..common.clock import is_duration, is_time, utc_stamp
from ..common.files import MAX_DEPTH, dumps, json_damage, loads, nesting, read_bytes
from ..common.protocol import SERVED, UNFINISHED, AnalysisPhase, OutcomeResult, RecordResult
from ..errors import NodeStateError

HISTORY_SCHEMA = 2
#: The schemas this reader knows: a record of another is named and not used.
KNOWN_SCHEMAS = (HISTORY_SCHEMA,)
#: The most history.jsonl may hold (bytes): about 30,000 records, decades of releases.
MAX_BYTES = 16 << 20


class HistoryOrderError(NodeStateError):
    """The history's order disagrees with its records' times, so which release served last is not known."""


class History:
    """The records of ``history.jsonl`` that could be read, and one note per line that could not.

    Attributes:
        records: dicts, oldest first.
        skipped: ``history.jsonl:LINE: why`` for each line skipped (torn, not JSON, not an object, of an
            unknown schema, of another node, of the wrong types).
        disorder: ``history.jsonl:LINE: ...`` when the records' times go backwards somewhere (a line moved,
            or the clock set back), else None: then no rollback target is decided from the order.
    """

    def __init__(self, records: list[dict], skipped: list[str], disorder: str | None = None) -> None:
        self.records, self.skipped, self.disorder = records, skipped, disorder

    def has(self, switch: str | None, result: RecordResult, kind: str | None = None) -> bool:
        """Whether switch ``switch`` is already recorded with ``result`` (so it is never recorded twice); with
        ``kind``, as a switch of that kind: a release that failed and the automatic rollback that followed it
        share one switch id, and each part's failure is recorded once."""
        return switch is not None and any(
            r.get("switch") == switch and r.get("result") == result and (kind is None or r.get("kind", kind) == kind)
            for r in self.records)

    def last(self) -> dict | None:
        """The newest record, or None (None too when the order is in doubt: which one is newest is not known)."""
        return self.records[-1] if self.records and self.disorder is None else None

    def in_order(self) -> None:
        """Raise unless the order can decide which release served last.

        Raises:
            HistoryOrderError: the records' times go backwards (:attr:`disorder`).
        """
        if self.disorder is not None:
            raise HistoryOrderError(f"{self.disorder}: which release served last is not known, so no rollback "
                                    "target is decided from it; check the lines (was one moved, or the node's clock "
                                    "set back?), put them in order or move the file aside (the node then starts a "
                                    "new history)")


#: How deeply a record may nest: the node's answers (``history``, ``status``) carry a record two levels down,
#: and every document is read within common/files.py's MAX_DEPTH.
RECORD_DEPTH = MAX_DEPTH - 4
#: The most one record may hold (bytes): a switch's record is about 1 KB, an analysis of 100 measurements
#: about 300 KB; the file itself holds at most MAX_BYTES.
RECORD_MAX_BYTES = 1 << 20


def read_history(path: Path, node: str) -> History:
    """Every record of this node that can be read, oldest first.

    A line that is torn (a crash mid-append), not JSON (a NaN, an infinity or ``1e400`` included), nested
    too deeply, not an object, of an unknown schema, of another node, or of the wrong types (a time that
    is no time, a negative duration) is skipped and named in :attr:`History.skipped`; times that go
    backwards from one record to the next are named in :attr:`History.disorder`. Nothing here raises for
    damage inside the file.

    Args:
        path: ``releases/history.jsonl``.
        node: this node's name: another node's records are never this node's history.

    Raises:
        Damaged: the file itself is a directory, a symlink, a FIFO, a device, larger than
            :data:`MAX_BYTES`, or unreadable.
    """
    raw = read_bytes(path, limit=MAX_BYTES)
    if raw is None:
        return History([], [])
    records, skipped, lines = [], [], []
    for number, line in enumerate(raw.decode("utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = loads(line)
        except ValueError as err:
            form = "not JSON (a torn or damaged line)" if isinstance(err, json.JSONDecodeError) else json_damage(err)
            skipped.append(f"{path.name}:{number}: {form}; skipped")
            continue
        wrong = problem(record, node)
        if wrong:
            skipped.append(f"{path.name}:{number}: {wrong}; skipped")
            continue
        records.append(record)
        lines.append(number)
    return History(records, skipped, _disorder(path.name, records, lines))


#: A record's fields the node reads, and the types they may have.
_FIELDS = {"switch": (str, type(None)), "rollout": (str, type(None)), "result": (str,), "before": (str, type(None)),
           "after": (str, type(None)), "target": (str, type(None)), "served": (bool,), "step": (str, type(None)),
           "node": (str,), "kind": (str,), "started_at": (int, float), "finished_at": (int, float),
           "duration_s": (int, float), "resumed": (int,), "verdict": (bool,)}


def problem(record: object, node: str) -> str | None:
    """Why a history line's document is not a record of this node that the reader can use, or None.

    One rule for the reader and the writer (:func:`append`): the tool never writes a record it would skip.
    """
    if not isinstance(record, dict):
        return f"not a record (a {type(record).__name__})"
    if nesting(record) > RECORD_DEPTH:
        return (f"a record nested more than {RECORD_DEPTH} levels (the node's answers carry records "
                f"{MAX_DEPTH - RECORD_DEPTH} levels down, within {MAX_DEPTH})")
    schema = record.get("schema", 1)  # schema 1's records did not say theirs
    if isinstance(schema, bool) or not isinstance(schema, int):
        return f"a record of the wrong types (schema is {type(schema).__name__})"
    if schema < HISTORY_SCHEMA:
        return (f"a record of schema {schema}, written by a flatshare-ops before schema {HISTORY_SCHEMA}, which this "
                "one does not read (no rollback returns to it; the file's other records are read as ever: delete the "
                "line to end this note)")
    if schema not in KNOWN_SCHEMAS:
        return (f"a record of schema {schema}, which this flatshare-ops does not read (it reads "
                f"{' and '.join(map(str, KNOWN_SCHEMAS))}; update flatshare-ops on the node)")
    wrong = _wrong_types(record)
    if wrong:
        return f"a record of the wrong types ({wrong})"
    if "node" in record and record["node"] != node:
        return f"a record of node {record['node']!r}, not of {node} (copied from another node?)"
    if "node" not in record:
        return "a record that names no node (flatshare-ops writes its node in every record)"
    missing = [k for k in ("started_at", "finished_at") if k not in record]
    if missing:  # the order that decides a rollback target is checked against these times: none may hide from it
        return f"a record without {' and '.join(missing)} (flatshare-ops writes both in every record)"
    return None


def _wrong_types(record: dict) -> str | None:
    for key, types in _FIELDS.items():
        if key in record and not isinstance(record[key], types):
            return f"{key} is {type(record[key]).__name__}"
        if key in record and isinstance(record[key], bool) and bool not in types:
            return f"{key} is bool"
    for key in ("started_at", "finished_at"):
        if key in record and not is_time(record[key]):
            return f"{key} {record[key]!r} is not a time"
    if "resumed" in record and record["resumed"] < 0:
        return f"resumed {record['resumed']!r} is below 0"
    if "duration_s" in record and not is_duration(record["duration_s"]):
        return f"duration_s {record['duration_s']!r} is not a number of seconds, 0 or more"
    if is_time(record.get("started_at")) and is_time(record.get("finished_at")) \
            and record["finished_at"] < record["started_at"]:
        return f"it finished ({utc_stamp(record['finished_at'])}) before it started ({utc_stamp(record['started_at'])})"
    if record.get("result") not in frozenset(RecordResult):  # every result a record may carry
        return f"result {record.get('result')!r} is not one of {', '.join(RecordResult)}"
    return None


def _disorder(name: str, records: list[dict], lines: list[int]) -> str | None:
    """Where the records' times go backwards, or None. Each record is written when its switch ends
    (``finished_at``, under the node's lock), so in a history nobody edited they never go backwards."""
    previous = None
    for record, line in zip(records, lines):
        finished = record.get("finished_at")
        if not is_time(finished):
            continue
        if previous is not None and finished < previous[0]:
            return (f"{name}:{line}: finished {utc_stamp(finished)}, before line {previous[1]} above it "
                    f"({utc_stamp(previous[0])}): the history's order and its times disagree")
        previous = (finished, line)
    return None


#: When a switch's record would take history.jsonl past this size (bytes), the file is compacted first
#: (:func:`compact`): far below :data:`MAX_BYTES`, so that the records appended between two switches (an
#: analysis, at most :data:`RECORD_MAX_BYTES` each) never take it past what its reader takes.
COMPACT_AT = MAX_BYTES // 2
#: What compaction keeps in history.jsonl: the newest lines, at most this many bytes (thousands of switches:
#: every release a rollback can return to is among them, since pruning keeps only the newest few stored).
COMPACT_KEEP = MAX_BYTES // 4
#: Where compaction moves older lines (appended, never read by the tool: an archive for people).
ARCHIVE = "history.old.jsonl"


def append(path: Path, record: dict, node: str, compact_first: bool = False) -> None:
    """Append one record (fsynced), once it is shown to be one its reader takes (:func:`problem`).

    Args:
        compact_first: the caller holds the node's lock (a switch's own records), so the file may be
            compacted (:func:`compact`) when this record would take it past :data:`COMPACT_AT`.

    Raises:
        ValueError: the record is one the reader would skip, or it would take the file past
            :data:`MAX_BYTES` (nothing is written: the tool never writes a file its reader refuses).
        OSError: the disk is full or read-only (the caller's early-end rule handles it).
    """
    document = {"schema": HISTORY_SCHEMA, **record}
    wrong = problem(document, node)
    if wrong:
        raise ValueError(f"a history record its own reader would skip ({wrong}) was not written")
    line = dumps(document, sort_keys=True)
    if len(line) > RECORD_MAX_BYTES:
        raise ValueError(f"a history record of {len(line)} bytes, more than the {RECORD_MAX_BYTES} one may hold "
                         f"(the whole file holds at most {MAX_BYTES}), was not written")
    size = _size(path)
    if compact_first and size + len(line) + 2 > COMPACT_AT:
        compact(path)
        size = _size(path)
    if size + len(line) + 2 > MAX_BYTES:
        raise ValueError(f"{path.name} holds {size} bytes: a record of {len(line)} more would take it past the "
                         f"{MAX_BYTES} its reader takes, so it was not written (the next switch compacts the file)")
    durable.append_line(path, line)


def refuse_unwritable(path: Path) -> None:
    """Refuse a switch whose history could not record it, before anything changes: a history file that takes no
    appends (a read-only filesystem, its permissions, ``chattr +i``), or something other than a file where
    compaction's :data:`ARCHIVE` belongs. Found only at the switch's last step, the node would be drained and
    restarted first, and every later release the same. Opened for appending, nothing written.

    Raises:
        Refused: ``history.jsonl`` takes no writes (no damage: make it writable).
        NodeStateError: the archive's path holds a directory, a FIFO, a socket or a device.
    """
    from ..common.files import NotAFile, open_regular, what_is
    from ..errors import Refused
    from .store import unwritable

    try:
        os.close(open_regular(path, os.O_WRONLY | os.O_APPEND))
    except FileNotFoundError:
        pass  # the first record makes it, in the releases directory the lock was taken in
    except NotAFile:
        pass  # damage its reader names (read before this)
    except OSError as err:
        what = unwritable(err)
        if what is None:
            raise NodeStateError(f"{path}: cannot be opened for appending ({err.strerror or err}); fix it, then "
                                 "release again") from None
        raise Refused(f"{path} {what}: this switch could not be recorded, and nothing was changed; make "
                      "it writable (chattr -i, remount read-write, or fix its permissions), then run the command "
                      "again") from None
    archive = path.parent / ARCHIVE
    try:
        mode = os.lstat(archive).st_mode
    except FileNotFoundError:
        return
    if not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
        raise NodeStateError(f"{archive}: is {what_is(mode)} where the history's archive belongs (compaction "
                             f"appends to it); move it aside (mv {archive} {archive}.bad), then release again")


def _size(path: Path) -> int:
    try:
        return os.lstat(path).st_size
    except FileNotFoundError:
        return 0


def compact(path: Path, keep: int = COMPACT_KEEP) -> int:
    """Move history.jsonl's older lines to :data:`ARCHIVE` beside it, keeping the newest whole lines that fit in
    ``keep`` bytes: the archive is appended and fsynced first, then history.jsonl replaced atomically, so a crash
    leaves every line in one file or both (never none). Run only under the node's lock (one writer).

    Returns:
        How many lines were moved.

    Raises:
        Damaged: history.jsonl is no regular file (see :func:`read_history`).
        OSError: a write failed (history.jsonl is then as it was).
    """
    raw = read_bytes(path, limit=MAX_BYTES)
    if raw is None:
        return 0
    lines = raw.splitlines(keepends=True)
    kept, total = 0, 0
    for line in reversed(lines):
        if total + len(line) > keep:
            break
        total, kept = total + len(line), kept + 1
    moved = lines[:len(lines) - kept]
    if not moved:
        return 0
    archive = path.with_name(ARCHIVE)
    old = b"".join(moved)
    durable.append_block(archive, old if old.endswith(b"\n") else old + b"\n")
    durable.write_atomic(path, b"".join(lines[len(lines) - kept:]))
    return len(moved)


def served_releases(history: History) -> list[str]:
    """Releases that were active and passed serving-check, newest first, each once.

    A release whose latest switch failed because it does not serve (its engine did not start or
    serving-check was CRITICAL: the record's ``verdict``) is left out until it serves again: it is no
    longer known to start on this node. A switch that failed for anything else (a signal, a write on a
    full disk, a drain) or was abandoned (``verdict`` false) says nothing about the release and is passed
    over; a record written before ``verdict`` existed counts as a verdict.

    Raises:
        HistoryOrderError: the records' times go backwards, so which is newest is not known.
    """
    history.in_order()
    seen: list[str] = []
    distrusted: set[str] = set()
    for record in reversed(history.records):
        after, target = record.get("after"), record.get("target")
        if record.get("result") in UNFINISHED:
            if record.get("verdict", True) is not False and isinstance(target, str) and target not in seen:
                distrusted.add(target)
        elif record.get("result") in SERVED and record.get("served") and isinstance(after, str) \
                and after not in seen and after not in distrusted:
            seen.append(after)
    return seen


def newest_mark(records: list[dict]) -> str | None:
    """What tells the newest of ``records`` (oldest first) from any record before or after it, or None for an
    empty history: its switch id, result and finish time (Unix seconds), as one string compared whole.

    A history only grows by records appended under the node's release lock (its compaction keeps the newest),
    so two reads with the same mark saw the same records as far as :func:`failed_releases` is concerned: the
    operator's side compares the mark its retry guard read with the one the node sends holding its lock
    (common/protocol.py ``AdmitRequest.history``), and reads the guard again when they differ.
    """
    if not records:
        return None
    newest = records[-1]
    return f"{newest.get('switch')}/{newest.get('result')}/{newest.get('finished_at')}"


def failed_releases(records: list[dict]) -> dict[str, dict]:
    """Releases that failed on this node and were taken back, each with how and when, from its history's
    records (oldest first): a switch whose engine did not serve (its failure's ``verdict``) and that the node
    rolled back by itself, or a release whose canary analysis failed (its ``analysed`` record), rolled back from
    or not yet: a canary whose rollback is still owed (the operator's side stopped before it, or it was refused)
    still runs the release, which is listed with ``owed``. A release that served again later (a release or
    rollback record with it ``after``, ``served``), or whose later analysis passed, is no longer listed: the
    newest record decides. A release that failed and was left failed (no automatic rollback) is not listed: the
    next release finishes or replaces its switch.

    Returns:
        ``{release id: {"how": "rolled back automatically" | "its canary analysis failed", "why": one line,
        "at": Unix seconds of the record that took it back (of the analysis, while owed), "switch": that switch's
        id}}``, and ``"owed": True`` for a canary that still runs it.
    """
    failed: dict[str, dict] = {}
    verdicts: dict[str, dict] = {}  # switch id -> its failure that says the release does not serve
    analysed: dict[str, dict] = {}  # release -> its failed canary analysis, until the canary is rolled back
    for record in records:
        result, target, switch = record.get("result"), record.get("target"), record.get("switch")
        if result == RecordResult.FAILED and record.get("verdict") is True and isinstance(target, str) \
                and isinstance(switch, str):
            verdicts[switch] = record
        elif result == RecordResult.ROLLED_BACK and record.get("auto") and switch in verdicts:
            cause = verdicts.pop(switch)
            failed[cause["target"]] = {"how": OutcomeResult.AUTO_ROLLED_BACK, "at": record.get("finished_at"),
                                       "switch": switch,
                                       "why": f"{cause.get('step') or 'a step'} failed: {cause.get('reason') or 'no reason recorded'}"}
        elif result == RecordResult.ANALYSED and isinstance(target, str) and isinstance(record.get("analysis"), dict):
            phase = record["analysis"].get("phase")
            if phase == AnalysisPhase.FAILED:
                analysed[target] = {"how": "its canary analysis failed", "at": record.get("finished_at"),
                                    "switch": switch, "why": record.get("reason") or "no summary recorded"}
            elif phase == AnalysisPhase.PASSED:  # analysed again (a --retry) and passed
                analysed.pop(target, None)
                failed.pop(target, None)
        elif result == RecordResult.ROLLED_BACK and record.get("before") in analysed:  # the canary taken back from it
            failed[record["before"]] = {**analysed.pop(record["before"]), "at": record.get("finished_at")}
        if result in SERVED and record.get("served") and isinstance(record.get("after"), str) \
                and not record.get("auto") and record.get("before") != record.get("after"):
            failed.pop(record["after"], None)
            analysed.pop(record["after"], None)
    for release, cause in analysed.items():  # a canary still on it: its rollback is owed
        failed[release] = {**cause, "owed": True}
    return failed


def rollback_target(history: History, exclude: str | None, stored) -> str | None:
    """The release a rollback returns to: the newest release that served, other than ``exclude``, still stored.

    Args:
        history: the node's history.
        exclude: the release being left (the current one, or an interrupted switch's target).
        stored: a predicate telling whether a release's directory is still on the node.

    Returns:
        The release id, or None when no earlier served release is stored.

    Raises:
        HistoryOrderError: the records' times go backwards (see :func:`served_releases`).
    """
    for release in served_releases(history):
        if release != exclude and stored(release):
            return release
    return None
