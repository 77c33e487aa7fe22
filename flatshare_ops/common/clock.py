"""Time as people read it in messages and logs (standard library only)."""

from __future__ import annotations

import time


def utc_stamp(epoch: float | None = None) -> str:
    """``2026-11-30T06:24:09Z`` for a Unix time in seconds (now when None).

    Total: a value read from a damaged file that is no time (a string, NaN, 1e300) gives
    ``(not a time: VALUE)``, never an exception.
    """
    try:
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() if epoch is None else epoch))
    except (TypeError, ValueError, OverflowError, OSError):
        return f"(not a time: {str(epoch)[:40]})"
