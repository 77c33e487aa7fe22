"""The only pystemd user: talk to a node's systemd manager over D-Bus.

A node's manager is either the system manager (production: the system bus)
or a user manager (the sandbox: its private socket,
``$XDG_RUNTIME_DIR/systemd/private``, spoken to peer-to-peer so no
dbus-daemon is needed). Properties and methods are systemd's documented
D-Bus API, org.freedesktop.systemd1(5).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .errors import FlatshareError


def dbuslib():
    """pystemd's low-level D-Bus module (``pystemd.dbuslib``), imported without
    running pystemd's package ``__init__``.

    That ``__init__`` imports every pystemd submodule, lxml included: about
    20 ms, a quarter of what serving-check may cost (issue 4's budget). The
    package object is created from its spec but not executed; submodules
    (``pystemd.systemd1`` for the CLI's job handling) still import normally.
    """
    if "pystemd" not in sys.modules:
        import importlib.util

        spec = importlib.util.find_spec("pystemd")
        if spec is None:
            raise SystemdError("pystemd is not installed; run scripts/setup.sh")
        sys.modules["pystemd"] = importlib.util.module_from_spec(spec)
    from pystemd import dbuslib as module

    return module


class SystemdError(FlatshareError):
    """The node's systemd manager could not be reached, or refused a request."""

    exit_code = 3


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


class SystemdBus:
    """An open connection to one manager, with its ``JobRemoved`` subscription.

    pystemd keeps only a raw pointer to a signal callback, so the callback
    lives on this object for as long as the connection, and is registered once.
    A connection belongs to one thread (sd-bus is not thread-safe).

    Attributes:
        raw: the pystemd bus object.
    """

    def __init__(self, raw: object) -> None:
        self.raw = raw
        self.job_results: dict[bytes, bytes] = {}
        self._subscribed = False
        self._callback = None

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
    """Open a D-Bus connection to the manager; yields a :class:`SystemdBus`.

    Raises:
        SystemdError: the socket is missing or the connection is refused.
    """
    lib = dbuslib()
    DBus, DBusAddress = lib.DBus, lib.DBusAddress
    try:
        if address.scope == "system":
            raw = DBus()
        else:
            socket = address.private_socket
            if not socket.exists():
                raise SystemdError(f"{socket}: no systemd user manager listens here; is the node up?")
            raw = DBusAddress(f"unix:path={socket}".encode(), peer_to_peer=True)
        raw.open()
    except SystemdError:
        raise
    except Exception as err:  # pystemd's DBusError
        raise SystemdError(f"cannot reach the {address.scope} systemd manager: {err}") from None
    bus = SystemdBus(raw)
    try:
        yield bus
    finally:
        raw.close()


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def manager(bus: SystemdBus):
    """A loaded pystemd ``Manager`` on ``bus``."""
    from pystemd.systemd1 import Manager

    m = Manager(bus=bus.raw)
    m.load()
    return m


def unit(bus: SystemdBus, name: str):
    """A loaded pystemd ``Unit`` named ``name`` on ``bus`` (systemd loads it on demand)."""
    from pystemd.systemd1 import Unit

    u = Unit(name.encode(), bus=bus.raw)
    u.load()
    return u


def daemon_reload(bus: SystemdBus) -> None:
    """Make the manager re-read every unit file (``systemctl daemon-reload``)."""
    manager(bus).Manager.Reload()


def exec_start_argv(bus: SystemdBus, name: str) -> list[list[str]]:
    """The argv of each command of a service's ``ExecStart=``, as systemd parsed it.

    Returns:
        One argv (list of str) per command; systemd's ``ExecStart`` property
        is ``a(sasbttttuii)``: path, argv, ignore-failure, timestamps, pid, status.
    """
    return [[_text(arg) for arg in entry[1]] for entry in unit(bus, name).Service.ExecStart]


def _unit_path(name: str) -> bytes:
    return dbuslib().path_encode(b"/org/freedesktop/systemd1/unit", name.encode())


def unit_property(bus: SystemdBus, name: str, interface: str, prop: str) -> object:
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


class JobFailed(SystemdError):
    """A systemd job ended with a result other than ``done``."""

    exit_code = 1


def run_job(bus: SystemdBus, verb: str, name: str, timeout_s: float, mode: str = "replace") -> str:
    """Queue a job on a unit and wait for systemd's ``JobRemoved`` signal for it.

    Args:
        bus: an open connection (from :func:`connect`).
        verb: ``"start"``, ``"stop"`` or ``"restart"`` (``StartUnit``, ``StopUnit``, ``RestartUnit``).
        name: the unit's name.
        timeout_s: how long to wait, in seconds.
        mode: the job mode (``replace``, ``fail``...).

    Returns:
        ``"done"``. That means started, not ready: readiness is the service's
        own health endpoint.

    Raises:
        JobFailed: the result was ``failed``, ``timeout``, ``canceled``,
            ``dependency`` or ``skipped``, or no signal came within ``timeout_s``.

    Source: org.freedesktop.systemd1(5), ``JobRemoved(u id, o job, s unit, s result)``;
    a client must call ``Subscribe()`` to get the manager's signals.
    """
    import select
    import time as _time

    bus.watch_jobs()
    m = manager(bus)
    method = {"start": m.Manager.StartUnit, "stop": m.Manager.StopUnit, "restart": m.Manager.RestartUnit}[verb]
    job = method(name.encode(), mode.encode())
    deadline = _time.monotonic() + timeout_s
    fd = bus.raw.get_fd()
    while job not in bus.job_results:
        remaining = deadline - _time.monotonic()
        if remaining <= 0:
            raise JobFailed(f"{name}: {verb} job {job.decode()} did not finish within {timeout_s:g} s")
        # Wait in select(), which releases the GIL (pystemd's sd_bus_wait holds it
        # and would freeze every other thread of the process), then dispatch
        # whatever arrived; a dispatched signal returns an empty message, so
        # process a bounded batch rather than "until empty".
        select.select([fd], [], [], min(remaining, 0.2))
        for _ in range(64):
            bus.raw.process()
            if job in bus.job_results:
                break
    result = bus.job_results.pop(job).decode()
    if result != "done":
        raise JobFailed(f"{name}: {verb} job ended '{result}'; see the unit's status and log")
    return result
