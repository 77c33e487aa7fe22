"""A node's releases directory: immutable release copies and the ``current`` link.

Layout under the node's state directory (``/var/lib/flatshare`` in production)::

    releases/
      <id>/            one release, never changed once written:
        serving.json   what serving-check and the switch read (releases/README.md)
        profile.json   the resolved profile, for the record
        units/NAME     the rendered units
      current -> <id>  the active release, switched atomically (rename of a new link)

A release id is the first 16 hex digits of a sha256 over the release's
files: a release is what it renders, so a commit that changes no rendered
file (documentation, an unrelated edit) is the same release, and "nothing to
do". The commit a release was made from is recorded beside it (in the
history record and the lock holder), not in the id.
"""

from __future__ import annotations

import os
import re
import stat
import shutil
import tempfile
from pathlib import Path

from ..common import durable
from ..common.files import what_is
from ..common.node_files import CURRENT, RELEASES
from ..common.release_files import release_id  # noqa: F401  (the id's one definition; node and tests use it here)
from ..errors import NodeStateError, Refused

from ..common.current_link import RELEASE_ID, CurrentLinkError, read_current  # noqa: F401 (RELEASE_ID: node/bundle.py)
#: What release_id makes (and so the name of every release this node stored): 16 hex digits.
RELEASE_DIGEST = re.compile(r"^[0-9a-f]{16}$")


def releases_dir(state_dir: Path) -> Path:
    """``STATE_DIR/releases``."""
    return Path(state_dir) / RELEASES


def unwritable(err: OSError) -> str | None:
    """Why ``err`` means the state directory takes no writes (a read-only filesystem, its permissions: no
    damage), as words after the directory's name; None for any other failure."""
    import errno
    import getpass

    if err.errno == errno.EROFS:
        return "is on a read-only filesystem (EROFS)"
    if err.errno in (errno.EACCES, errno.EPERM):
        return f"is not writable by {getpass.getuser()} ({errno.errorcode[err.errno]}: {err.strerror})"
    return None


def ensure_releases_dir(state_dir: Path) -> Path:
    """``STATE_DIR/releases``, made when missing.

    Raises:
        Refused: it cannot be made because the state directory takes no writes (a read-only filesystem, its
            permissions): no damage, and nothing was changed.
        NodeStateError: something other than a directory is there (a file, a FIFO, a link...), or it cannot be
            made otherwise: named, with what to do.
    """
    root = releases_dir(state_dir)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        pass
    except OSError as err:
        what = unwritable(err)
        if what is not None:
            raise Refused(f"refused: the state directory {state_dir} {what}: {root} cannot be made, and nothing "
                          "was changed; make it writable (remount it read-write, or fix its permissions), then "
                          "run the command again") from None
        raise NodeStateError(f"{root}: cannot be made ({err.strerror or err}); fix the state directory "
                             f"{state_dir}, then run the command again") from None
    try:
        mode = os.lstat(root).st_mode
    except OSError as err:
        raise NodeStateError(f"{root}: cannot be read ({err.strerror or err})") from None
    if not stat.S_ISDIR(mode):
        raise NodeStateError(f"{root}: is {what_is(mode)}, not the node's releases directory; move it aside "
                             f"(mv {root} {root}.bad) and run the command again")
    return root


def store_release(state_dir: Path, rid: str, files: dict[str, str], replace: bool = False) -> Path:
    """Write release ``rid`` once (a temporary directory renamed into place); returns its directory.

    An existing release directory of that id is left as it is (releases are immutable), unless
    ``replace``: a stored copy found damaged is swapped for a whole new one (the old moved aside,
    then removed).

    Raises:
        OSError: the disk is full or read-only; no partial release directory stays.
    """
    root = ensure_releases_dir(state_dir)
    target = root / rid
    if target.is_dir() and not target.is_symlink() and not replace:
        return target
    scratch = Path(tempfile.mkdtemp(prefix=f".{rid}.", dir=root))
    try:
        scratch.chmod(0o755)
        for name, text in files.items():
            path = scratch / name
            path.parent.mkdir(parents=True, exist_ok=True)
            durable.write_atomic(path, text.encode())
        if target.exists() or target.is_symlink():
            aside = root / f".damaged-{rid}-{os.getpid()}"
            durable.rename(target, aside)
            shutil.rmtree(aside, ignore_errors=True)
        durable.rename(scratch, target)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    return target


def is_stored(state_dir: Path, rid: str) -> bool:
    """Whether release ``rid``'s directory is on the node (a real directory, not a link)."""
    path = releases_dir(state_dir) / rid
    return bool(RELEASE_ID.match(rid)) and path.is_dir() and not path.is_symlink()


def current_release(state_dir: Path) -> str | None:
    """The active release's id, or None when the node has none yet (common/current_link.py's rule, which
    serving-check reads by too).

    Raises:
        NodeStateError: ``releases/current`` is not a symlink to a release id
            (a regular file, a directory, a link to a path); the message says how to fix it.
    """
    try:
        return read_current(releases_dir(state_dir))
    except CurrentLinkError as err:
        raise NodeStateError(str(err)) from None


def switch_current(state_dir: Path, rid: str) -> None:
    """Point ``releases/current`` at release ``rid`` atomically (a new link renamed over the old).

    Raises:
        FileNotFoundError: no such release stored; OSError: the write failed.
    """
    root = releases_dir(state_dir)
    if not is_stored(state_dir, rid):
        raise FileNotFoundError(f"{root / rid}: no such release")
    durable.replace_symlink(root / CURRENT, rid)


def stored_releases(state_dir: Path) -> list[str]:
    """The ids of every release directory on the node: directories named as release_id names them (16 hex
    digits), so that nothing else there (a node file that became a directory: damage named where it is read)
    is ever taken for a release, or pruned as one."""
    root = releases_dir(state_dir)
    try:
        entries = sorted(root.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [p.name for p in entries if RELEASE_DIGEST.match(p.name) and is_stored(state_dir, p.name)]


def remove_release(state_dir: Path, rid: str) -> None:
    """Remove a stored release directory (pruning)."""
    shutil.rmtree(releases_dir(state_dir) / rid)
