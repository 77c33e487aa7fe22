"""Pruning a node's release store: remove what no rollback can need, and kept switchers no release names.

Kept (node/history.py's rollback rule decides what a rollback can need): the
active release, its rollback target, the newest :data:`KEEP_RELEASES`
releases that served, and an interrupted switch's releases. Pruning runs after
a switch is done; when it fails the switch is still done (it says so).
"""

from __future__ import annotations

import os
import time

from ..common.files import Damaged, read_bytes
from . import history as histories, journal as journals
from .context import NodeContext
from .store import current_release, is_stored, remove_release, stored_releases

#: How many releases that served a node keeps (besides the active one and a rollback's target).
KEEP_RELEASES = 5


def prune(ctx: NodeContext, hist: histories.History, keep: int = KEEP_RELEASES) -> list[str]:
    """Remove stored releases no rollback can need; returns their ids.

    Kept: the active release, its rollback target, the newest ``keep`` releases that
    served, and an interrupted switch's target.
    """
    current = current_release(ctx.state_dir)
    served = histories.served_releases(hist)
    if len(served) < 2:
        return []  # the history knows too little (lost, or new): every stored release may be a rollback's target
    target = histories.rollback_target(hist, current, lambda r: is_stored(ctx.state_dir, r))
    keep_ids = {current, target, *served[:keep]}
    pending = journals.read_journal(ctx.state_dir, ctx.node)
    if pending is not None:
        keep_ids |= {pending.to, pending.from_}
    removed = []
    for rid in stored_releases(ctx.state_dir):
        if rid not in keep_ids:
            remove_release(ctx.state_dir, rid)
            removed.append(rid)
    _prune_switchers(ctx)
    return removed


def _prune_switchers(ctx: NodeContext) -> None:
    """Remove kept switchers no stored release names and unused for an hour (and bundles an
    interrupted entry left behind)."""
    from ..common.files import remove_tree

    wanted = {os.environ.get("FLATSHARE_SWITCHER")}
    for rid in stored_releases(ctx.state_dir):
        try:  # a note beside the release (not covered by its id): read bounded, never blocking
            wanted.add((read_bytes(ctx.releases / rid / "switcher", limit=4096) or b"").decode("ascii").strip())
        except (Damaged, UnicodeDecodeError):
            continue
    for directory in (ctx.releases / ".switchers").glob("*"):
        try:
            # Unpacked in the last hour: a release on this node may be starting from it right now.
            recent = time.time() - directory.stat().st_mtime < 3600
        except OSError:
            continue
        if directory.name not in wanted and not recent:
            remove_tree(directory)
    for leftover in (ctx.releases / ".incoming").glob("bundle.*.json"):
        try:
            if time.time() - leftover.stat().st_mtime > 3600:
                leftover.unlink()
        except OSError:
            continue
