"""The node's release lock: an fcntl lock the kernel frees when its holder dies, and a note of who holds it.

The lock itself is ``releases/.lock``, taken with filelock (``flock(2)``).
Whether it is held is read from the kernel (``/proc/locks``), never from a
pid written in a file, and reading it never takes it (:func:`held_by`).
``releases/lock.json`` only tells people who holds it and why.
"""

from __future__ import annotations

import errno
import getpass
import os
import socket
import stat
import time
from contextlib import contextmanager
from typing import Iterator

from ..common import durable
from ..common.files import dumps, what_is
from ..common.clock import is_time, utc_stamp
from ..common.locks import held_by, read_holder
from ..errors import NodeStateError, Refused
from .context import NodeContext


def describe_holder(record: dict, pid: int | None, damage: str | None = None) -> str:
    """``root@host pid 123 (release X, since 2026-...)`` for messages; a damaged record is named, not printed."""
    if damage:
        return f"pid {pid} (the holder's record is damaged: {damage})"
    who = pid if pid is not None else record.get("pid")
    if not record:
        return f"pid {who} (its record, lock.json, is not written yet or was removed)"
    since = record.get("started_at")
    when = f", since {utc_stamp(since)}" if is_time(since) else ""
    return (f"{record.get('user', 'someone')}@{record.get('host', 'a host')} pid {who} "
            f"(release {record.get('release', '(not named)')}{when})")


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

    from .store import ensure_releases_dir

    ensure_releases_dir(ctx.state_dir)
    path = ctx.lock_path
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as err:
        raise NodeStateError(f"{path}: cannot be read ({err.strerror or err}); fix or remove it and run the command "
                             "again") from None
    if mode is not None and not stat.S_ISREG(mode):
        raise NodeStateError(f"{path}: is {what_is(mode)}, not the lock file; no release can hold it: remove it "
                             f"(rm -r {path}) and run the command again")
    lock = FileLock(str(path))
    try:
        lock.acquire(timeout=0)
    except Timeout:  # before OSError: filelock's Timeout is a TimeoutError, hence an OSError
        who = describe_lock(ctx, held_by(ctx.lock_path))
        raise Refused(f"{action} refused: {ctx.node} is being released by {who}; wait for it to finish") from None
    except OSError as err:
        if err.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            # Not damage: the disk (or the directory) does not take writes, so no switch could keep its journal.
            what = ("is on a read-only filesystem (EROFS)" if err.errno == errno.EROFS else
                    f"is not writable by {getpass.getuser()} ({errno.errorcode[err.errno]}: {err.strerror})")
            raise Refused(f"{action} refused: {ctx.node}'s state directory {ctx.releases} {what}: its lock "
                          f"{path.name} cannot be taken, and nothing was changed; make it writable (remount it "
                          "read-write, or fix its permissions), then run the command again") from None
        raise NodeStateError(f"{path}: cannot be locked ({err.strerror or err}); fix or remove it and run "
                             "the command again") from None
    holder = {"host": socket.gethostname(), "pid": os.getpid(), "user": getpass.getuser(),
              "release": release, "started_at": time.time()}
    try:
        try:
            durable.write_atomic(ctx.holder_path, (dumps(holder) + "\n").encode())
        except OSError:
            pass  # lock.json only informs people; the kernel's lock is what holds
        yield
    finally:
        try:
            durable.remove(ctx.holder_path)
        except OSError:
            pass
        lock.release()
