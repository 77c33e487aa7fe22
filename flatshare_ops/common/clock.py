"""Time as people read it in messages and logs, and what counts as a time in a file (standard library only)."""

from __future__ import annotations

import math
import time
from typing import TypeGuard

#: The latest time a file may name: 9999-12-31T23:59:59Z (Unix seconds). Anything later (1e300) is no time.
LATEST = 253402300799.0


def is_time(value: object) -> TypeGuard[float]:
    """Whether ``value``, read from a file, is a time: a finite number of Unix seconds from 1970 to 9999
    (a bool, NaN, an infinity, a negative number or 1e300 is damage, not a time)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:  # total: an integer too large for a float (no reader lets one through: common/files.py) is no time
        return math.isfinite(value) and 0 <= value <= LATEST
    except OverflowError:
        return False


def is_duration(value: object) -> TypeGuard[float]:
    """Whether ``value``, read from a file, is a duration: a finite number of seconds, 0 or more, at most
    :data:`LATEST` (so a printed duration is never ``inf s`` or ``-3 s``)."""
    return is_time(value)


def utc_stamp(epoch: float | None = None) -> str:
    """``2026-11-30T06:24:09Z`` for a Unix time in seconds (now when None).

    Total: a value read from a damaged file that is no time (a string, NaN, 1e300) gives
    ``(not a time: VALUE)``, never an exception; readers call such a value damage before it gets here.
    """
    try:
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() if epoch is None else epoch))
    except (TypeError, ValueError, OverflowError, OSError):
        return f"(not a time: {str(epoch)[:40]})"


def age(since: float, now: float | None = None) -> str:
    """How long ago ``since`` (a time: :func:`is_time`) was, for messages: ``42 s``; a time in the future
    (the clock was set back since) is said as such, never as a negative duration."""
    now = time.time() if now is None else now
    if since > now + 1:
        return f"a start time in the future ({utc_stamp(since)}: the clock was set back since?)"
    return f"{max(0.0, now - since):.0f} s"
