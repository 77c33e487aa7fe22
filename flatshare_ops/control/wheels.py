"""Wheels for a node, built on the operator's machine from the checkout's requirements.lock.

A node needs no compiler and no index: the operator's machine builds every
dependency's wheel with ``pip wheel --require-hashes`` (pystemd has no
wheels on PyPI, so it is compiled here, against this machine's libsystemd),
plus flatshare-ops' own wheel (without the sandbox: :data:`OPERATOR_ONLY`), and writes a node lock naming each
wheel file
with its own sha256. The node installs with ``pip install --no-index
--require-hashes`` from exactly those files. The wheels carry this machine's
platform (Debian release, Python version, architecture): bootstrap refuses a
node whose platform differs.
"""

from __future__ import annotations

import hashlib
import json
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import FlatshareError

CACHE = Path.home() / ".cache" / "flatshare-ops" / "wheels"
#: Subpackages of ``flatshare_ops`` a node's wheel leaves out: the sandbox (the local fleet's managers, sshds and
#: machines, and the stand-in engine, gateway and voice worker) runs on the operator's machine only. The
#: checkout's own install (scripts/setup.sh) keeps them: ``flatshare sandbox`` is the operator's.
OPERATOR_ONLY = ("sandbox",)
#: pip's wheel build may compile (pystemd): bounded, generously (seconds).
BUILD_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class Wheels:
    """A built set of wheels.

    Attributes:
        directory: where the wheel files and ``requirements.node.lock`` are.
        files: the wheel file names.
        platform: ``{"os", "os_version", "python", "machine"}`` they were built for.
    """

    directory: Path
    files: tuple[str, ...]
    platform: dict


def local_platform() -> dict:
    """This machine's Debian release, Python version and architecture (what wheels built here need)."""
    release = {}
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            key, _, value = line.partition("=")
            release[key] = value.strip().strip('"')
    except OSError:
        pass
    return {"os": release.get("ID", "?"), "os_version": release.get("VERSION_ID", "?"),
            "python": f"{sys.version_info[0]}.{sys.version_info[1]}", "machine": platform.machine()}


def project_dir(root: Path) -> Path:
    """The flatshare-ops project to build: the checkout itself, else the project this code runs from.

    Raises:
        FlatshareError: neither has a pyproject.toml (an installed copy cannot build itself).
    """
    for candidate in (Path(root), Path(__file__).resolve().parents[2]):
        if (candidate / "pyproject.toml").is_file() and (candidate / "flatshare_ops").is_dir():
            return candidate
    raise FlatshareError("bootstrap needs a flatshare-ops checkout (pyproject.toml) to build the node's wheels")


def dependencies(root: Path, echo=print) -> Path:
    """The directory of the dependencies' wheels for the checkout's requirements.lock on this platform, built
    once per lock and platform (pystemd compiles: about 30 s on 2 CPUs) and cached in :data:`CACHE`.

    Raises:
        FlatshareError: no lock, or pip failed (its last line is in the message).
    """
    project = project_dir(root)
    lock = project / "requirements.lock"
    if not lock.is_file():
        raise FlatshareError(f"{lock}: not found; the node install needs the dependency lock")
    here = local_platform()
    key = hashlib.sha256(lock.read_bytes() + json.dumps(here, sort_keys=True).encode()).hexdigest()[:24]
    deps = CACHE / f"deps-{key}"
    CACHE.mkdir(parents=True, exist_ok=True)
    if not (deps / ".complete").is_file():
        echo(f"  building the dependencies' wheels from {lock.name} (once per lock and platform; cached in {CACHE})")
        scratch = Path(tempfile.mkdtemp(prefix=".deps.", dir=CACHE))
        try:
            _pip(["wheel", "--require-hashes", "-r", str(lock), "-w", str(scratch)])
            (scratch / ".complete").write_text(json.dumps(here, sort_keys=True) + "\n")
            shutil.rmtree(deps, ignore_errors=True)
            scratch.rename(deps)
        except BaseException:
            shutil.rmtree(scratch, ignore_errors=True)
            raise
    return deps


def build(root: Path, echo=print) -> Wheels:
    """Build the wheels a node installs: the dependencies' (:func:`dependencies`, cached per lock and platform)
    and flatshare-ops' own (built fresh from the checkout each time, a few seconds).

    Raises:
        FlatshareError: no lock, or pip failed (its last line is in the message).
    """
    import os

    deps = dependencies(root, echo)
    target = Path(tempfile.mkdtemp(prefix=".node.", dir=CACHE))
    for wheel in deps.glob("*.whl"):
        os.link(wheel, target / wheel.name)
    try:
        with tempfile.TemporaryDirectory(prefix=".project.", dir=CACHE) as scratch:
            _pip(["wheel", "--no-deps", str(node_project(project_dir(root), Path(scratch))), "-w", str(target)])
    except BaseException:
        shutil.rmtree(target, ignore_errors=True)
        raise
    node_lock = _node_lock(target)
    (target / "requirements.node.lock").write_text(node_lock)
    (target / "requirements.self.lock").write_text(
        "\n".join(row for row in node_lock.splitlines() if row.startswith(("#", "flatshare-ops=="))) + "\n")
    files = tuple(sorted(p.name for p in target.glob("*.whl")))
    return Wheels(target, files, local_platform())


def node_project(project: Path, scratch: Path) -> Path:
    """A copy of ``project`` to build a node's wheel from: its ``pyproject.toml`` and the ``flatshare_ops``
    package without :data:`OPERATOR_ONLY` and without bytecode caches. Built from a copy, the checkout
    gets no ``build/`` directory, whose stale files setuptools would put into the next wheel.

    Returns:
        The copy's directory (under ``scratch``).

    Raises:
        FlatshareError: a file of the project could not be copied (unreadable, a link that loops): the first is
            named.
    """
    copy = scratch / "project"
    copy.mkdir()
    package = project / "flatshare_ops"
    caches = shutil.ignore_patterns("__pycache__", "*.pyc")

    def left_out(directory: str, names: list[str]) -> set[str]:
        skipped = set(caches(directory, names))
        if Path(directory) == package:
            skipped.update(name for name in names if name in OPERATOR_ONLY)
        return skipped

    try:
        shutil.copy2(project / "pyproject.toml", copy / "pyproject.toml")
        shutil.copytree(package, copy / "flatshare_ops", ignore=left_out)
    except shutil.Error as err:  # copytree goes on past each file it cannot copy, then lists them
        source, _copy, why = err.args[0][0]
        raise FlatshareError(f"{source}: cannot be copied to build the node's wheel ({why}); fix it in the checkout "
                             "and run bootstrap again") from None
    except OSError as err:
        raise FlatshareError(f"{err.filename or project}: cannot be copied to build the node's wheel "
                             f"({err.strerror or err}); fix it in the checkout and run bootstrap again") from None
    return copy


def _pip(args: list[str]) -> None:
    try:
        result = subprocess.run([sys.executable, "-m", "pip", *args, "--quiet", "--disable-pip-version-check"],
                                capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise FlatshareError(f"pip {args[0]} did not finish within {BUILD_TIMEOUT_S:g} s") from None
    if result.returncode != 0:
        tail = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise FlatshareError(f"pip {args[0]} failed ({tail})")


def _node_lock(directory: Path) -> str:
    """``name==version --hash=sha256:...`` for each wheel file: what the node installs, by its own bytes."""
    lines = ["# The wheels this node installs, each pinned by its own sha256 (flatshare node bootstrap)."]
    for wheel in sorted(directory.glob("*.whl")):
        found = re.match(r"^([^-]+)-([^-]+)-", wheel.name)
        assert found is not None  # pip's own wheels, named NAME-VERSION-TAGS.whl
        name, version = found.groups()
        sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
        lines.append(f"{name.replace('_', '-').lower()}=={version} --hash=sha256:{sha}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # scripts/setup.sh: build the dependencies' wheels ahead of a first bootstrap
    try:
        dependencies(Path.cwd(), echo=lambda line: print(f"setup: {line.strip()}"))
    except FlatshareError as err:
        raise SystemExit(f"setup: {err}") from None
