"""Reading files another process or a crash may have touched, as untrusted input (standard library only).

docs/reference/engineering-style.md, "Every file distrusted": a journal, lock
record, history or status file may be missing, empty, torn by a crash, not
JSON, JSON of the wrong shape, a directory or a link where a file belongs, or
unreadable. Each form is named by :class:`Damaged`, so that the caller can
say in one line which file, what damage and what to do; never a traceback.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path


class Damaged(ValueError):
    """A file is damaged. ``path`` names it and ``form`` says how (``empty``, ``not JSON (...)``...)."""

    def __init__(self, path: Path, form: str) -> None:
        super().__init__(f"{path}: {form}")
        self.path, self.form = Path(path), form


def read_bytes(path: Path, allow_symlink: bool = False) -> bytes | None:
    """The bytes of a regular file; None when it does not exist.

    Raises:
        Damaged: a directory, a symlink (unless allowed), a device or fifo
            where a file belongs, or unreadable (EACCES, EIO...).
    """
    path = Path(path)
    try:
        info = os.stat(path) if allow_symlink else os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as err:
        raise Damaged(path, f"unreadable ({err.strerror or err})") from None
    if stat.S_ISLNK(info.st_mode):
        raise Damaged(path, f"is a symlink (to {os.readlink(path)}), not a file")
    if stat.S_ISDIR(info.st_mode):
        raise Damaged(path, "is a directory, not a file")
    if not stat.S_ISREG(info.st_mode):
        raise Damaged(path, "is not a regular file")
    try:
        with open(path, "rb") as f:  # a fifo was refused above: this read cannot block
            return f.read()
    except FileNotFoundError:
        return None
    except OSError as err:
        raise Damaged(path, f"unreadable ({err.strerror or err})") from None


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def loads(text: str | bytes):
    """``json.loads`` as RFC 8259 reads JSON: ``NaN``, ``Infinity`` and ``-Infinity`` (which Python's
    json accepts and writes) are refused, so no bound or timestamp read from a file is NaN or infinite.

    Raises:
        ValueError: not JSON (``json.JSONDecodeError``), or one of those constants.
    """
    return json.loads(text, parse_constant=_no_constant)


def parse_json_object(path: Path, raw: bytes) -> dict:
    """Parse ``raw`` (the bytes of ``path``) as one JSON object.

    Raises:
        Damaged: empty, not UTF-8, not JSON (a torn write shows as this, with
            where the text stops), or JSON that is not an object.
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
        return _raise(path, f"not JSON ({err})")
    if not isinstance(document, dict):
        return _raise(path, f"JSON of the wrong shape (a {type(document).__name__}, not an object)")
    return document


def read_json_object(path: Path, allow_symlink: bool = False) -> dict | None:
    """A JSON object from ``path``; None when the file does not exist.

    Raises:
        Damaged: any other form of damage (see :func:`read_bytes`, :func:`parse_json_object`).
    """
    raw = read_bytes(path, allow_symlink)
    return None if raw is None else parse_json_object(path, raw)


def _raise(path: Path, form: str):
    raise Damaged(path, form)
