"""The node's release lock: ``flock(2)`` on the node's state directory, which the kernel frees when its holder dies.

The lock is the state directory itself (adr/0011): nothing done to the files
in ``releases/`` (renamed, removed, replaced, restored from a backup) gives a
second process another thing to lock. It is taken with filelock's
``lock_descriptor`` on a descriptor of the directory (filelock's ``FileLock``
opens a file for writing, which a directory cannot be). A switcher from before
adr/0011 locks ``releases/.lock`` instead, so that lock is taken too, second.

Whether it is held is read from the kernel (common/locks.py), never from a pid
written in a file, and reading it never takes it (:func:`holder_pid`).
``releases/lock.json`` only tells people who holds it and why.
"""

from __future__ import annotations

import getpass
import os
import socket
import time
from contextlib import contextmanager
from typing import Callable, Iterator, NoReturn

from ..common import durable
from ..common.locks import LockTableError, held_by, read_holder, release_holder
from ..common.wording import holder_phrase
from ..common.files import dumps
from ..common.protocol import Mode, RefusedFor
from ..errors import NodeStateError, Refused
from .context import NodeContext


def holder_pid(ctx: NodeContext) -> int | None:
    """The pid of the release holding this node's lock (0: the kernel does not show it here), or None.

    Raises:
        LockTableError: the kernel's lock table cannot be read here (``/proc``).
    """
    return release_holder(ctx.state_dir)


def describe_lock(ctx: NodeContext, pid: int | None) -> str:
    """Who holds the node's lock, in words: the kernel's pid, and what ``lock.json`` says of it (or that it
    is missing, damaged or another process's)."""
    record, damage = read_holder(ctx.holder_path)
    return holder_phrase(record, pid, damage, ctx.holder_path.name)


def lock_reading(ctx: NodeContext) -> tuple[bool, str | None]:
    """(held, who) for readers that must answer even when the lock table cannot be read: then it counts as
    held (whatever cannot be established counts against the node: adr/0007) and ``who`` says why."""
    try:
        pid = holder_pid(ctx)
    except LockTableError as err:
        return True, f"a release or none: whether one holds the node cannot be read here ({err})"
    return pid is not None, describe_lock(ctx, pid) if pid is not None else None


@contextmanager
def node_lock(ctx: NodeContext, release: str | None, action: str = Mode.RELEASE,
              mode: Mode = Mode.RELEASE) -> Iterator[Callable[[str], None]]:
    """Hold the node's release lock, with the holder's details beside it (``lock.json``: host, pid, user,
    ``mode`` (a :class:`common.protocol.Mode`), ``release`` once known, ``started_at``).

    Yields a function that records the release the holder switches to, once it is known (a rollback's
    target is decided under the lock), in ``lock.json``.

    First ``flock(LOCK_EX | LOCK_NB)`` on the state directory (the lock), then on ``releases/.lock`` (what a
    switcher from before adr/0011 takes, opened without blocking on what is there), both with filelock's
    ``lock_descriptor``; both are released by the kernel when this
    process dies, so a dead holder never blocks, and its ``lock.json`` is then stale and overwritten.

    Raises:
        Refused: another live process holds either (the message gives its details).
        NodeStateError: the state directory cannot be opened or locked, or ``releases/.lock`` is a link,
            a directory or otherwise cannot be locked.
    """
    from filelock import lock_descriptor  # here: readers only read the lock table

    from ..common.files import NotAFile, open_regular

    from .store import ensure_releases_dir

    ensure_releases_dir(ctx.state_dir)
    try:
        directory = lock_directory(ctx.state_dir)
    except OSError as err:
        raise NodeStateError(f"{ctx.state_dir}: cannot be opened and locked to take the release lock "
                             f"({err.strerror or err}); it must be the node's state directory, on a filesystem "
                             "that allows flock(2)") from None
    if directory is None:
        _refuse_held(ctx, action)
    try:
        path = ctx.lock_path
        try:  # never blocking on what is there: a FIFO, a device or a link is refused, before or after the open
            compat = open_regular(path, os.O_RDWR | os.O_CREAT, 0o644)
        except NotAFile as err:
            raise NodeStateError(f"{path}: {err.strerror.removesuffix(', not a regular file')}, not the lock file; "
                                 "no release can hold it: remove "
                                 f"it (rm -r {path}) and run the command again") from None
        except OSError as err:
            _refuse_unwritable(ctx, action, path, err)
            raise NodeStateError(f"{path}: cannot be opened ({err.strerror or err}); fix or remove it and run "
                                 "the command again") from None
        try:
            if not lock_descriptor(compat, blocking=False):
                _refuse_held(ctx, action, lambda: held_by(path))  # a switcher from before adr/0011
        except OSError as err:
            os.close(compat)
            _refuse_unwritable(ctx, action, path, err)
            raise NodeStateError(f"{path}: cannot be locked ({err.strerror or err}); fix or remove it and run "
                                 "the command again") from None
        except BaseException:
            os.close(compat)
            raise
        started_at = time.time()
        try:
            _write_holder(ctx, release, mode, started_at)
            yield lambda target: _write_holder(ctx, target, mode, started_at)
        finally:
            try:
                durable.remove(ctx.holder_path)  # before letting go: the next holder's record is never removed
            except OSError:
                pass
            os.close(compat)  # closing the descriptor releases its flock
    finally:
        os.close(directory)  # closing the last descriptor of the open file releases its flock


def _refuse_unwritable(ctx: NodeContext, action: str, path, err: OSError) -> None:
    """Refuse (nothing changed) when ``err`` says the state directory takes no writes: a read-only disk or
    permissions are no damage, and no switch could keep its journal there."""
    from .store import unwritable

    what = unwritable(err)
    if what is not None:
        raise Refused(f"{action} refused: {ctx.node}'s state directory {ctx.releases} {what}: its lock "
                      f"{path.name} cannot be taken, and nothing was changed; make it writable (remount it "
                      "read-write, or fix its permissions), then run the command again") from None


def lock_directory(path) -> int | None:
    """``flock(LOCK_EX | LOCK_NB)`` on the directory at ``path``, with filelock's ``lock_descriptor``.

    Returns:
        The descriptor that holds the lock (closing it releases the lock; children never inherit it, so
        the lock is this process's alone), or None when another open file holds it.

    Raises:
        OSError: the directory cannot be opened, or flock(2) fails otherwise (a filesystem without it).
    """
    from filelock import lock_descriptor

    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if lock_descriptor(fd, blocking=False):
            return fd
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    return None


def _refuse_held(ctx: NodeContext, action: str, read_pid=None) -> NoReturn:
    """Raise the refusal for a lock another process holds, saying who (the kernel's pid, lock.json's details);
    ``read_pid``: how to read the holder's pid (default :func:`holder_pid`)."""
    try:
        pid = (read_pid or (lambda: holder_pid(ctx)))()
    except LockTableError as err:
        raise Refused(f"{action} refused: a release holds {ctx.node}'s lock (who cannot be read here: {err}); "
                      "wait for it to finish") from None
    if pid is None:
        raise Refused(f"{action} refused: {ctx.node}'s release lock was held a moment ago and is free now: "
                      "asked again, it goes ahead", waits_for=RefusedFor.BUSY)
    raise Refused(f"{action} refused: {ctx.node} is being released by {describe_lock(ctx, pid)}; "
                  "wait for it to finish", waits_for=RefusedFor.BUSY)


def _write_holder(ctx: NodeContext, release: str | None, mode: Mode, started_at: float) -> None:
    holder = {"host": socket.gethostname(), "pid": os.getpid(), "user": getpass.getuser(), "mode": mode,
              **({"release": release} if release is not None else {}), "started_at": started_at}
    try:
        durable.write_atomic(ctx.holder_path, (dumps(holder) + "\n").encode())
    except OSError:
        pass  # lock.json only informs people; the kernel's lock is what holds
