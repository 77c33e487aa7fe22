"""Shared fixtures: the checkout copied to a scratch directory, the CLI, and a real systemd user manager."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def run_cli(*args: str, cwd: Path | None = None, program: str = "flatshare", env: dict | None = None,
            timeout: float = 120):
    """Run one of the project's console scripts; returns the CompletedProcess (text). ``timeout`` in seconds
    (a release of real engines takes minutes)."""
    return subprocess.run(
        [str(BIN / program), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=timeout,
    )


FAULTS = Path(__file__).resolve().parent / "faults"


def faults(**spec) -> dict:
    """The environment that makes the node's side fail as ``spec`` says (tests/faults/sitecustomize.py)."""
    import json

    return {"PYTHONPATH": str(FAULTS), "FLATSHARE_TEST_FAULTS": json.dumps(spec)}


def copy_checkout(repo: Path, dest: Path) -> Path:
    """Copy what rendering and releasing read from a checkout (profiles, units, monitoring, the two documents)
    into ``dest``: a scratch checkout for tests and benchmarks to change freely. Returns ``dest``."""
    import shutil

    for name in ("profiles", "units", "monitoring"):
        shutil.copytree(repo / name, dest / name)
    for name in ("README.md", "PRODUCTION.md"):
        shutil.copy2(repo / name, dest / name)
    return dest


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A copy of the checkout's profile, rendered files and documents, to change freely."""
    return copy_checkout(REPO, tmp_path / "checkout")


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under root with its bytes: to prove nothing was written."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="session")
def user_manager(tmp_path_factory):
    """A real ``systemd --user`` manager of its own for the test session; yields its ManagerDirs."""
    from flatshare_ops.sandbox.manager import ManagerDirs, start_manager, stop_manager

    base = tmp_path_factory.mktemp("manager")
    name = f"test-{uuid.uuid4().hex[:8]}"
    dirs = ManagerDirs(name=name, runtime_dir=base / "run", config_dir=base / "config", log=base / "manager.log")
    pid = start_manager(dirs)
    yield dirs
    stop_manager(name, pid)


def loopback_pair(offset: int) -> dict[str, str]:
    """Loopback addresses for a test sandbox, distinct per test process, so that two
    test runs (or a test run beside `make demo`'s 127.0.0.x) never share an address."""
    slot = (os.getpid() * 2 + offset) % 60000
    return {"cyan": f"127.{1 + slot // 250}.{slot % 250}.2", "peacock": f"127.{1 + slot // 250}.{slot % 250}.3"}


TEST_ADDRESSES = loopback_pair(0)


@pytest.fixture(scope="session")
def sandbox(tmp_path_factory):
    """The sandbox fleet, up once for the test session on its own loopback addresses; down at the end.

    Yields the sandbox directory; its inventory is ``DIR/fleet.toml``.
    """
    from flatshare_ops.sandbox.fleet import down, up

    base = tmp_path_factory.mktemp("sandbox")
    try:
        up(base, REPO / "profiles/rtx-5060-ti-serve.toml", TEST_ADDRESSES, echo=lambda _line: None)
        yield base
    finally:
        down(base, echo=lambda _line: None)
