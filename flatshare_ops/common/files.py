"""Opening and reading files another process or a crash may have touched, as untrusted input (standard library only).

docs/reference/engineering-style.md, "Every file distrusted": a journal, lock
record, history or status file may be missing, empty, torn by a crash, not
JSON, JSON of the wrong shape, nested without end, huge, a directory, a link,
a FIFO, a socket or a device where a file belongs, or unreadable. Each form is
named by :class:`Damaged`, so that the caller can say in one line which file,
what damage and what to do; never a traceback, and never a wait:

- every open goes through :func:`open_regular`: the path is looked at first
  (``lstat``: a FIFO, a socket or a device is never opened at all), then opened
  with ``O_NONBLOCK`` (so that one swapped in meanwhile cannot block the open)
  and checked again on the open descriptor (``fstat``);
- every read is bounded in size (:data:`MAX_BYTES`, or the caller's bound), and
  every JSON document in depth (:data:`MAX_DEPTH`) and in its numbers: ``NaN``,
  ``Infinity`` and numbers too large for a float (``1e400``) are not JSON as
  RFC 8259 reads it, so no bound or time read from a file is NaN or infinite;
- :func:`dumps` is the writers' side of the same rules: the tool never writes a
  document its own reader would refuse.
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
from pathlib import Path

#: The most a node file may hold unless its reader says otherwise (bytes); flatshare-ops writes far less.
MAX_BYTES = 1 << 20
#: How deeply a JSON document may nest (objects and arrays); flatshare-ops writes at most 4 levels.
MAX_DEPTH = 32


class Damaged(ValueError):
    """A file is damaged. ``path`` names it and ``form`` says how (``empty``, ``not JSON (...)``...)."""

    def __init__(self, path: Path, form: str) -> None:
        super().__init__(f"{path}: {form}")
        self.path, self.form = Path(path), form


class NotAFile(OSError):
    """What is at a path is not a regular file (a directory, a FIFO, a socket, a device, a link not
    followed): refused without waiting on it. ``filename`` is the path; ``strerror`` says what it is."""

    strerror: str  # always set, by __init__

    def __init__(self, path: Path, what: str) -> None:
        super().__init__(None, f"is {what}, not a regular file")
        self.filename = str(path)


class TooDeep(ValueError):
    """A JSON document nests more than :data:`MAX_DEPTH` levels."""


class NotFinite(ValueError):
    """A JSON document holds NaN, an infinity, or a number too large for a float."""


def what_is(mode: int) -> str:
    """What a file of this ``st_mode`` is, for messages: ``a directory``, ``a FIFO (named pipe)``..."""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISLNK, "a symlink"), (stat.S_ISREG, "a regular file")):
        if test(mode):
            return name
    return "not a regular file"


def _link_text(path: Path, dangling: bool = False) -> str:
    kind = "a dangling symlink" if dangling else "a symlink"
    try:
        return f"{kind} (to {os.readlink(path)})"
    except OSError:
        return kind


def open_regular(path: Path, flags: int = os.O_RDONLY, mode: int = 0o644, follow: bool = False) -> int:
    """Open ``path`` as a regular file, never blocking on what is there, and return the descriptor.

    Args:
        path: the file.
        flags: ``os.O_RDONLY``, ``os.O_WRONLY | os.O_APPEND | os.O_CREAT``...
        mode: permission bits of a file ``O_CREAT`` makes.
        follow: follow a symlink (to a regular file); otherwise a link is refused.

    Raises:
        NotAFile: a directory, a FIFO, a socket, a device, or a symlink (unless ``follow``): refused
            before it is opened (``lstat``), or right after (``fstat``) if it was swapped in meanwhile;
            the open itself cannot block (``O_NONBLOCK``).
        FileNotFoundError: nothing there (and no ``O_CREAT``).
        OSError: as open(2) does otherwise (EACCES, EROFS, ENOSPC, EIO...).
    """
    path = Path(path)
    try:
        info = os.stat(path) if follow else os.lstat(path)
    except FileNotFoundError:
        info = None
        if follow and os.path.islink(path) and not flags & os.O_CREAT:
            raise FileNotFoundError(errno.ENOENT, f"is {_link_text(path, dangling=True)}", str(path)) from None
    if info is not None and not stat.S_ISREG(info.st_mode):
        raise NotAFile(path, _link_text(path) if stat.S_ISLNK(info.st_mode) else what_is(info.st_mode))
    extra = os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags | extra, mode)
    except OSError as err:
        if err.errno == errno.ELOOP and not follow:
            raise NotAFile(path, _link_text(path)) from None
        if err.errno in (errno.ENXIO, errno.EISDIR, errno.EWOULDBLOCK, errno.ENODEV):
            try:
                kind = what_is(os.lstat(path).st_mode)
            except OSError:
                kind = "not a regular file"
            raise NotAFile(path, kind) from None
        raise
    try:
        info = os.fstat(fd)
    except OSError:
        os.close(fd)
        raise
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise NotAFile(path, what_is(info.st_mode))
    return fd


def _not_a_file(err: NotAFile) -> str:
    """The form of a :class:`NotAFile`: ``is a directory, not a file``, ``is a symlink (to X), not a file``, or
    ``is not a regular file (a FIFO (named pipe))`` for what is neither."""
    what = err.strerror.removeprefix("is ").removesuffix(", not a regular file")
    if what == "a directory" or what.startswith(("a symlink", "a dangling symlink")):
        return f"is {what}, not a file"
    return f"is not a regular file ({what})"


def _size(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB" if n >= 1 << 20 else f"{n} bytes"


def read_bytes(path: Path, allow_symlink: bool = False, limit: int = MAX_BYTES) -> bytes | None:
    """The bytes of a regular file, at most ``limit`` of them; None when it does not exist.

    Raises:
        Damaged: a directory, a symlink (unless allowed), a FIFO, a socket or a device where a file
            belongs (never opened, never waited on), more than ``limit`` bytes, or unreadable
            (EACCES, EIO...).
    """
    path = Path(path)
    try:
        fd = open_regular(path, os.O_RDONLY, follow=allow_symlink)
    except FileNotFoundError:
        if allow_symlink and os.path.islink(path):
            raise Damaged(path, f"is {_link_text(path, dangling=True)}, not a file") from None
        return None
    except NotAFile as err:
        raise Damaged(path, _not_a_file(err)) from None
    except OSError as err:
        raise Damaged(path, f"unreadable ({err.strerror or err})") from None
    try:
        with os.fdopen(fd, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            data = b"" if size > limit else f.read(limit + 1)
    except OSError as err:
        raise Damaged(path, f"unreadable ({err.strerror or err})") from None
    if size > limit or len(data) > limit:
        raise Damaged(path, f"is {_size(max(size, len(data)))}, more than the {_size(limit)} such a file may hold "
                      "(flatshare-ops never writes one that large)")
    return data


def _no_constant(name: str):
    raise NotFinite(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise NotFinite(f"{text} is too large for a number")
    return value


#: The largest integer a file may hold: what a float holds exactly (2**53). Every number the node keeps (a time,
#: a pid, a size, a count) is far below it; one beyond (a 400-digit integer, which Python reads exactly) would
#: overflow wherever it meets a float (``math.isfinite``, a time), so it is damage here, where it is read.
MAX_INTEGER = 1 << 53


def _bounded_int(text: str) -> int:
    value = int(text)
    if abs(value) > MAX_INTEGER:
        raise NotFinite(f"an integer of {len(text.lstrip('-'))} digits is too large for a number")
    return value


def _depth(document) -> int:
    """How deeply a parsed document nests (1 for a flat object or array; 0 for a scalar), iteratively."""
    deepest, stack = 0, [(document, 1)]
    while stack:
        value, depth = stack.pop()
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        if deepest > MAX_DEPTH:
            return deepest
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return deepest


def nesting(document) -> int:
    """How deeply a parsed document nests: 1 for a flat object or array, 0 for a scalar (at most one past
    :data:`MAX_DEPTH` is counted)."""
    return _depth(document)


def loads(text: str | bytes):
    """``json.loads`` as RFC 8259 reads JSON, bounded: ``NaN``, ``Infinity`` and ``-Infinity`` (which
    Python's json accepts and writes), numbers too large for a float (``1e400``, which Python reads
    as infinity) and integers beyond :data:`MAX_INTEGER` are refused, and so is a document nested more than
    :data:`MAX_DEPTH` levels.

    Raises:
        json.JSONDecodeError: not JSON.
        NotFinite, TooDeep (both ValueError): one of those.
    """
    try:
        document = json.loads(text, parse_constant=_no_constant, parse_float=_finite, parse_int=_bounded_int)
    except RecursionError:
        raise TooDeep(f"nested more than {MAX_DEPTH} levels deep") from None
    if _depth(document) > MAX_DEPTH:
        raise TooDeep(f"nested more than {MAX_DEPTH} levels deep")
    return document


def dumps(document, **options) -> str:
    """``json.dumps`` for a file the tool writes, by the rules :func:`loads` reads it with: a NaN or an
    infinity is refused (never written as ``NaN``), and so is a document nested too deeply.

    Raises:
        ValueError: a non-finite number, or too deep (a bug: nothing is written).
    """
    if _depth(document) > MAX_DEPTH:
        raise TooDeep(f"a document nested more than {MAX_DEPTH} levels deep is never written")
    return json.dumps(document, allow_nan=False, **options)


def parse_json_object(path: Path, raw: bytes) -> dict:
    """Parse ``raw`` (the bytes of ``path``) as one JSON object.

    Raises:
        Damaged: empty, not UTF-8, not JSON (a torn write shows as this, with
            where the text stops), nested too deeply, a number that is not finite,
            or JSON that is not an object.
    """
    if not raw.strip():
        return _raise(path, "empty")
    try:
        document = loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        return _raise(path, "not UTF-8 text")
    except json.JSONDecodeError as err:
        return _raise(path, f"not JSON ({err.msg} at line {err.lineno} column {err.colno}; torn or overwritten?)")
    except ValueError as err:
        return _raise(path, json_damage(err))
    if not isinstance(document, dict):
        return _raise(path, f"JSON of the wrong shape (a {type(document).__name__}, not an object)")
    return document


def json_damage(err: ValueError) -> str:
    """The form of damage a :func:`loads` error names: ``not JSON (...)``, ``JSON nested more than ...``..."""
    if isinstance(err, TooDeep):
        return f"JSON {err} (flatshare-ops never writes such a file)"
    if isinstance(err, NotFinite):
        return f"not JSON ({err})"  # RFC 8259 has no NaN, no infinities, no number beyond a float's range
    return f"not JSON ({err})"


def read_json_object(path: Path, allow_symlink: bool = False, limit: int = MAX_BYTES) -> dict | None:
    """A JSON object from ``path``; None when the file does not exist.

    Raises:
        Damaged: any other form of damage (see :func:`read_bytes`, :func:`parse_json_object`).
    """
    raw = read_bytes(path, allow_symlink, limit)
    return None if raw is None else parse_json_object(path, raw)


def _raise(path: Path, form: str):
    raise Damaged(path, form)


def remove_tree(path: Path) -> bool:
    """Remove the directory tree at ``path``: ``shutil.rmtree`` (links never followed, errors ignored), and
    coreutils' ``rm -rf --one-file-system`` where the tree nests deeper than Python's recursion allows
    (``shutil.rmtree`` recurses on Python 3.11: a chain of 1,200 empty directories raises RecursionError
    through it; ``rm`` walks with fts(3), without recursion, and never follows a link).

    Returns:
        Whether ``path`` is gone afterwards.
    """
    import shutil
    import subprocess

    try:
        shutil.rmtree(path, ignore_errors=True)
    except RecursionError:
        subprocess.run(["rm", "-rf", "--one-file-system", "--", str(path)], stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    return not os.path.lexists(path)
