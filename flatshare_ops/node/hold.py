"""An operator's hold on a node (``flatshare hold``): a record, not a held file lock, as Kamal's lock is.

``releases/hold.json`` says who holds the node, since when and why (``-m``,
e.g. "E2 benchmark"). While it is there, releases and rollbacks to the node
are refused with its message. It is not a drain: the node keeps serving, and
other nodes' releases do not count it as being released (adr/0007).
"""

from __future__ import annotations

import getpass
import os
import socket
import time

from ..common import durable
from ..common.clock import is_time
from ..common.files import Damaged, dumps, read_json_object
from ..common.text import hold_message
from ..common.wording import hold_phrase
from ..errors import FlatshareError, NodeStateError, Refused
from .context import NodeContext

HOLD = "hold.json"


def read_hold(ctx: NodeContext) -> dict | None:
    """The hold on the node, or None.

    Raises:
        NodeStateError: ``hold.json`` is damaged (the message says how to clear it).
    """
    path = ctx.releases / HOLD
    advice = (f"the operator's hold record is damaged; see who held the node, then run 'flatshare hold lift "
              f"--node {ctx.node}' (or remove it: rm -r {path})")
    try:
        hold = read_json_object(path)
    except Damaged as err:
        raise NodeStateError(f"{err}: {advice}") from None
    if hold is not None:
        wrong = ("schema" in hold and hold["schema"] != 1 and f"schema {hold['schema']!r} is not one this "
                 "flatshare-ops reads (1)") or ("since" in hold and not is_time(hold["since"]) and
                                                f"since {hold['since']!r} is not a time")
        if wrong:
            raise NodeStateError(f"{path}: {wrong}: {advice}")
    return hold


def describe(hold: dict) -> str:
    """``root@laptop since 2026-...: E2 benchmark``; what ``hold.json`` lacks is named (common/wording.py)."""
    return hold_phrase(hold, HOLD)


def acquire(ctx: NodeContext, message: str, who: str | None = None) -> dict:
    """Record a hold on the node.

    A release may be switching the node right now: the hold does not stop it (it refuses the next
    ones), and the record says which release was running when it was taken (``during_release``,
    from the kernel's lock table: node/lock.py), so that the operator is told it goes on.

    Raises:
        FlatshareError (exit 2): a message (or who) that is empty or holds a control character.
        Refused: the node is already held (the message names the hold).
        OSError: the record could not be written.
    """
    wrong = hold_message(message) or (hold_message(who) if who is not None else None)
    if wrong:
        raise FlatshareError(f"flatshare-node hold: {wrong}")
    current = read_hold(ctx)
    if current is not None:
        raise Refused(f"hold refused: {ctx.node} is already held by {describe(current)}")
    from .lock import lock_reading

    hold = {"schema": 1, "who": who or f"{getpass.getuser()}@{socket.gethostname()}", "since": time.time(),
            "message": message}
    locked, holder = lock_reading(ctx)
    if locked:
        hold["during_release"] = holder
    from .store import ensure_releases_dir

    ensure_releases_dir(ctx.state_dir)
    try:
        durable.write_atomic(ctx.releases / HOLD, (dumps(hold, sort_keys=True) + "\n").encode())
    except OSError as err:
        raise Refused(f"hold refused: {ctx.node} could not record the hold in {ctx.releases / HOLD} "
                      f"({err.strerror or err}); nothing was changed") from None
    return hold


def release(ctx: NodeContext) -> dict | None:
    """Lift the hold; returns the hold that was lifted, or None when there was none. A damaged hold record
    (a FIFO, a link, a directory, a file that is no hold) is what the operator lifts too: it is removed, and
    the answer says what it was (``{"damaged": "..."}``).

    Raises:
        Refused: it could not be removed (a read-only disk, a directory with files in it): the hold stays.
    """
    path = ctx.releases / HOLD
    try:
        current = read_hold(ctx)
    except NodeStateError as err:
        current = {"damaged": str(err).split(": the operator's hold record is damaged")[0]}
    if current is not None:
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                os.rmdir(path)  # only an empty one: what is in it is someone's, never removed here
            else:
                durable.remove(path)
        except OSError as err:
            raise Refused(f"hold lift refused: {ctx.node} could not remove {path} "
                          f"({err.strerror or err}); the hold stays") from None
    return current


def refuse_if_held(ctx: NodeContext, action: str) -> None:
    """Refuse a release or rollback of a held node.

    Raises:
        Refused: the node is held (its message, and how to lift the hold).
    """
    hold = read_hold(ctx)
    if hold is not None:
        raise Refused(f"{action} refused: {ctx.node} is held by {describe(hold)}; "
                      f"'flatshare hold lift --node {ctx.node}' lifts the hold")
