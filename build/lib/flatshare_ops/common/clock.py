"""Time as people read it in messages and logs (standard library only)."""

from __future__ import annotations

import time


def utc_stamp(epoch: float | None = None) -> str:
    """``2026-11-30T06:24:09Z`` for a Unix time in seconds (now when None)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() if epoch is None else epoch))
