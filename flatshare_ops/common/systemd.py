"""The only pystemd user: talk to a node's systemd manager over D-Bus, every exchange bounded.

A node's manager is either the system manager (production: the system bus,
``$DBUS_SYSTEM_BUS_ADDRESS`` or ``/run/dbus/system_bus_socket``) or a user
manager (the sandbox: its private socket ``$XDG_RUNTIME_DIR/systemd/private``,
spoken to peer-to-peer). Properties and methods are systemd's documented
D-Bus API, org.freedesktop.systemd1(5) (docs/reference/systemd.md).

Why a child process: pystemd's calls take no timeout and hold the GIL, and
sd-bus allows a slow peer 25 s per call and 90 s for its handshake, so no
Python timer can bound them. Every exchange the tool makes
(:func:`properties`, :func:`reload`, :func:`job`, :func:`unit_path`) runs in
a forked child that the parent kills at the deadline; the message that
reports it names the bound. The low-level helpers (:func:`connect`,
:func:`unit_property`, :func:`run_job`...) run inside that child, and tests
use them directly.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

from . import poll
from ..errors import Exit, SystemdError

#: The default bound of one exchange with the manager (seconds).
SYSTEMD_TIMEOUT_S = 5.0


def dbuslib():
    """pystemd's low-level D-Bus module (``pystemd.dbuslib``), imported without
    running pystemd's package ``__init__``.

    That ``__init__`` imports every pystemd submodule, lxml included: about
    20 ms, a quarter of what serving-check may cost (adr/0006-serving-check-cost.md).
    The package object is created from its spec but not executed; submodules
    (``pystemd.systemd1`` for the job handling) still import normally.
    """
    if "pystemd" not in sys.modules:
        import importlib.util

        spec = importlib.util.find_spec("pystemd")
        if spec is None:
            raise SystemdError("pystemd is not installed; run scripts/setup.sh")
        sys.modules["pystemd"] = importlib.util.module_from_spec(spec)
    from pystemd import dbuslib as module

    return module


class ManagerAddress:
    """How to reach one node's systemd manager.

    Attributes:
        scope: ``"system"`` (the system bus) or ``"user"`` (a user manager's private socket).
        runtime_dir: the user manager's ``XDG_RUNTIME_DIR`` (only for scope ``user``).
    """

    # A plain class: serving-check imports this module every minute, and
    # dataclasses would pull in inspect (about 5 ms).
    __slots__ = ("scope", "runtime_dir")

    def __init__(self, scope: str, runtime_dir: Path | None = None) -> None:
        self.scope, self.runtime_dir = scope, runtime_dir

    @property
    def private_socket(self) -> Path:
        """The user manager's private D-Bus socket, ``$XDG_RUNTIME_DIR/systemd/private``."""
        if self.runtime_dir is None:
            raise SystemdError("a user-scope manager needs its runtime directory")
        return Path(self.runtime_dir) / "systemd" / "private"

    def describe(self) -> str:
        """Where the manager is, for messages."""
        if self.scope == "system":
            return f"the system manager (bus {os.environ.get('DBUS_SYSTEM_BUS_ADDRESS', '/run/dbus/system_bus_socket')})"
        return f"the user manager at {self.private_socket}"


class SystemdBus:
    """An open connection to one manager, with its ``JobRemoved`` subscription.

    pystemd keeps only a raw pointer to a signal callback, so the callback
    lives on this object for as long as the connection, and is registered once.

    Attributes:
        raw: the pystemd bus object.
    """

    def __init__(self, raw: Any) -> None:  # pystemd has no types
        self.raw = raw
        self.job_results: dict[bytes, bytes] = {}
        self._subscribed = False
        self._callback: Callable[..., None] | None = None

    def watch_jobs(self) -> None:
        """Subscribe to the manager's signals and record every ``JobRemoved`` (once per connection)."""
        if self._subscribed:
            return

        def on_job_removed(msg, error=None, userdata=None):
            msg.process_reply(False)
            _job_id, job_path, _unit, result = msg.body
            self.job_results[job_path] = result

        self._callback = on_job_removed  # keep it alive: pystemd holds only a raw pointer
        self.raw.match_signal(None, _MANAGER_PATH, _MANAGER_IFACE, b"JobRemoved", on_job_removed)
        manager(self).Manager.Subscribe()
        self._subscribed = True


_MANAGER_PATH = b"/org/freedesktop/systemd1"
_MANAGER_IFACE = b"org.freedesktop.systemd1.Manager"


@contextmanager
def connect(address: ManagerAddress) -> Iterator[SystemdBus]:
    """Open a D-Bus connection to the manager; yields a :class:`SystemdBus`. Unbounded: use it in a child.

    Raises:
        SystemdError: the socket is missing or the connection is refused.
    """
    lib = dbuslib()
    try:
        if address.scope == "system":
            raw = lib.DBus()
        else:
            socket = address.private_socket
            if not socket.exists():
                raise SystemdError(f"{socket}: no systemd user manager listens here; is the node up?")
            raw = lib.DBusAddress(f"unix:path={socket}".encode(), peer_to_peer=True)
        raw.open()
    except SystemdError:
        raise
    except Exception as err:  # pystemd's DBusError
        raise SystemdError(f"cannot reach {address.describe()}: {dbus_words(err)}") from None
    bus = SystemdBus(raw)
    try:
        yield bus
    finally:
        raw.close()


def dbus_words(err: BaseException) -> str:
    """One line for an error from the bus: for pystemd's ``DBusBaseError`` (``errno``, ``err_name``,
    ``err_message``), the manager's own message and the error's name (``NoSuchUnit``, ``AccessDenied``) or,
    for an error pystemd has no name for, its errno (``EIO``), never pystemd's text around them; anything else
    as ``Type: message``."""
    import errno as errnos

    message = getattr(err, "err_message", None)
    if message is None:
        return " ".join(f"{type(err).__name__}: {err}".split())
    message = message.decode(errors="replace") if isinstance(message, bytes) else str(message)
    name = getattr(err, "err_name", "") or ""
    name = name.decode(errors="replace") if isinstance(name, bytes) else str(name)
    number = getattr(err, "errno", None)
    if not name and type(err).__name__ not in ("DBusBaseError", "DBusError"):  # pystemd's class per error name
        name = type(err).__name__.removeprefix("DBus").removesuffix("Error")
    if not name and isinstance(number, int) and number:
        name = errnos.errorcode.get(abs(number), f"errno {abs(number)}")
    words = " ".join(message.split()) or "no message"
    return f"{words} ({name})" if name else words


def manager(bus: SystemdBus):
    """A loaded pystemd ``Manager`` on ``bus``."""
    from pystemd.systemd1 import Manager

    m = Manager(bus=bus.raw)
    m.load()
    return m


def daemon_reload(bus: SystemdBus) -> None:
    """Make the manager re-read every unit file (``systemctl daemon-reload``)."""
    manager(bus).Manager.Reload()


def _unit_path(name: str) -> bytes:
    return dbuslib().path_encode(b"/org/freedesktop/systemd1/unit", name.encode())


def unit_property(bus: SystemdBus, name: str, interface: str, prop: str) -> Any:
    """One property of a unit, e.g. ``("Unit", "ActiveState")`` or ``("Service", "MainPID")``.

    Read with ``org.freedesktop.DBus.Properties.Get`` on the unit's object path
    (systemd loads the unit on demand), without pystemd's introspection.
    Strings come back as bytes, as pystemd returns them.
    """
    apply_signature = dbuslib().apply_signature
    return bus.raw.call_method(
        b"org.freedesktop.systemd1", _unit_path(name), b"org.freedesktop.DBus.Properties", b"Get",
        apply_signature(b"ss", [f"org.freedesktop.systemd1.{interface}".encode(), prop.encode()]),
    ).body


def manager_property(bus: SystemdBus, prop: str) -> Any:
    """One property of the manager itself (``UnitPath``, ``Version``...)."""
    apply_signature = dbuslib().apply_signature
    return bus.raw.call_method(
        b"org.freedesktop.systemd1", _MANAGER_PATH, b"org.freedesktop.DBus.Properties", b"Get",
        apply_signature(b"ss", [_MANAGER_IFACE, prop.encode()]),
    ).body


def exec_start_argv(bus: SystemdBus, name: str) -> list[list[str]]:
    """The argv of each command of a service's ``ExecStart=``, as systemd parsed it.

    systemd's ``ExecStart`` property is ``a(sasbttttuii)``: path, argv, ignore-failure,
    timestamps, pid, status.
    """
    from pystemd.systemd1 import Unit

    u = Unit(name.encode(), bus=bus.raw)
    u.load()
    return [[cast(str, _text(arg)) for arg in entry[1]] for entry in u.Service.ExecStart]  # as: bytes, read as text


class JobFailed(SystemdError):
    """A systemd job ended with a result other than ``done``, or did not end in time."""

    exit_code = Exit.FAILED


def run_job(bus: SystemdBus, verb: str, name: str, timeout_s: float, mode: str = "replace") -> str:
    """Queue a job on a unit and wait for systemd's ``JobRemoved`` signal for it. Use it in a child.

    Args:
        bus: an open connection (from :func:`connect`).
        verb: ``"start"``, ``"stop"``, ``"restart"`` or ``"reload-or-restart"``.
        name: the unit's name.
        timeout_s: how long to wait, in seconds.
        mode: the job mode (``replace``, ``fail``...).

    Returns:
        ``"done"``. That means started, not ready: readiness is the service's
        own health endpoint. Stopping a unit systemd does not know is done at once.

    Raises:
        JobFailed: the result was ``failed``, ``timeout``, ``canceled``,
            ``dependency`` or ``skipped``, or no signal came within ``timeout_s``.

    Source: org.freedesktop.systemd1(5), ``JobRemoved(u id, o job, s unit, s result)``;
    a client must call ``Subscribe()`` to get the manager's signals.
    """
    if verb == "stop" and unit_property(bus, name, "Unit", "LoadState") == b"not-found":
        return "done"  # no such unit (a node's first release): nothing to stop
    bus.watch_jobs()
    m = manager(bus)
    method = {"start": m.Manager.StartUnit, "stop": m.Manager.StopUnit, "restart": m.Manager.RestartUnit,
              "reload-or-restart": m.Manager.ReloadOrRestartUnit}[verb]
    job = method(name.encode(), mode.encode())
    deadline = time.monotonic() + timeout_s
    fd = bus.raw.get_fd()
    while job not in bus.job_results:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise JobFailed(f"{name}: {verb} job {job.decode()} did not finish within {timeout_s:g} s")
        # Wait in select(), which releases the GIL, then dispatch whatever
        # arrived; a dispatched signal returns an empty message, so process a
        # bounded batch rather than "until empty".
        select.select([fd], [], [], min(remaining, 0.2))
        for _ in range(64):
            bus.raw.process()
            if job in bus.job_results:
                break
    result = bus.job_results.pop(job).decode()
    if result != "done":
        raise JobFailed(f"{name}: {verb} job ended '{result}'; see the unit's status and log")
    return result


def _text(value: object) -> object:
    if isinstance(value, bytes):
        try:
            return value.decode()
        except UnicodeDecodeError:
            return value.hex()  # a byte array such as InvocationID (ay): hex is its usual spelling
    if isinstance(value, (list, tuple)):
        return [_text(v) for v in value]
    if isinstance(value, dict):
        return {_text(k): _text(v) for k, v in value.items()}
    return value


# --- bounded exchanges: each in a forked child the parent kills at the deadline ----------------


def _in_child(address: ManagerAddress, work, timeout_s: float, what: str, progress=None, wrappers: bool = True):
    """Run ``work(bus)`` in a forked child connected to the manager; return its JSON-able result.

    Args:
        wrappers: ``work`` uses pystemd's Manager wrapper (jobs, reload): import it here first.

    Raises:
        SystemdError: no answer within ``timeout_s`` (the child is killed), or the
            manager could not be reached; JobFailed: a job's result was not ``done``.
    """
    # Import in the parent: a child must not need the import lock another thread may hold.
    dbuslib()
    if wrappers:
        import pystemd.systemd1  # noqa: F401  (lxml: only when the Manager wrapper is needed)

    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the parent's code
        status = 0
        try:
            os.close(read_fd)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            try:
                with connect(address) as bus:
                    answer = {"ok": _text(work(bus))}
            except JobFailed as err:
                answer = {"job_failed": str(err)}
            except SystemdError as err:
                answer = {"error": str(err)}
            except Exception as err:  # pystemd's DBusError and anything else: the manager's answer (one line)
                answer = {"error": dbus_words(err)}
            try:
                data = json.dumps(answer).encode()
            except (TypeError, ValueError) as err:
                data = json.dumps({"error": f"the answer to {what} could not be encoded ({err})"}).encode()
            while data:
                data = data[os.write(write_fd, data):]
        except BaseException:
            status = 1
        finally:
            os._exit(status)
    os.close(write_fd)
    chunks: list[bytes] = []
    started = time.monotonic()
    deadline = started + timeout_s
    next_progress = started + poll.progress_every()
    try:
        while True:
            now = time.monotonic()
            if progress is not None and now >= next_progress:
                progress(now - started)
                next_progress = now + poll.progress_every()
            # Past the deadline only what is already in the pipe is read: a caller that was itself stopped
            # (SIGSTOP, a paused VM) while the child answered finds the answer there, and is not told "no answer".
            wait = max(0.0, min(deadline - now, max(0.0, next_progress - now), 1.0))
            ready, _, _ = select.select([read_fd], [], [], wait)
            if ready:
                chunk = os.read(read_fd, 65536)
                if not chunk:
                    break
                chunks.append(chunk)
            elif time.monotonic() >= deadline:
                raise SystemdError(f"no answer from {address.describe()} within {timeout_s:g} s ({what})")
    finally:
        os.close(read_fd)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(pid, 0)
    try:
        answer = json.loads(b"".join(chunks))
    except ValueError:
        raise SystemdError(f"the systemd query for {what} ended without an answer") from None
    if "job_failed" in answer:
        raise JobFailed(answer["job_failed"])
    if "error" in answer:
        raise SystemdError(answer["error"])
    return answer["ok"]


def properties(address: ManagerAddress, queries: list[tuple[str, str, str]],
               timeout_s: float = SYSTEMD_TIMEOUT_S) -> dict[str, Any]:
    """Read unit properties in one bounded exchange.

    Args:
        queries: ``(unit, interface, property)`` triples, e.g. ``("flatshare-engine.service", "Service", "MainPID")``;
            a unit of ``""`` asks the manager itself (``("", "Manager", "UnitPath")``).
        timeout_s: the bound, in seconds.

    Returns:
        ``"unit/property"`` -> value (strings decoded; lists of strings as lists; ``"/UnitPath"`` for the manager's).

    Raises:
        SystemdError: the manager could not be reached or did not answer within ``timeout_s``.
    """
    def work(bus):
        return {f"{u}/{p}": unit_property(bus, u, i, p) if u else manager_property(bus, p) for u, i, p in queries}

    return _in_child(address, work, timeout_s, "unit properties", wrappers=False)


def unit_path(address: ManagerAddress, timeout_s: float = SYSTEMD_TIMEOUT_S) -> list[str]:
    """The directories the manager reads units and drop-ins from, in priority order (its ``UnitPath``).

    Raises:
        SystemdError: no answer within ``timeout_s``.
    """
    return _in_child(address, lambda bus: manager_property(bus, "UnitPath"), timeout_s, "UnitPath", wrappers=False)


def control_group_processes(group: str) -> list[tuple[int, str]]:
    """The processes the kernel has in control group ``group`` (a unit's ``ControlGroup``, e.g.
    ``/system.slice/flatshare-engine.service``) or a group below it, from each ``/proc/PID/cgroup``
    (cgroups(7)): ``[(pid, command line), ...]``; none for ``""`` (a unit with no control group)."""
    if not group or group == "/":
        return []
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            paths = [line.split(":", 2)[2] for line in (proc / "cgroup").read_text().splitlines() if line.count(":") >= 2]
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue  # gone meanwhile
        if any(path == group or path.startswith(group + "/") for path in paths):
            found.append((int(proc.name), cmdline))
    return found


def unit_processes(address: ManagerAddress, unit: str, timeout_s: float = SYSTEMD_TIMEOUT_S) -> list[tuple[int, str]]:
    """The processes in a unit's control group: none once it stopped.

    Asked of systemd (``GetUnitProcesses``, org.freedesktop.systemd1(5): ``a(sus)``, control group path, pid,
    command line); where that call fails (systemd 252 in a Debian machine answered a stopped engine's with EIO),
    from the kernel: every process whose ``/proc/PID/cgroup`` names the unit's ``ControlGroup`` (or a group below
    it), none when it has no control group.

    Returns:
        ``[(pid, command line), ...]``; empty for a unit that runs nothing or is not loaded.

    Raises:
        SystemdError: no answer within ``timeout_s``.
    """
    def work(bus):
        apply_signature = dbuslib().apply_signature
        try:
            found = bus.raw.call_method(b"org.freedesktop.systemd1", _MANAGER_PATH, _MANAGER_IFACE,
                                        b"GetUnitProcesses", apply_signature(b"s", [unit.encode()])).body
        except Exception:  # noqa: BLE001 - pystemd's DBusError: not loaded (it runs nothing), or the EIO above
            return control_group_processes(str(_text(unit_property(bus, unit, "Service", "ControlGroup")) or ""))
        return [(int(pid), str(_text(cmdline))) for _cgroup, pid, cmdline in found]

    return _in_child(address, work, timeout_s, f"processes of {unit}", wrappers=False)


def reload(address: ManagerAddress, timeout_s: float = 60.0) -> None:
    """``daemon-reload``, bounded.

    Raises:
        SystemdError: no answer within ``timeout_s``.
    """
    _in_child(address, lambda bus: daemon_reload(bus), timeout_s, "daemon-reload")


def job(address: ManagerAddress, verb: str, unit: str, timeout_s: float, progress=None) -> str:
    """Run one job (start, stop, restart, reload-or-restart) and wait for its ``JobRemoved``, bounded.

    Args:
        timeout_s: the job's bound in seconds; the exchange gets 10 s more for the connection.
        progress: called with the seconds waited so far, every :func:`common.poll.progress_every` (10 s by default).

    Returns:
        ``"done"``.

    Raises:
        JobFailed: the job ended otherwise, or not within ``timeout_s``.
        SystemdError: the manager did not answer.
    """
    return _in_child(address, lambda bus: run_job(bus, verb, unit, timeout_s), timeout_s + 10,
                     f"{verb} {unit}", progress)


def enable(address: ManagerAddress, units: list[str], timeout_s: float = 30.0) -> list:
    """``systemctl enable`` over D-Bus (``EnableUnitFiles``, then a reload); returns the changes made.

    Raises:
        SystemdError: no answer within ``timeout_s``.
    """
    def work(bus):
        m = manager(bus)
        _carries, changes = m.Manager.EnableUnitFiles([u.encode() for u in units], False, True)
        if changes:
            daemon_reload(bus)
        return [[_text(c) for c in change] for change in changes]

    return _in_child(address, work, timeout_s, f"enable {' '.join(units)}")


class Manager:
    """One node's systemd manager as the node's side acts on it: the calls above, bound to its address.

    This is the seam between a node's logic and systemd (node/context.py ``NodeContext.manager``): the node's
    modules call only these methods, so that a test can give a node a recording fake of its manager (tests/
    fake_manager.py) and run the node's logic in its own process, as a real manager's tests run it through D-Bus.

    Attributes:
        address: where the manager is (:class:`ManagerAddress`).
    """

    __slots__ = ("address",)

    def __init__(self, address: ManagerAddress) -> None:
        self.address = address

    def properties(self, queries: list[tuple[str, str, str]], timeout_s: float = SYSTEMD_TIMEOUT_S) -> dict[str, Any]:
        """:func:`properties` of this manager."""
        return properties(self.address, queries, timeout_s)

    def job(self, verb: str, unit: str, timeout_s: float, progress=None) -> str:
        """:func:`job` on this manager."""
        return job(self.address, verb, unit, timeout_s, progress)

    def reload(self, timeout_s: float = 60.0) -> None:
        """:func:`reload` of this manager."""
        reload(self.address, timeout_s)

    def enable(self, units: list[str], timeout_s: float = 30.0) -> list:
        """:func:`enable` on this manager."""
        return enable(self.address, units, timeout_s)

    def unit_processes(self, unit: str, timeout_s: float = SYSTEMD_TIMEOUT_S) -> list[tuple[int, str]]:
        """:func:`unit_processes` of this manager."""
        return unit_processes(self.address, unit, timeout_s)
