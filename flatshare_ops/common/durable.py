"""Durable writes: a crash leaves the old state or the new, never half of either.

dpkg's recipe (docs/reference/engineering-style.md, "Durable files"): write
a temporary file in the same directory, fsync it, rename it over the target,
fsync the directory. Every file the node changes goes through one of the
five primitives here (atomic replace, durable append, rename, symlink
replacement, unlink), so that a test launcher can fail any one of them
(tests/faults/) and prove the early-end rule holds whatever write fails.
Callers use them as ``durable.write_atomic(...)`` (module attribute), which
is what lets the launcher wrap them. Standard library only.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from .files import NotAFile, open_regular, what_is


def fsync_dir(path: Path) -> None:
    """fsync a directory, so that a rename or unlink inside it survives a crash.

    Raises:
        OSError: the directory cannot be opened (missing, not a directory).
    """
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def _naming(path: Path) -> Iterator[None]:
    """An OSError that names no file (a write(2) or fsync(2) that failed: ENOSPC, EIO) names ``path``, so that
    what a failed write says (node/runner.py ``describe_failure``) always says which file."""
    try:
        yield
    except OSError as err:
        if err.filename is None and err.errno:
            raise OSError(err.errno, err.strerror, str(path)) from None
        raise


def write_atomic(path: Path, data: bytes, mode: int = 0o644, owner: tuple[int, int] | None = None) -> None:
    """Replace ``path`` with ``data`` atomically.

    Args:
        path: the file to write; its parent directory must exist.
        data: the complete new contents (bytes).
        mode: permission bits of the new file.
        owner: (uid, gid) to give the new file (kept from the file it replaces), or None.

    A regular file or a symlink at ``path`` is replaced (a link is never written through); a
    directory, a FIFO, a socket or a device there is refused, and nothing is written.

    Raises:
        NotAFile: a directory, FIFO, socket or device is at ``path``.
        OSError: the directory is not writable or the disk is full (ENOSPC,
            EROFS, EIO...); the old file, if any, is then left unchanged and
            no temporary file stays behind.
    """
    path = Path(path)
    try:
        kind = os.lstat(path).st_mode
    except FileNotFoundError:
        kind = None
    if kind is not None and not (stat.S_ISREG(kind) or stat.S_ISLNK(kind)):
        raise NotAFile(path, what_is(kind))
    with _naming(path):
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, mode)
            if owner is not None:
                os.chown(tmp, *owner)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        fsync_dir(path.parent)


def append_line(path: Path, line: str) -> None:
    """Append one line (a record) to ``path`` and fsync it.

    A crash mid-append can leave a torn last line without its newline; the
    next append starts with a newline first, so the torn line never swallows
    the new record (readers skip the torn line).

    The file is opened without following a link or blocking (:func:`.files.open_regular`): only a
    regular file is ever appended to.

    A record is written whole or not at all: write(2) may write less than asked (a disk that fills
    mid-record writes part of it and returns the count, with no error); the rest is written until
    it is all there, and a write that fails part-way has what it wrote cut off again (ftruncate(2) to
    the size before), so that no torn record is left for a reader to skip.

    Raises:
        NotAFile: a symlink, directory, FIFO, socket or device is at ``path`` (nothing is written).
        OSError: the file cannot be opened or written (ENOSPC, EIO...); nothing of the record stays.
    """
    if "\n" in line:
        raise ValueError("a record must be one line")
    append_block(path, line.encode() + b"\n")


def append_block(path: Path, block: bytes) -> None:
    """Append ``block`` (whole lines, ending in a newline) to ``path`` and fsync it, as :func:`append_line`
    appends one: a torn last line is ended first, and the block is written whole or not at all.

    Raises:
        NotAFile: a symlink, directory, FIFO, socket or device is at ``path`` (nothing is written).
        OSError: the file cannot be opened or written (ENOSPC, EIO...); nothing of the block stays.
    """
    with _naming(path):
        _append(path, block)


def _append(path: Path, block: bytes) -> None:
    fd = open_regular(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        size = os.fstat(fd).st_size
        prefix = b""
        if size and os.pread(fd, 1, size - 1) != b"\n":
            prefix = b"\n"
        data = memoryview(prefix + block)
        try:
            while data:
                written = os.write(fd, data)
                if written == 0:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
                data = data[written:]
            os.fsync(fd)
        except BaseException:
            try:
                os.ftruncate(fd, size)  # the record is not kept: not even its first part
                os.fsync(fd)
            except OSError:
                pass  # the write's own error says what went wrong
            raise
    finally:
        os.close(fd)


def rename(source: Path, target: Path) -> None:
    """Rename ``source`` to ``target`` (atomic within a filesystem) and fsync the target's directory.

    Raises:
        OSError: as rename(2) does (EXDEV, ENOTEMPTY, EROFS...).
    """
    os.rename(source, target)
    fsync_dir(Path(target).parent)


def replace_symlink(link: Path, target: str) -> None:
    """Point the symlink ``link`` at ``target`` atomically (a new link renamed over the old).

    Raises:
        OSError: the directory is not writable, or ``link`` is a directory.
    """
    link = Path(link)
    scratch = link.with_name(f".{link.name}.{os.getpid()}.tmp")
    scratch.unlink(missing_ok=True)
    os.symlink(target, scratch)
    try:
        os.replace(scratch, link)
    except BaseException:
        scratch.unlink(missing_ok=True)
        raise
    fsync_dir(link.parent)


def remove(path: Path) -> bool:
    """Remove a file (missing is fine) and fsync its directory; returns whether it existed.

    Raises:
        OSError: the file exists but cannot be removed (EROFS, EACCES, EISDIR...).
    """
    path = Path(path)
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    fsync_dir(path.parent)
    return True
