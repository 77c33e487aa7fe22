"""Whether a file lock is held, read from the kernel without taking it (standard library only).

serving-check and the admission probe ask whether a release holds a node:
the answer comes from the kernel's table of locks, never from a pid written
in a file (a pid can be reused; a killed holder's file stays behind), and
reading it never takes the lock.
"""

from __future__ import annotations

import os
from pathlib import Path

from .clock import is_time
from .files import Damaged, read_json_object


def read_holder(path: Path) -> tuple[dict, str | None]:
    """``lock.json``'s details of who holds the lock, for people: (record, damage or None).

    A missing record is ``({}, None)``; a damaged one ``({}, "lock.json: empty")`` and the like, so
    that a message can name the damage instead of printing its garbage.
    """
    try:
        record = read_json_object(path) or {}
    except Damaged as err:
        return {}, f"{Path(path).name}: {err.form}"
    fields = {"host": str, "pid": int, "user": str, "release": str, "started_at": (int, float)}
    for key, kind in fields.items():
        if key in record and (not isinstance(record[key], kind) or isinstance(record[key], bool)):
            return {}, f"{Path(path).name}: {key} is {type(record[key]).__name__} (the wrong shape)"
    if "started_at" in record and not is_time(record["started_at"]):
        return {}, f"{Path(path).name}: started_at {record['started_at']!r} is not a time"
    if "pid" in record and record["pid"] <= 0:
        return {}, f"{Path(path).name}: pid {record['pid']} is not a process id"
    return record, None


def held_by(lock_path: Path) -> int | None:
    """The pid holding ``flock`` on ``lock_path`` according to ``/proc/locks``, or None when it is free.

    Reads the kernel's table of locks (proc(5), ``/proc/locks``: ``N: FLOCK ADVISORY WRITE PID
    MAJ:MIN:INODE START END``, the device numbers in hex) and matches the file's device and inode;
    it never takes the lock. The pid is the process that took the lock (0 if the kernel does not know).
    """
    try:
        info = os.stat(lock_path)
    except OSError:
        return None
    want = f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}:{info.st_ino}"
    try:
        with open("/proc/locks") as f:
            lines = f.readlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 12357 fe:00:2146384 0 EOF"; a blocked waiter's line has "->" in front.
        if "->" in fields:
            continue
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == want:
            try:
                return int(fields[4])
            except ValueError:
                return 0
    return None


