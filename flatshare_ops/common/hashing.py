"""sha256 of files and texts (standard library only: serving-check uses it)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from .files import open_regular


def sha256_file(path: Path) -> str:
    """sha256 (hex) of a regular file's bytes (a link followed), read in 1 MiB blocks.

    Raises:
        NotAFile (an OSError): a directory, a FIFO, a socket or a device is there (never waited on).
        OSError: the file is missing or unreadable.
    """
    digest = hashlib.sha256()
    with os.fdopen(open_regular(path, follow=True), "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def sha256_text(text: str) -> str:
    """sha256 (hex) of a text's UTF-8 bytes."""
    return hashlib.sha256(text.encode()).hexdigest()
