"""The one poller: wait for a condition until a deadline (standard library only).

Every wait in flatshare-ops that is not a systemd job signal goes through
:func:`poll_until`: the engine's ``/health``, the voice worker's drain
status, a process's exit, a socket that should appear. One loop means one
place where the deadline is kept, and one place that reports progress at a
steady rhythm (a release prints a line at least every 10 s during a wait,
so the operator's silence bound never fires on a healthy slow step).
"""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")

#: How often a wait reports that it is still waiting (seconds); the operator's
#: silence bound is a few of these.
PROGRESS_EVERY_S = 10.0


def poll_until(
    check: Callable[[], T],
    timeout_s: float,
    interval_s: float = 0.05,
    progress: Callable[[float], None] | None = None,
    progress_every_s: float = PROGRESS_EVERY_S,
) -> T | None:
    """Call ``check`` until it returns something truthy or ``timeout_s`` seconds pass.

    Args:
        check: returns a truthy value when the wait is over (that value is returned).
        timeout_s: the deadline, in seconds from now; ``check`` runs at least once.
        interval_s: seconds between calls.
        progress: called with the seconds waited so far, every ``progress_every_s``.
        progress_every_s: seconds between ``progress`` calls.

    Returns:
        ``check``'s last truthy value, or None when the deadline passed first
        (the caller raises, naming the bound).
    """
    start = time.monotonic()
    deadline = start + timeout_s
    next_progress = start + progress_every_s
    while True:
        result = check()
        if result:
            return result
        now = time.monotonic()
        if now >= deadline:
            return None
        if progress is not None and now >= next_progress:
            progress(now - start)
            next_progress = now + progress_every_s
        time.sleep(max(0.0, min(interval_s, deadline - now, next_progress - now if progress else interval_s)))
