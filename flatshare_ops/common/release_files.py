"""A stored release's files, read whole and checked against its id (standard library only: serving-check uses it).

A release is named by what it renders: its id is the first 16 hex digits of a
sha256 over its files (``serving.json``, ``profile.json``, ``units/NAME``;
releases/README.md). So whoever reads a stored release (the switch, a
rollback, the admission to drain, serving-check, status) reads all of it and
checks it against its id before using any of it: an edited ``serving.json``
(its drain file pointed at ``history.jsonl``, its gateway at a dead port) is
then damage, named, and never acted on.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
from pathlib import Path

from .files import Damaged, read_bytes

#: What a release's files may be called (the id covers exactly these).
RELEASE_FILE = re.compile(r"^(serving\.json|profile\.json|units/[A-Za-z0-9@._-]+\.(service|target|timer))$")
#: Files a stored release directory holds beside its release files (not covered by the id).
BESIDE = ("switcher",)
#: The most one release file may hold (bytes); rendered ones are a few KiB.
MAX_FILE_BYTES = 1 << 20
#: The most files a release directory may hold (a render has under twenty).
MAX_FILES = 256


def release_id(files: dict[str, str]) -> str:
    """The id of a release made of ``files`` (relative name -> text): a digest of exactly what it renders."""
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(name.encode() + b"\0" + files[name].encode() + b"\0")
    return digest.hexdigest()[:16]


def _entries(directory: Path) -> list[tuple[str, Path]]:
    """(relative name, path) of each entry under the release directory (``units/`` walked), links not followed.

    Raises:
        Damaged: the directory (or ``units``) cannot be listed, or holds too many entries.
    """
    found: list[tuple[str, Path]] = []
    for sub in ("", "units"):
        where = directory / sub if sub else directory
        try:
            names = sorted(os.listdir(where))
        except FileNotFoundError:
            if sub:
                continue
            raise Damaged(directory, "is missing") from None
        except NotADirectoryError:
            if sub:
                continue  # listed above as an entry of its own: named as no file a release holds
            raise Damaged(directory, "is not a directory") from None
        except OSError as err:
            raise Damaged(where, f"cannot be listed ({err.strerror or err})") from None
        for name in names:
            relative = f"{sub}/{name}" if sub else name
            if not sub and name == "units":
                try:
                    if stat.S_ISDIR(os.lstat(where / name).st_mode):
                        continue
                except OSError:
                    pass
            found.append((relative, where / name))
        if len(found) > MAX_FILES:
            raise Damaged(directory, f"holds more than {MAX_FILES} entries, not a release's files")
    return found


def read_release(directory: Path, rid: str, follow_links: bool = False) -> dict[str, str]:
    """Every release file of the release stored at ``directory``, read whole and checked against ``rid``.

    Args:
        directory: ``releases/<id>/`` (or where ``releases/current`` leads).
        rid: the id the files must make.
        follow_links: read a release file through a symlink (serving-check, which only reads: a link to
            the right bytes makes the same id); the switch never follows one.

    Returns:
        relative name -> text.

    Raises:
        Damaged: a file that is not one a release holds, missing (``serving.json``), unreadable, not a
            regular file, larger than :data:`MAX_FILE_BYTES`, not UTF-8, or files that do not make ``rid``
            (truncated, edited, added or removed); ``path`` names the file (or the directory), ``form``
            the damage.
    """
    directory = Path(directory)
    files: dict[str, str] = {}
    for name, path in _entries(directory):
        if name in BESIDE:
            continue
        if not RELEASE_FILE.match(name):
            raise Damaged(path, f"is not a file release {rid} holds (serving.json, profile.json, units/UNIT)")
        raw = read_bytes(path, allow_symlink=follow_links, limit=MAX_FILE_BYTES)
        if raw is None:
            raise Damaged(path, "vanished while read")
        try:
            files[name] = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise Damaged(path, "not UTF-8 text") from None
    if "serving.json" not in files:
        raise Damaged(directory / "serving.json", f"missing from release {rid}")
    digest = release_id(files)
    if digest != rid:
        raise Damaged(directory, f"its files make release {digest}, not {rid} (a file was edited, added or removed)")
    return files
