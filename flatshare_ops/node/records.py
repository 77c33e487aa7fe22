"""The history records a switch writes to ``releases/history.jsonl`` (their one writer) and how it reads them.

The switch alone writes history (docs/reference/engineering-style.md, "One
writer per record"): a success (the ``record-history`` step), a failure (the
early-end rule, or the failure an automatic rollback follows), an abandoned
switch (one another switch replaced). The file's format and reading are
node/history.py's; the fields are releases/README.md's.
"""

from __future__ import annotations

import time

from ..common.clock import is_time
from ..common.files import Damaged
from ..common.protocol import SUCCEEDED, RecordKind, RecordResult
from ..errors import NodeStateError
from . import history as histories
from .context import NodeContext
from .output import ReleaseOutput

TYPE_CHECKING = False  # typing.TYPE_CHECKING: the journal's models (pydantic) are imported only where a switch runs
if TYPE_CHECKING:
    from . import journal as journals

#: How far the clock may have been set back while the history still reads in order (seconds).
SET_BACK_S = 3600.0


def read_history(ctx: NodeContext) -> histories.History:
    """The node's history (damaged lines skipped and named).

    Raises:
        NodeStateError: ``history.jsonl`` itself is a directory, a link or unreadable.
    """
    try:
        return histories.read_history(ctx.history_path, ctx.node)
    except Damaged as err:
        raise NodeStateError(f"{err}; move it aside (mv {err.path} {err.path}.bad): the node then starts "
                             "a new history, and rollbacks have nothing to return to until a release serves") from None


def record(ctx: NodeContext, journal: journals.Journal, result: RecordResult, *, step: str | None = None,
           reason: str | None = None, after: str | None = None, served: bool = False,
           hist: histories.History | None = None, **extra) -> dict:
    """A history record of ``journal``'s switch (schema 2: releases/README.md).

    ``duration_s`` counts from when the run that carried the switch took the node's lock (its
    refusals, preflight and admission included), to now. ``finished_at`` is now, but never before the
    switch's start or the newest record of ``hist``: with the clock set back, the history still reads in
    order (its reader checks the order against these times: node/history.py).
    """
    clock = time.time()
    # A clock set back (up to SET_BACK_S) keeps the order; a record further ahead is damage (named by the reader's
    # order check), never copied into new records.
    latest = max((r["finished_at"] for r in (hist.records if hist else [])
                  if is_time(r.get("finished_at")) and r["finished_at"] <= clock + SET_BACK_S), default=0.0)
    now = max(clock, journal.started_at, latest)  # the journal's start is never a day ahead (node/journal.py)
    return {"switch": journal.switch, "rollout": journal.rollout, "node": ctx.node, "kind": journal.kind,
            "result": result, "step": step, "reason": reason, "before": journal.from_, "after": after,
            "target": journal.to, "served": served, "commit": journal.commit, "user": journal.user,
            "host": journal.host, "started_at": journal.started_at, "finished_at": now,
            "duration_s": round(max(0.0, now - journal.started_at), 3), "forced": journal.forced,
            "resumed": journal.resumed, "auto": journal.auto, **extra}


def append_success(ctx: NodeContext, journal: journals.Journal, release: str) -> None:
    """Record ``journal``'s switch as done (once per switch id): the ``record-history`` step."""
    result = SUCCEEDED[journal.kind]
    hist = read_history(ctx)
    if not hist.has(journal.switch, result, journal.kind):
        histories.append(ctx.history_path, record(ctx, journal, result, after=release, served=True, hist=hist),
                         ctx.node, compact_first=True)


def append_failure(ctx: NodeContext, journal: journals.Journal, step: str, reason: str, verdict: bool = False,
                   **extra) -> None:
    """Record ``journal``'s switch as failed at ``step`` (once per switch id and kind: an automatic rollback's own
    failure is recorded beside the failed release's); ``verdict``: the failure says the
    release does not serve (node/runner.py), so it is no rollback target until it serves again.

    Raises:
        OSError, NodeStateError, ValueError: the record could not be written (the caller prints what it would
            have said).
    """
    hist = read_history(ctx)
    if not hist.has(journal.switch, RecordResult.FAILED, journal.kind):
        histories.append(ctx.history_path, record(ctx, journal, RecordResult.FAILED, step=step, reason=reason,
                                                  hist=hist, verdict=verdict, **extra), ctx.node,
                         compact_first=True)


def append_abandoned(ctx: NodeContext, pending: journals.Journal, out: ReleaseOutput, why: str) -> None:
    """Record an interrupted switch as abandoned (another switch replaced its journal with its own). An
    interruption is no verdict on the release it was switching to (``verdict`` false: node/history.py
    ``served_releases``); a failure of its engine, if any, has its own record."""
    from .journal import journal_summary

    out.line(f"abandoning the interrupted {journal_summary(pending)}")
    hist = read_history(ctx)
    if pending.switch is None or not hist.has(pending.switch, RecordResult.ABANDONED):
        histories.append(ctx.history_path, record(ctx, pending, RecordResult.ABANDONED, reason=why, hist=hist,
                                                  verdict=False), ctx.node, compact_first=True)


def append_analysis(ctx: NodeContext, switch: str, rollout: str | None, current: str | None, document: dict) -> dict:
    """Record a canary analysis of the node's release (the operator's side ran it: control/analysis.py), once
    per switch id and rollout: ``result`` ``analysed``, the whole analysis under ``analysis``; never a switch (it serves no
    rollback rule).

    Raises:
        OSError, NodeStateError: the record could not be written.
    """
    import getpass
    import socket

    if any(r.get("switch") == switch and r.get("result") == RecordResult.ANALYSED and r.get("rollout") == rollout
           for r in read_history(ctx).records):
        return {}  # once per switch and rollout (a later rollout may analyse a switch an earlier one did not pass)
    now = time.time()
    started = next((m.get("canary", {}).get("start_s") for m in document.get("measurements", [])
                    if isinstance(m, dict)), None)
    if isinstance(started, (int, float)) and started > now:
        started = now  # the operator's clock runs ahead of the node's: the record keeps the node's order
    record = {"switch": switch, "rollout": rollout, "node": ctx.node, "kind": RecordKind.ANALYSIS,
              "result": RecordResult.ANALYSED, "step": None, "reason": document.get("summary"), "before": current,
              "after": current, "target": current, "served": False, "commit": None, "user": getpass.getuser(),
              "host": socket.gethostname(), "started_at": started if isinstance(started, (int, float)) else now,
              "finished_at": now, "duration_s": round(max(0.0, now - (started or now)), 3), "forced": False,
              "resumed": 0, "auto": None, "analysis": document}
    histories.append(ctx.history_path, record, ctx.node)
    return record
