"""Start and stop a sandbox node's own systemd user manager.

Recipe (seen working on this kind of machine): move the process into a
cgroup of its own in each mounted hierarchy, enter a private mount
namespace (``unshare -m``) in which ``/run/systemd/system`` exists (a tmpfs
over ``/run/systemd``, so ``sd_booted()`` holds), and run
``systemd --user`` with the node's own ``XDG_RUNTIME_DIR`` and
``XDG_CONFIG_HOME``. Its unit directory is then
``$XDG_CONFIG_HOME/systemd/user`` and its private D-Bus socket
``$XDG_RUNTIME_DIR/systemd/private``.
"""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ..common.poll import poll_until
from ..common.proc import pid_alive
from ..errors import FlatshareError

SYSTEMD = "/lib/systemd/systemd"
CGROUP_ROOT = Path("/sys/fs/cgroup")
# The longest path a Unix socket can be bound at: sun_path holds 108 bytes (unix(7)) and systemd keeps one for
# the terminating NUL (sockaddr_un_set_path()). A longer one is not refused loudly: the manager runs without its
# private socket, and the first `systemctl --user` (dbus.socket's ExecStartPost) falls back to the session bus,
# which nobody serves yet, and hangs until the socket unit's start times out (90 s).
SOCKET_PATH_MAX = 107

# Runs inside the new mount namespace, then becomes the manager.
_INNER = (
    "mount -t tmpfs -o mode=0755 tmpfs /run/systemd && mkdir -p /run/systemd/system && "
    f"exec {SYSTEMD} --user --log-target=console --log-level=notice"
)


class SandboxError(FlatshareError):
    """The sandbox could not be brought up or down (exit 1; 2 for bad input such as a corrupt state file)."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True)
class ManagerDirs:
    """A sandbox manager's directories.

    Attributes:
        name: the node's name (also its cgroup's name).
        runtime_dir: ``XDG_RUNTIME_DIR``.
        config_dir: ``XDG_CONFIG_HOME``; units go in ``config_dir/systemd/user``.
        log: the manager's own console log.
    """

    name: str
    runtime_dir: Path
    config_dir: Path
    log: Path

    @property
    def unit_dir(self) -> Path:
        """Where the user manager reads unit files."""
        return self.config_dir / "systemd" / "user"

    @property
    def private_socket(self) -> Path:
        """The manager's private D-Bus socket."""
        return self.runtime_dir / "systemd" / "private"

    @property
    def sockets(self) -> list[Path]:
        """The Unix sockets the manager binds under its runtime directory: private, notify and the bus."""
        return [self.private_socket, self.runtime_dir / "systemd" / "notify", self.runtime_dir / "bus"]


def refuse_long_socket_paths(dirs: ManagerDirs) -> None:
    """Refuse a runtime directory whose sockets could not be bound (longer than :data:`SOCKET_PATH_MAX` bytes).

    Raises:
        SandboxError (exit 2): one line naming the longest such path, its length and the way out.
    """
    longest = max(dirs.sockets, key=lambda path: len(os.fsencode(path)))
    size = len(os.fsencode(longest))
    if size > SOCKET_PATH_MAX:
        raise SandboxError(
            f"{longest}: {size} bytes, longer than a Unix socket's path can be ({SOCKET_PATH_MAX} bytes, unix(7)): "
            f"{dirs.name}'s systemd could not open its sockets there; give the sandbox a directory "
            f"{size - SOCKET_PATH_MAX} or more bytes shorter (--dir)", exit_code=2)


def _cgroup_dirs(name: str) -> list[Path]:
    return [
        CGROUP_ROOT / hierarchy / f"flatshare-{name}"
        for hierarchy in ("systemd", "unified")
        if (CGROUP_ROOT / hierarchy / "cgroup.procs").exists()
    ]


def _enter_cgroups(name: str) -> None:
    for directory in _cgroup_dirs(name):
        directory.mkdir(exist_ok=True)
        (directory / "cgroup.procs").write_text(str(os.getpid()))


def start_manager(dirs: ManagerDirs, extra_env: dict[str, str] | None = None, timeout_s: float = 90.0) -> int:
    """Start the node's user manager and wait until its private socket answers.

    Args:
        dirs: the node's directories (created if missing).
        extra_env: variables the manager passes on to its services (a node's own bus address).
        timeout_s: how long to wait for the socket, in seconds: 90, as a manager started while two real
            engines start on this machine's 2 CPUs (load 14) once took more than 30 s to open it.

    Returns:
        The manager's process id.

    Raises:
        SandboxError: the runtime directory is too deep for its sockets (exit 2), or the manager exited or
            its socket did not appear in time.
    """
    refuse_long_socket_paths(dirs)
    # A manager of this node still running whose pid the caller lost (state.json damaged, or written before the
    # manager's pid was) would run the node's units a second time beside the new one: what runs in the node's
    # cgroups is stopped first (its manager by SIGTERM, as a shutdown would).
    left = [pid for directory in _cgroup_dirs(dirs.name) if directory.exists() for pid in _cgroup_pids(directory)]
    if left:
        stop_manager(dirs.name, next((pid for pid in left if _is_user_manager(pid)), None))
    try:
        for directory in (dirs.runtime_dir, dirs.unit_dir):
            directory.mkdir(parents=True, exist_ok=True)
        os.chmod(dirs.runtime_dir, 0o700)
        # A socket left by an earlier manager would look like this one being ready.
        dirs.private_socket.unlink(missing_ok=True)
        Path("/run/systemd").mkdir(exist_ok=True)
    except OSError as err:
        raise SandboxError(f"{dirs.name}: cannot prepare its manager's directories: {err.filename or dirs.runtime_dir}: "
                           f"{err.strerror or err}; make it writable (or bring the sandbox down and up again)") from None
    # No generator runs: this machine's user generators (gpg-agent's environment, XDG autostart) make nothing a
    # node's units use, and the manager runs them at its start and at every daemon-reload, which a switch does:
    # two thirds of a manager's CPU over a start and ten reloads (bench/manager_reload_cost.py). systemd reads
    # these two variables in place of its generator directories (docs/reference/systemd.md, "Generators").
    nothing = dirs.config_dir / "no-generators"
    try:
        nothing.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise SandboxError(f"{dirs.name}: cannot make {nothing}: {err.strerror or err}") from None
    env = {
        "SYSTEMD_GENERATOR_PATH": str(nothing),
        "SYSTEMD_ENVIRONMENT_GENERATOR_PATH": str(nothing),
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": os.environ.get("HOME", "/root"),
        "LANG": "C.UTF-8",
        "USER": "root",
        "XDG_RUNTIME_DIR": str(dirs.runtime_dir),
        "XDG_CONFIG_HOME": str(dirs.config_dir),
        **(extra_env or {}),
    }
    log = open(dirs.log, "ab")
    process = subprocess.Popen(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", _INNER],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=log,
        start_new_session=True,
        preexec_fn=lambda: _enter_cgroups(dirs.name),
    )
    log.close()
    if poll_until(lambda: process.poll() is not None or dirs.private_socket.exists(), timeout_s):
        if process.poll() is None:
            return process.pid
        raise SandboxError(f"{dirs.name}: systemd --user exited with {process.returncode}; see {dirs.log}")
    process.kill()
    stop_manager(dirs.name, None, timeout_s=5.0)  # what the stuck start left in its cgroups
    raise SandboxError(f"{dirs.name}: systemd --user did not open {dirs.private_socket} in {timeout_s:g} s; "
                       f"see {dirs.log}")


def stop_manager(name: str, pid: int | None, timeout_s: float = 30.0) -> None:
    """Stop a user manager and everything it started.

    Args:
        name: the manager's name (its cgroups are ``flatshare-NAME``).
        pid: the manager's process id, already checked to be that manager; None
            to only sweep the cgroups.
        timeout_s: how long to let it stop its units, in seconds.

    SIGTERM makes a user manager start ``exit.target``, stopping its units
    (systemd(1), "SIGNALS"); whatever is left in the node's cgroups after
    ``timeout_s`` seconds is killed.
    """
    if pid is not None and pid > 1:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        poll_until(lambda: not pid_alive(pid), timeout_s)
    for directory in _cgroup_dirs(name):
        poll_until(lambda: _kill_all(_cgroup_pids(directory)), 2.5)
        _remove_cgroup(directory)


def _is_user_manager(pid: int) -> bool:
    """Process ``pid`` runs ``systemd --user`` (its command line, proc(5))."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return len(argv) > 1 and os.path.basename(argv[0]) == b"systemd" and argv[1] == b"--user"


def _kill_all(pids: list[int]) -> bool:
    """SIGKILL every process listed; True when there were none left."""
    for leftover in pids:
        if leftover > 1:
            try:
                os.kill(leftover, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return not pids


def _remove_cgroup(directory: Path) -> None:
    """Remove an emptied cgroup directory and its children, deepest first (rmdir is how cgroups go away)."""
    children = sorted((p for p in directory.glob("**/") if p != directory), key=lambda p: len(p.parts), reverse=True)
    for child in [*children, directory]:
        try:
            child.rmdir()
        except OSError:
            pass  # still busy, or already gone


def _cgroup_pids(directory: Path) -> list[int]:
    pids = []
    for procs in [directory / "cgroup.procs", *directory.glob("**/cgroup.procs")]:
        try:
            pids += [int(p) for p in procs.read_text().split()]
        except OSError:
            continue
    return sorted(set(pids))
