"""sha256 of files and texts (standard library only: serving-check uses it)."""

from __future__ import annotations

import hashlib
from pathlib import Path


def sha256_file(path: Path) -> str:
    """sha256 (hex) of a file's bytes, read in 1 MiB blocks.

    Raises:
        OSError: the file is missing or unreadable.
    """
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def sha256_text(text: str) -> str:
    """sha256 (hex) of a text's UTF-8 bytes."""
    return hashlib.sha256(text.encode()).hexdigest()
