"""How a message says a record it read: what is known, in words, and what is missing, by name (standard library only).

A record read from a node (``lock.json``, ``hold.json``, a history record, a
kept outcome, a probe's answer) may lack any field: an older writer, a person's
edit, damage. A message built from it never prints Python's ``None``, JSON's
``null`` or a placeholder such as ``?``: it says what the record does say, and
names the fields it does not (``though lock.json has no user or started_at``).
Text taken from a record goes through :func:`.text.one_line`.
"""

from __future__ import annotations

import math
from typing import Mapping

from .clock import utc_stamp
from .protocol import Mode
from .text import HOLD_MESSAGE_MAX, clip, one_line


def text_field(record: Mapping, key: str) -> str | None:
    """``record[key]`` as one line of text when it is a non-empty string, else None (missing or of another kind)."""
    value = record.get(key) if isinstance(record, Mapping) else None
    return one_line(value) if isinstance(value, str) and value.strip() else None


def number_field(record: Mapping, key: str) -> float | None:
    """``record[key]`` when it is a finite number (a bool is not one), else None."""
    value = record.get(key) if isinstance(record, Mapping) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        return value if math.isfinite(value) else None
    except OverflowError:  # an integer too large for a float
        return None


def int_field(record: Mapping, key: str) -> int | None:
    """``record[key]`` when it is an int (a bool is not one), else None."""
    value = record.get(key) if isinstance(record, Mapping) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def time_field(record: Mapping, key: str) -> str | None:
    """``record[key]`` (Unix seconds) as a UTC stamp, or None when it is no time (common/clock.py ``is_time``:
    not a number, NaN, an infinity, before 1970 or past 9999)."""
    from .clock import is_time

    value = number_field(record, key)
    return utc_stamp(value) if value is not None and is_time(value) else None


def listing(words: list[str], last: str = "or") -> str:
    """``a``, ``a or b``, ``a, b or c``."""
    if len(words) < 2:
        return "".join(words)
    return f"{', '.join(words[:-1])} {last} {words[-1]}"


def not_recorded(source: str, keys: list[str]) -> str:
    """``, though SOURCE has no a, b or c`` (empty when nothing is missing): a clause naming the fields a
    message could not say."""
    return f", though {source} has no {listing(keys)}" if keys else ""


def who_phrase(user: str | None, host: str | None) -> str | None:
    """``root@vm``, ``root`` or ``someone on vm`` from what a record says; None when it says neither."""
    if user and host:
        return f"{user}@{host}"
    if user:
        return user
    if host:
        return f"someone on {host}"
    return None


def holder_phrase(record: Mapping, pid: int | None, damage: str | None = None, source: str = "lock.json") -> str:
    """Who holds a node's release lock, for "being released by ...": the kernel's ``pid`` first, then what
    ``lock.json`` (``record``, its ``damage``) says of it, or that it is missing, damaged or another process's.

    ``root@vm pid 123, release 3f2a..., since 2026-12-01T08:33:23Z`` when all is known (``a rollback to
    release 3f2a...`` for a rollback, whose target is decided under the lock: ``a rollback, its target not
    yet decided`` before); ``pid 6590, whose record lock.json is missing`` when there is none.
    """
    if pid is None:
        process = "a process the kernel no longer shows holding the lock"
    elif pid == 0:
        process = "a process whose pid the kernel does not show here"
    else:
        process = f"pid {pid}"
    if damage:
        return f"{process}, whose record is damaged ({one_line(damage)})"
    if not record:
        return f"{process}, whose record {source} is missing"
    recorded_pid = int_field(record, "pid")
    if pid and recorded_pid is not None and recorded_pid != pid:
        return f"{process}, whose record {source} is another process's (it names pid {recorded_pid})"
    user, host, release = text_field(record, "user"), text_field(record, "host"), text_field(record, "release")
    mode, since = text_field(record, "mode"), time_field(record, "started_at")
    who = who_phrase(user, host)
    parts = [f"{who} {process}" if who else process]
    undoings: dict[str, str] = {Mode.ROLLBACK: "a rollback", Mode.UNDO_ROLLOUT: "a rollout's undo"}
    undoing = undoings.get(mode or "")
    if undoing:  # its target is decided under the lock: until then lock.json has none, and that is no gap
        parts.append(f"{undoing} to release {release}" if release else f"{undoing}, its target not yet decided")
    elif release:
        parts.append(f"release {release}")
    if since:
        parts.append(f"since {since}")
    recorded = (("user", user), ("host", host), ("release", release or undoing), ("started_at", since))
    missing = [k for k, v in recorded if v is None]
    return ", ".join(parts) + not_recorded(source, missing)


def hold_phrase(hold: Mapping, source: str = "hold.json") -> str:
    """An operator's hold, for "held by ...": ``root@laptop since 2026-12-01T08:00:00Z: E2 benchmark``; what
    the record lacks is named (``someone, though hold.json has no who``)."""
    who, since, message = text_field(hold, "who"), time_field(hold, "since"), text_field(hold, "message")
    if message is not None:  # a message placed before its bound, or written by hand: shown up to the bound
        message = clip(message, HOLD_MESSAGE_MAX)
    text = (who or "someone") + (f" since {since}" if since else "") + (f": {message}" if message else "")
    present = hold if isinstance(hold, Mapping) else {}
    missing = [k if k not in present else f"usable {k}" for k, v in (("who", who), ("since", since),
                                                                    ("message", message)) if v is None]
    return text + not_recorded(source, missing)
