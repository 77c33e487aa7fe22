"""The node's release lock: an fcntl lock the kernel frees when its holder dies, and a note of who holds it.

The lock itself is ``releases/.lock``, taken with filelock (``flock(2)``).
Whether it is held is read from the kernel (``/proc/locks``), never from a
pid written in a file, and reading it never takes it (:func:`held_by`).
``releases/lock.json`` only tells people who holds it and why.
"""

from __future__ import annotations

import getpass
import json
import os
import socket
import time
from contextlib import contextmanager
from typing import Iterator

from ..common import durable
from ..common.clock import utc_stamp
from ..common.locks import held_by, read_holder
from ..errors import NodeStateError, Refused
from .context import NodeContext


def describe_holder(record: dict, pid: int | None, damage: str | None = None) -> str:
    """``root@host pid 123 (release X, since 2026-...)`` for messages; a damaged record is named, not printed."""
    if damage:
        return f"pid {pid} (the holder's record is damaged: {damage})"
    since = record.get("started_at")
    when = utc_stamp(since) if isinstance(since, (int, float)) else "unknown time"
    return (f"{record.get('user', '?')}@{record.get('host', '?')} pid {pid if pid is not None else record.get('pid')} "
            f"(release {record.get('release', '?')}, since {when})")


def describe_lock(ctx: NodeContext, pid: int | None) -> str:
    """Who holds the node's lock: the kernel's pid, and ``lock.json``'s details (or its damage)."""
    record, damage = read_holder(ctx.holder_path)
    return describe_holder(record, pid, damage)


@contextmanager
def node_lock(ctx: NodeContext, release: str, action: str = "release") -> Iterator[None]:
    """Hold the node's release lock, with the holder's details beside it.

    The lock is an fcntl lock (filelock), released by the kernel when its
    holder dies, so a dead holder never blocks; its ``lock.json`` is then stale
    and simply overwritten.

    Raises:
        Refused: another live process holds it (the message gives its details).
        NodeStateError: ``releases/.lock`` is a link, a directory or otherwise cannot be locked.
    """
    from filelock import FileLock, Timeout  # here: status and the admission probe only read the lock table

    ctx.releases.mkdir(parents=True, exist_ok=True)
    path = ctx.lock_path
    if path.is_symlink() or (path.exists() and not path.is_file()):
        kind = "a symlink" if path.is_symlink() else "a directory" if path.is_dir() else "not a regular file"
        raise NodeStateError(f"{path}: is {kind}, not the lock file; no release can hold it: remove it "
                             f"(rm -r {path}) and run the command again")
    lock = FileLock(str(path))
    try:
        lock.acquire(timeout=0)
    except Timeout:  # before OSError: filelock's Timeout is a TimeoutError, hence an OSError
        who = describe_lock(ctx, held_by(ctx.lock_path))
        raise Refused(f"{action} refused: {ctx.node} is being released by {who}; wait for it to finish") from None
    except OSError as err:
        raise NodeStateError(f"{path}: cannot be locked ({err.strerror or err}); fix or remove it and run "
                             "the command again") from None
    holder = {"host": socket.gethostname(), "pid": os.getpid(), "user": getpass.getuser(),
              "release": release, "started_at": time.time()}
    try:
        try:
            durable.write_atomic(ctx.holder_path, (json.dumps(holder) + "\n").encode())
        except OSError:
            pass  # lock.json only informs people; the kernel's lock is what holds
        yield
    finally:
        try:
            durable.remove(ctx.holder_path)
        except OSError:
            pass
        lock.release()
