"""Atomic file replacement: a crash leaves the old file or the new, never half.

The dpkg recipe (STYLE.md section 4): write a temporary file in the same
directory, fsync it, rename it over the target, fsync the directory.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomic(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Replace ``path`` with ``data`` atomically.

    Args:
        path: the file to write; its parent directory must exist.
        data: the complete new contents (bytes).
        mode: permission bits of the new file.

    Raises:
        OSError: the directory is not writable or the disk is full; the old
            file (if any) is then left unchanged and no temporary file stays.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
