"""``releases/history.jsonl``: what ran on the node, one record per switch, and what a rollback returns to.

Appended with :func:`common.durable.append_line` (fsynced; a torn last line
never swallows the next record). Each record carries its switch's id, so a
crash between the append and the journal's removal never produces two
records of one switch: the next run sees the id and does not record it again.
Schema 2 (releases/README.md); schema-1 records from before stay readable.

The rollback rule (:func:`rollback_target`): a node's rollback goes to the
last release that was active and passed serving-check before the current
one, never to a failed, abandoned or repair switch.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..common import durable
from ..common.files import loads, read_bytes

HISTORY_SCHEMA = 2
#: Results of a switch that ended with its release active and serving-check passed.
SERVED_RESULTS = ("released", "rolled back")
#: Every result a record may carry (``analysed``: a canary analysis of the node's release, not a switch).
RESULTS = ("released", "rolled back", "repaired", "failed", "abandoned", "analysed")


class History:
    """The records of ``history.jsonl`` that could be read, and one note per line that could not.

    Attributes:
        records: dicts, oldest first (schema 1 records are upgraded on read: see :func:`upgrade`).
        skipped: ``history.jsonl:LINE: why`` for each line skipped (torn, not JSON, not an object).
    """

    def __init__(self, records: list[dict], skipped: list[str]) -> None:
        self.records, self.skipped = records, skipped

    def has(self, switch: str | None, result: str) -> bool:
        """Whether switch ``switch`` is already recorded with ``result`` (so it is never recorded twice)."""
        return switch is not None and any(r.get("switch") == switch and r.get("result") == result
                                          for r in self.records)

    def last(self) -> dict | None:
        """The newest record, or None."""
        return self.records[-1] if self.records else None


def upgrade(record: dict) -> dict:
    """A schema-1 record in schema 2's terms (``result`` ``released`` / ``failed at STEP: why`` /
    ``abandoned by rollback``; ``from``/``to``), so one reader serves both."""
    if record.get("schema") == HISTORY_SCHEMA:
        return record
    result = str(record.get("result", ""))
    out = dict(record)
    out["target"] = record.get("to")
    if result == "released":
        kind = record.get("kind")
        out["result"] = {"rollback": "rolled back", "repair": "repaired"}.get(kind, "released")
        out["before"], out["after"], out["served"] = record.get("from"), record.get("to"), True
    elif result.startswith("failed at "):
        step, _, reason = result.removeprefix("failed at ").partition(": ")
        out.update(result="failed", step=step, reason=reason, before=record.get("from"), after=None, served=False)
    elif result.startswith("abandoned"):
        out.update(result="abandoned", before=record.get("to"), after=None, served=False)
    return out


def read_history(path: Path) -> History:
    """Every record that can be read, oldest first.

    A line that is torn (a crash mid-append), not JSON, or not an object is
    skipped and named in :attr:`History.skipped`; nothing here raises for
    damage inside the file.

    Raises:
        Damaged: the file itself is a directory, a symlink or unreadable.
    """
    raw = read_bytes(path)
    if raw is None:
        return History([], [])
    records, skipped = [], []
    for number, line in enumerate(raw.decode("utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = loads(line)
        except ValueError:
            skipped.append(f"{path.name}:{number}: not JSON (a torn or damaged line); skipped")
            continue
        if not isinstance(record, dict):
            skipped.append(f"{path.name}:{number}: not a record (a {type(record).__name__}); skipped")
            continue
        record = upgrade(record)
        wrong = _wrong_types(record)
        if wrong:
            skipped.append(f"{path.name}:{number}: a record of the wrong types ({wrong}); skipped")
            continue
        records.append(record)
    return History(records, skipped)


#: A record's fields the node reads, and the types they may have.
_FIELDS = {"switch": (str, type(None)), "rollout": (str, type(None)), "result": (str,), "before": (str, type(None)),
           "after": (str, type(None)), "target": (str, type(None)), "served": (bool,), "step": (str, type(None)),
           "started_at": (int, float)}


def _wrong_types(record: dict) -> str | None:
    for key, types in _FIELDS.items():
        if key in record and not isinstance(record[key], types):
            return f"{key} is {type(record[key]).__name__}"
        if key in record and isinstance(record[key], bool) and bool not in types:
            return f"{key} is bool"
    if record.get("result") not in RESULTS:
        return f"result {record.get('result')!r} is not one of {', '.join(RESULTS)}"
    return None


def append(path: Path, record: dict) -> None:
    """Append one record (fsynced).

    Raises:
        OSError: the disk is full or read-only (the caller's early-end rule handles it).
    """
    durable.append_line(path, json.dumps({"schema": HISTORY_SCHEMA, **record}, sort_keys=True))


def served_releases(history: History) -> list[str]:
    """Releases that were active and passed serving-check, newest first, each once.

    A release whose latest switch failed or was abandoned is left out until it serves again: it is
    no longer known to start on this node.
    """
    seen: list[str] = []
    distrusted: set[str] = set()
    for record in reversed(history.records):
        after, target = record.get("after"), record.get("target")
        if record.get("result") in ("failed", "abandoned") and isinstance(target, str) and target not in seen:
            distrusted.add(target)
        elif record.get("result") in SERVED_RESULTS and record.get("served") and isinstance(after, str) \
                and after not in seen and after not in distrusted:
            seen.append(after)
    return seen


def rollback_target(history: History, exclude: str | None, stored) -> str | None:
    """The release a rollback returns to: the newest release that served, other than ``exclude``, still stored.

    Args:
        history: the node's history.
        exclude: the release being left (the current one, or an interrupted switch's target).
        stored: a predicate telling whether a release's directory is still on the node.

    Returns:
        The release id, or None when no earlier served release is stored.
    """
    for release in served_releases(history):
        if release != exclude and stored(release):
            return release
    return None
