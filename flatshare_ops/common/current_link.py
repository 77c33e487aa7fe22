"""``releases/current``: which release is active, read by one rule on the node and in serving-check (standard library only).

The link is written by the switch alone, as a link to a release's directory
*beside it*: its target is a release id, a plain name (releases/README.md).
Anything else (an absolute path, a path with a ``/``, ``..``, a regular file
or a directory in its place) is damage, and every reader says so in the same
words: the node refuses to switch from it, serving-check does not check a
release it names.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from .node_files import CURRENT

#: What a release id may be: a plain directory name.
RELEASE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class CurrentLinkError(Exception):
    """``releases/current`` is not a link to a release beside it; the message says what it is and what to do."""


def read_current(releases: Path) -> str | None:
    """The active release's id (the name ``releases/current`` points at), or None when there is no link.

    Raises:
        CurrentLinkError: the link is a regular file, a directory or another non-link, or points at anything
            but a release id beside it (an absolute path, a path with ``/``, ``..``).
    """
    link = Path(releases) / CURRENT
    try:
        target = os.readlink(link)
    except FileNotFoundError:
        return None
    except OSError as err:  # EINVAL: not a symlink
        kind = "a directory" if link.is_dir() else "a regular file" if link.is_file() else "not a symlink"
        raise CurrentLinkError(
            f"{link}: is {kind}, not a link to a release ({err.strerror or err}); move it aside "
            f"(mv {link} {link}.bad), then run 'flatshare release' to point it at the checkout's release") from None
    if not RELEASE_ID.match(target) or target in (".", ".."):
        raise CurrentLinkError(
            f"{link}: points at {target!r}, not at a release directory beside it; remove it (rm {link}), "
            "then run 'flatshare release' to point it at the checkout's release")
    return target
