"""Facts about the checkout a release is made from (git), recorded beside each release."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path


def describe(root: Path) -> str | None:
    """The checkout's tag or short commit (``git describe --tags --always --dirty``), or None outside git.

    The result is made safe for a directory name (letters, digits, ``._-``).
    """
    try:
        result = subprocess.run(
            ["git", "-C", str(root), "describe", "--tags", "--always", "--dirty"],
            capture_output=True, text=True, check=False, timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if result.returncode != 0:
        return None
    return re.sub(r"[^A-Za-z0-9._-]", "_", result.stdout.strip()) or None
