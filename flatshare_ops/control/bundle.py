"""A node's release as the checkout renders it, ready to ship: ``{"id", "files", "commit"}``."""

from __future__ import annotations

from pathlib import Path

from ..node.store import release_id
from ..render import render_profile
from .git import describe
from .targets import NodeTarget


def bundle(root: Path, target: NodeTarget) -> dict:
    """The release for a node, rendered from the checkout.

    Returns:
        ``{"id": the digest of the files, "files": {name: text}, "commit": git describe or None}``;
        the id says what the release renders, the commit where it was rendered from.
    """
    files = render_profile(target.loaded).release_files()
    return {"id": release_id(files), "files": files, "commit": describe(root)}
