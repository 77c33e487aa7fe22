"""Whether a release holds a node, read from the kernel without taking the lock (standard library only).

The node's release lock is ``flock(2)`` on its state directory (adr/0011), and,
for switchers from before that, on ``releases/.lock``. serving-check, the
admission probe and ``status`` ask whether it is held: the answer comes from
the kernel's table of locks, never from a pid written in a file (a pid can be
reused; a killed holder's file stays behind), and reading it never takes the
lock (a reader that took it, even shared, would make a release started at
that moment refuse).

The lock table (proc(5), ``/proc/locks``) names a lock's file by the device of
the filesystem's superblock and the inode number the kernel keeps, which are
not always what ``stat(2)`` says: on btrfs ``st_dev`` is the subvolume's own
anonymous device, and on overlayfs a file's ``st_dev``/``st_ino`` may be those
of the layer it lives on. So the reading opens the path and asks the kernel
about that open file: its inode number (``ino:`` in ``/proc/self/fdinfo/FD``)
and its mount (``mnt_id:`` there), whose superblock device ``/proc/self/mountinfo``
gives (its third field): the same two numbers ``/proc/locks`` prints
(docs/reference/release-protocol.md, "The release lock").
"""

from __future__ import annotations

import os
from pathlib import Path

from .clock import is_time
from .files import Damaged, read_json_object
from .node_files import LOCK, RELEASES


class LockTableError(OSError):
    """The kernel's view of an open file could not be read (no ``/proc``, or an ``fdinfo`` without ``mnt_id``)."""


def read_holder(path: Path) -> tuple[dict, str | None]:
    """``lock.json``'s details of who holds the lock, for people: (record, damage or None).

    A missing record is ``({}, None)``; a damaged one ``({}, "lock.json: empty")`` and the like, so
    that a message can name the damage instead of printing its garbage. A field of the wrong type is
    dropped from the record and named in the damage (``lock.json: pid is str (the wrong shape)``).
    """
    try:
        record = read_json_object(path) or {}
    except Damaged as err:
        return {}, f"{Path(path).name}: {err.form}"
    fields: dict[str, type | tuple[type, ...]] = {"host": str, "pid": int, "user": str, "mode": str, "release": str,
                                                  "started_at": (int, float)}
    for key, kind in fields.items():
        if key in record and (not isinstance(record[key], kind) or isinstance(record[key], bool)):
            return {}, f"{Path(path).name}: {key} is {type(record[key]).__name__} (the wrong shape)"
    if "started_at" in record and not is_time(record["started_at"]):
        return {}, f"{Path(path).name}: started_at {record['started_at']!r} is not a time"
    if "pid" in record and record["pid"] <= 0:
        return {}, f"{Path(path).name}: pid {record['pid']} is not a process id"
    return record, None


def lock_table_key(path: Path) -> str | None:
    """``MAJ:MIN:INODE`` as ``/proc/locks`` names the file or directory at ``path``, or None when there is none.

    Opens ``path`` with ``O_PATH`` (no read permission needed; a FIFO or a device is never opened for I/O)
    and reads the open file's ``mnt_id`` and ``ino`` from ``/proc/self/fdinfo/FD`` (proc(5); ``ino`` since
    Linux 5.14, else ``fstat``'s, the same number on every filesystem but some overlayfs set-ups), then that
    mount's superblock device from ``/proc/self/mountinfo``. The device is printed as ``/proc/locks`` prints
    it (``%02x:%02x``, fs/locks.c ``lock_get_status``).

    Raises:
        LockTableError: ``/proc`` does not say (not Linux, or ``/proc`` not mounted).
    """
    found = _mount_and_inode(Path(path))
    if found is None:
        return None
    devices = _superblock_devices({found[0]})
    if found[0] not in devices:
        raise LockTableError(f"/proc/self/mountinfo has no mount {found[0]}")
    major, minor = (int(n) for n in devices[found[0]].split(":"))
    return f"{major:02x}:{minor:02x}:{found[1]}"


def _mount_and_inode(path: Path) -> tuple[str, int] | None:
    """(mount id, inode number) of the file at ``path`` as the kernel keeps them, or None when there is none."""
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as err:
        raise LockTableError(f"{path}: cannot be opened to read its lock ({err.strerror or err})") from None
    try:
        with open(f"/proc/self/fdinfo/{fd}", encoding="ascii", errors="replace") as f:
            info = dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)
        return info["mnt_id"].strip(), int(info["ino"]) if "ino" in info else os.fstat(fd).st_ino
    except (OSError, KeyError, ValueError) as err:
        raise LockTableError(f"/proc/self/fdinfo does not give the open file's mount ({err})") from None
    finally:
        os.close(fd)


def _superblock_devices(mounts: set[str]) -> dict[str, str]:
    """mount id -> ``MAJ:MIN`` (decimal) of its superblock: field 3 of its ``/proc/self/mountinfo`` line."""
    if not mounts:
        return {}
    found = {}
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split(" ", 3)
                if len(fields) > 2 and fields[0] in mounts:
                    found[fields[0]] = fields[2]
    except OSError as err:
        raise LockTableError(f"/proc/self/mountinfo cannot be read ({err.strerror or err})") from None
    return found


def _flock_holders() -> dict[str, int]:
    """``MAJ:MIN:INODE`` -> pid of every ``FLOCK`` lock in ``/proc/locks`` (waiters left out)."""
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            lines = f.readlines()
    except OSError as err:
        raise LockTableError(f"/proc/locks cannot be read ({err.strerror or err})") from None
    holders: dict[str, int] = {}
    for line in lines:
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 12357 fe:00:2146384 0 EOF"; a blocked waiter's line has "->" in front.
        if "->" in fields or len(fields) < 6 or fields[1] != "FLOCK":
            continue
        try:
            holders.setdefault(fields[5], max(int(fields[4]), 0))
        except ValueError:
            holders.setdefault(fields[5], 0)
    return holders


def held_by(path: Path) -> int | None:
    """The pid holding ``flock`` on the file or directory at ``path`` according to ``/proc/locks``, or None
    when it is free (or there is nothing at ``path``).

    Reads the kernel's table of locks (proc(5), ``/proc/locks``: ``N: FLOCK ADVISORY WRITE PID
    MAJ:MIN:INODE START END``) for the key :func:`lock_table_key` gives; it never takes the lock.
    The pid is the process that took the lock, as this process's pid namespace sees it (0 when the
    kernel does not show it here).

    Raises:
        LockTableError: ``/proc`` does not say (then nobody can tell: callers say so, never "free").
    """
    return _first_holder([Path(path)])


def release_holder(state_dir: Path) -> int | None:
    """The pid of the release holding the node whose state directory is ``state_dir``, or None when none does.

    The lock is ``flock`` on the state directory itself (adr/0011), which nothing done to the files in
    ``releases/`` (renamed, removed, replaced, restored) can move; a switcher from before adr/0011 holds
    ``releases/.lock`` only, so that is read too.

    Raises:
        LockTableError: ``/proc`` does not say.
    """
    return _first_holder([Path(state_dir), Path(state_dir) / RELEASES / LOCK])


def _first_holder(paths: list[Path]) -> int | None:
    """The pid holding the first of ``paths`` that is held, else None.

    serving-check runs this every minute, so the costly part (``/proc/self/mountinfo``, which the
    kernel writes out at each read) is read only when ``/proc/locks`` has a lock on an inode of the same
    number: with none, no device can match, and the answer is "free" without it.
    """
    holders = _flock_holders()
    opened = [_mount_and_inode(p) for p in paths]
    numbers = {key.rsplit(":", 1)[1] for key in holders}
    if not any(o is not None and str(o[1]) in numbers for o in opened):
        return None
    devices = _superblock_devices({o[0] for o in opened if o is not None})
    for found in opened:
        if found is None:
            continue
        if found[0] not in devices:
            raise LockTableError(f"/proc/self/mountinfo has no mount {found[0]}")
        major, minor = (int(n) for n in devices[found[0]].split(":"))
        key = f"{major:02x}:{minor:02x}:{found[1]}"
        if key in holders:
            return holders[key]
    return None
