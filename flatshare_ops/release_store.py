"""A node's releases directory: immutable release copies and the ``current`` link.

Layout under the node's state directory (``/var/lib/flatshare`` in production)::

    releases/
      <id>/            one release, never changed once written:
        serving.json   the resolved profile (see releases/README.md)
        units/NAME     the rendered units
        profile.toml   the resolved profile's source, for the record
      current -> <id>  the active release, switched atomically (rename of a new link)

A release id is ``<commit>-<digest>``: the checkout's commit (or tag) and the
first 12 hex digits of a sha256 over the rendered files, so the same render
from the same commit is the same release.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from .atomic import write_atomic
from .node_files import CURRENT, RELEASES


def releases_dir(state_dir: Path) -> Path:
    """``STATE_DIR/releases``."""
    return Path(state_dir) / RELEASES


def release_id(files: dict[str, str], commit: str | None) -> str:
    """The id of a release made of ``files`` (relative name -> text) from ``commit``."""
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(name.encode() + b"\0" + files[name].encode() + b"\0")
    return f"{commit or 'uncommitted'}-{digest.hexdigest()[:12]}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def store_release(state_dir: Path, rid: str, files: dict[str, str]) -> Path:
    """Write release ``rid`` once (a temporary directory renamed into place); returns its directory.

    An existing release directory of that id is left as it is: releases are immutable.
    """
    root = releases_dir(state_dir)
    root.mkdir(parents=True, exist_ok=True)
    target = root / rid
    if target.is_dir():
        return target
    scratch = Path(tempfile.mkdtemp(prefix=f".{rid}.", dir=root))
    scratch.chmod(0o755)
    try:
        for name, text in files.items():
            path = scratch / name
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, text.encode())
        os.rename(scratch, target)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    _fsync_dir(root)
    return target


def current_release(state_dir: Path) -> str | None:
    """The active release's id, or None when the node has none yet."""
    link = releases_dir(state_dir) / CURRENT
    try:
        return os.readlink(link)
    except FileNotFoundError:
        return None


def switch_current(state_dir: Path, rid: str) -> None:
    """Point ``releases/current`` at release ``rid`` atomically (a new link renamed over the old)."""
    root = releases_dir(state_dir)
    if not (root / rid).is_dir():
        raise FileNotFoundError(f"{root / rid}: no such release")
    scratch = root / f".{CURRENT}.{os.getpid()}.tmp"
    scratch.unlink(missing_ok=True)
    os.symlink(rid, scratch)
    os.replace(scratch, root / CURRENT)
    _fsync_dir(root)


def active_serving_json(state_dir: Path) -> Path:
    """Path of the active release's ``serving.json``."""
    return releases_dir(state_dir) / CURRENT / "serving.json"
