"""Where a node keeps things and how to reach its systemd manager."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..common.node_files import HISTORY, JOURNAL, LOCK, LOCK_HOLDER, LOG, RELEASES
from ..common.systemd import ManagerAddress


@dataclass(frozen=True)
class NodeContext:
    """One node, as its own side sees it.

    Attributes:
        node: the node's name.
        state_dir: ``/var/lib/flatshare`` (the releases directory is under it).
        address: the node's systemd manager.
    """

    node: str
    state_dir: Path
    address: ManagerAddress

    @property
    def releases(self) -> Path:
        """``STATE_DIR/releases``."""
        return Path(self.state_dir) / RELEASES

    @property
    def journal_path(self) -> Path:
        """``releases/switching.json``."""
        return self.releases / JOURNAL

    @property
    def history_path(self) -> Path:
        """``releases/history.jsonl``."""
        return self.releases / HISTORY

    @property
    def lock_path(self) -> Path:
        """``releases/.lock`` (the fcntl lock itself)."""
        return self.releases / LOCK

    @property
    def holder_path(self) -> Path:
        """``releases/lock.json`` (who holds the lock, for people)."""
        return self.releases / LOCK_HOLDER

    @property
    def log_path(self) -> Path:
        """``releases/release.log``."""
        return self.releases / LOG
