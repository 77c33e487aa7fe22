"""What a node says about itself: its active release, a switch in progress or interrupted, its units, its history.

Every part is read as untrusted input: a damaged file shows as one line in
its place (``"damaged": [...]``), never as a traceback, so that ``flatshare
status`` always has an answer for each node.
"""

from __future__ import annotations

import os

from ..common.files import Damaged
from ..common.protocol import JournalState, SwitchState
from ..common.units import SERVICE_UNITS, TARGET_UNIT
from ..errors import FlatshareError, NodeStateError, SystemdError
from . import history as histories
from .store import is_stored
from .context import NodeContext
from ..common.locks import LockTableError
from .lock import describe_lock, holder_pid


READINGS = 5
"""At most this many readings of one switch's files make one answer of :func:`switch_state`."""


def switch_state(ctx: NodeContext, switch_id: str) -> dict:
    """What became of one switch (after a lost connection, the operator asks this).

    Its history, journal and lock are read one after the other, and a switch may end (or begin) between the
    reads: its journal read while it ran, its lock read free after it ended, says "interrupted" of a switch that
    was recorded; its history read while it ran, its journal and lock after it ended, finds only the outcome its
    command kept ("ended", as of a command that ran no switch), or only the first part of a switch of two (the
    failed release an automatic rollback follows, where the rollback is recorded too). So a final answer
    (every state but ``switching``, which the operator asks again) is given only when the next reading says the
    same: a switch that ended between two readings is recorded by the second, one that began holds its lock.
    The readings stop at :data:`READINGS` (a node whose files change at every reading: its last answer).

    Returns:
        ``{"state": ...}``, a :class:`common.protocol.SwitchState`: ``recorded`` with the history ``record`` (released,
        failed...; the last part of the switch),
        ``switching`` (its journal is there and the lock is held), ``interrupted``
        (its journal is there, nobody holds the lock, and the part it journals is not recorded: an automatic
        rollback interrupted after the failed release it follows was recorded is ``interrupted``), ``ended`` with the ``outcome`` the
        switch command kept (refused, nothing to do: no switch ran; node/outcomes.py), or
        ``unknown`` (none of these: the command never began on the node).
    """
    answer = _switch_state(ctx, switch_id)
    for _ in range(READINGS - 1):
        if answer["state"] == SwitchState.SWITCHING:
            break
        again = _switch_state(ctx, switch_id)
        if again == answer:
            break
        answer = again
    return answer


def _read_journal(ctx: NodeContext):
    """The journal of an unfinished switch (node/journal.py ``read_journal``: raises its JournalError), or None.

    Where there is no journal, as on a node no switch is running on, node/journal.py and pydantic (its schema),
    most of what status would import, are not imported."""
    if not os.path.lexists(ctx.journal_path):
        return None
    from .journal import read_journal

    return read_journal(ctx.state_dir, ctx.node)


def _summary(pending) -> str:
    from .journal import journal_summary

    return journal_summary(pending)


def _switch_state(ctx: NodeContext, switch_id: str) -> dict:
    """One reading of :func:`switch_state`: the history, then the journal, then the lock."""
    from .outcomes import find
    from .records import read_history

    try:
        records = [r for r in read_history(ctx).records if r.get("switch") == switch_id]
    except NodeStateError as err:
        return {"state": SwitchState.UNKNOWN, "damaged": [str(err)]}
    try:
        pending = _read_journal(ctx)
    except NodeStateError as err:
        pending, damaged = None, [str(err)]
    else:
        damaged = []
    try:
        holder = holder_pid(ctx)
    except LockTableError as err:  # a switch may run: never say "interrupted" on no evidence
        damaged.append(str(err))
        holder = 0
    if pending is not None and pending.switch == switch_id and holder is not None:
        return {"state": SwitchState.SWITCHING, "journal": _summary(pending), "pid": holder}
    if pending is not None and pending.switch == switch_id and not any(r.get("kind") == pending.kind for r in records):
        # Its journal is a part not recorded yet: an automatic rollback interrupted after the failure it follows
        # was recorded (one switch id, two parts) is that rollback, never only the failure before it.
        return {"state": SwitchState.INTERRUPTED, "journal": _summary(pending)}
    if records:
        return {"state": SwitchState.RECORDED, "record": records[-1]}
    if holder is not None:
        return {"state": SwitchState.SWITCHING, "journal": None, "pid": holder}
    try:
        kept = find(ctx, switch_id)
    except Damaged as err:
        kept, damaged = None, [*damaged, f"{err}; what switch commands ended with cannot be read: move it aside"]
    if kept is not None:
        return {"state": SwitchState.ENDED, "outcome": kept}
    return {"state": SwitchState.UNKNOWN, "damaged": damaged}


def node_status(ctx: NodeContext) -> dict:
    """The node's active release, any switch in progress or interrupted, its units' states, its last switch.

    Returns:
        A JSON-ready dict: ``node``, ``release``, ``in_progress`` (who holds the lock, from the
        kernel's lock table, in words) and ``in_progress_pid`` (its pid), ``journal_state`` (a
        :class:`~common.protocol.JournalState`: whether a switch is in the journal), ``switching`` (the journal's
        summary, for people; None when there is none or it cannot be read) and ``switching_pid`` (the pid the
        journal names), ``units`` (unit -> ActiveState),
        ``last`` (the newest history record), ``hold`` (the operator's hold in words: who, since when, why;
        None when there is none), ``damaged`` (one line per damaged file).
    """
    from .records import read_history
    from .store import current_release

    status: dict = {"node": ctx.node, "release": None, "journal_state": JournalState.NONE, "switching": None,
                    "switching_rollout": None,
                    "switching_pid": None, "in_progress": None, "in_progress_pid": None, "units": {}, "last": None,
                    "hold": None, "damaged": []}
    try:
        status["release"] = current_release(ctx.state_dir)
    except NodeStateError as err:
        status["damaged"].append(str(err))
    link = ctx.releases / "current"
    if status["release"] is not None and not is_stored(ctx.state_dir, status["release"]):
        status["damaged"].append(f"{link}: points at release {status['release']}, which is not stored on the node; "
                                 "run 'flatshare release' to switch the node to a stored release")
    elif status["release"] is not None:
        from .bundle import stored_files

        try:  # the active release, checked against its id as every reader of it does (node/bundle.py)
            stored_files(ctx, status["release"])
        except NodeStateError as err:
            status["damaged"].append(f"the active release is damaged: {err}")
    try:
        pid = holder_pid(ctx)
    except LockTableError as err:
        pid = None
        status["damaged"].append(f"whether a release holds the node cannot be read: {err}")
    if pid is not None:
        status["in_progress"] = describe_lock(ctx, pid)
        status["in_progress_pid"] = pid
    status["drain_left"] = None
    if pid is None and status["release"] is not None:
        from .calls import active_serving, drain_files

        # Where the running worker watches (systemd's loaded unit) and where the active release names it.
        for drain in drain_files(ctx, active_serving(ctx, status["release"])):
            if os.path.exists(drain):  # a dangling link drains nobody
                status["drain_left"] = (f"{drain} is present with no release running: the voice worker takes no "
                                        "calls; 'flatshare release' to this node gives them back")
    from .hold import describe, read_hold

    try:  # the operator's hold (it refuses releases and rollbacks; a damaged one too)
        hold = read_hold(ctx)
        status["hold"] = describe(hold) if hold is not None else None
    except NodeStateError as err:
        status["damaged"].append(str(err))
    try:
        pending = _read_journal(ctx)
        status["journal_state"] = JournalState.PRESENT if pending else JournalState.NONE
        status["switching"] = _summary(pending) if pending else None
        status["switching_rollout"] = pending.rollout if pending else None
        status["switching_pid"] = pending.pid if pending else None
    except NodeStateError as err:
        status["damaged"].append(str(err))
        status["journal_state"] = JournalState.UNREADABLE
    try:
        states = ctx.manager.properties([(u, "Unit", "ActiveState") for u in (TARGET_UNIT, *SERVICE_UNITS)])
        status["units"] = {u: states[f"{u}/ActiveState"] for u in (TARGET_UNIT, *SERVICE_UNITS)}
    except SystemdError as err:
        status["units"] = {}
        status["systemd"] = str(err)
    from .outcomes import OUTCOMES, find

    try:  # what switch commands ended with, for the operator's follow-up after a lost session
        find(ctx, "")
    except Damaged as err:
        status["damaged"].append(f"{err}; a follow-up cannot learn what a refused switch command ended with: "
                                 f"move it aside (the next switch command then starts a new {OUTCOMES})")
    try:
        hist = read_history(ctx)
        status["last"] = hist.last()
        status["damaged"] += [f"{ctx.releases}/{note}" for note in hist.skipped]
        if hist.disorder:
            status["damaged"].append(f"{ctx.releases}/{hist.disorder}: no rollback target is decided from it; "
                                     "put the lines in order or move the file aside")
            return status
        served = histories.served_releases(hist)
        if status["release"] is None and served and not status["damaged"]:
            status["damaged"].append(f"{link}: missing, though the history says release {served[0]} served last; "
                                     "run 'flatshare release' to point it at the checkout's release")
    except FlatshareError as err:
        status["damaged"].append(str(err))
    return status
