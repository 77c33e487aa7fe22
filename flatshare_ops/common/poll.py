"""The one poller: wait for a condition until a deadline (standard library only).

Every wait in flatshare-ops that is not a systemd job signal goes through
:func:`poll_until`: the engine's ``/health``, the voice worker's drain
status, a process's exit, a socket that should appear. One loop means one
place where the deadline is kept, and one place that reports progress at a
steady rhythm (a release prints a line at least every 10 s during a wait, or
as often as the operator's side asks, so its silence bound never fires on a
healthy slow step).
"""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")

#: How often a wait reports that it is still waiting (seconds) unless the
#: operator's side asks for more often (:func:`set_progress_every`).
PROGRESS_EVERY_S = 10.0

_every_s = PROGRESS_EVERY_S


def set_progress_every(seconds: float) -> None:
    """Make every wait of this process report at least every ``seconds`` (0.2 to 10 s).

    The node's switch sets it from the request its operator's side sends: a third
    of the operator's silence bound, so that a healthy slow step (an engine load,
    vLLM's import in the preflight) never looks like a stalled session.

    Raises:
        ValueError: ``seconds`` is not a number from 0.2 to 10.
    """
    global _every_s
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0.2 <= seconds <= PROGRESS_EVERY_S:
        raise ValueError(f"progress cadence {seconds!r} is not a number of seconds from 0.2 to {PROGRESS_EVERY_S:g}")
    _every_s = float(seconds)


def progress_every() -> float:
    """The seconds between progress reports of every wait in this process."""
    return _every_s


def poll_until(
    check: Callable[[], T],
    timeout_s: float,
    interval_s: float = 0.05,
    progress: Callable[[float], None] | None = None,
    progress_every_s: float | None = None,
) -> T | None:
    """Call ``check`` until it returns something truthy or ``timeout_s`` seconds pass.

    Args:
        check: returns a truthy value when the wait is over (that value is returned).
        timeout_s: the deadline, in seconds from now; ``check`` runs at least once.
        interval_s: seconds between calls.
        progress: called with the seconds waited so far, every ``progress_every_s``.
        progress_every_s: seconds between ``progress`` calls (default: :func:`progress_every`).

    Returns:
        ``check``'s last truthy value, or None when the deadline passed first
        (the caller raises, naming the bound).
    """
    if progress_every_s is None:
        progress_every_s = _every_s
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
