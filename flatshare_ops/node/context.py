"""Where a node keeps things and how to reach its systemd manager."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..common.node_files import HISTORY, JOURNAL, LOCK, LOCK_HOLDER, LOG, RELEASES
from ..common.systemd import Manager, ManagerAddress

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing into every node command
if TYPE_CHECKING:
    from typing import Any, Protocol

    class SystemdManager(Protocol):
        """What a node's side asks of its manager: :class:`~flatshare_ops.common.systemd.Manager`'s methods."""

        def properties(self, queries: list[tuple[str, str, str]], timeout_s: float = ...) -> dict[str, Any]: ...
        def job(self, verb: str, unit: str, timeout_s: float, progress=...) -> str: ...
        def reload(self, timeout_s: float = ...) -> None: ...
        def enable(self, units: list[str], timeout_s: float = ...) -> list: ...
        def unit_processes(self, unit: str, timeout_s: float = ...) -> list[tuple[int, str]]: ...


@dataclass(frozen=True)
class NodeContext:
    """One node, as its own side sees it.

    Attributes:
        node: the node's name.
        state_dir: ``/var/lib/flatshare`` (the releases directory is under it).
        address: where the node's systemd manager is.
        manager: what the node's side asks of that manager (every unit property, job, reload and enable goes
            through it): by default :class:`~flatshare_ops.common.systemd.Manager` at ``address``; a test may give
            a recording fake instead (tests/fake_manager.py).
    """

    node: str
    state_dir: Path
    address: ManagerAddress
    manager: SystemdManager = field(default=None, compare=False)  # type: ignore[assignment]  # set in __post_init__

    def __post_init__(self) -> None:
        if self.manager is None:
            object.__setattr__(self, "manager", Manager(self.address))

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
