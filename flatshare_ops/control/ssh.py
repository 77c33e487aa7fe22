"""The only paramiko user: a node reached over SSH, its host key verified, every wait bounded.

The connection is built from paramiko's Transport so that each phase has its
bound and the host key is checked (:mod:`.known_hosts`, as OpenSSH reads the
file) *before* we authenticate: TCP connect, the SSH banner and key exchange,
authentication and opening a channel each get ``connect_timeout_s``;
keepalives go every ``keepalive_s``; a command's silence is bounded by the
caller (:meth:`Session.lines`). Commands are argv lists joined with
``shlex.join``, so no value reaches the remote shell unquoted.
"""

from __future__ import annotations

import logging
import select
import shlex
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import paramiko

from ..common.text import one_line
from ..errors import TransportError
from . import known_hosts
from .connection import Connection, Lost, Session

# paramiko's transport thread logs its own tracebacks (a banner that never comes, a reset connection);
# every failure reaches the operator as one TransportError line instead.
_paramiko_log = logging.getLogger("paramiko")
_paramiko_log.addHandler(logging.NullHandler())
_paramiko_log.propagate = False


@dataclass(frozen=True)
class SSHTarget:
    """Where and how to reach a node over SSH.

    Attributes:
        node: the node's name (for messages).
        host, port, user: the SSH server.
        known_hosts: the known_hosts file to trust, or None for ``~/.ssh/known_hosts``.
        identity: the private key file, or None for the SSH agent / default keys.
        connect_timeout_s: the bound of each connection phase (seconds).
        keepalive_s: seconds between keepalives.
        jump: the host this one is reached through (an SSH config's ``ProxyJump``: a ``direct-tcpip`` channel
            of that connection is this one's socket), or None to connect directly.
    """

    node: str
    host: str
    port: int
    user: str
    known_hosts: Path | None = None
    identity: Path | None = None
    connect_timeout_s: float = 10.0
    keepalive_s: float = 5.0
    jump: "SSHTarget | None" = None


def open_socket(target: SSHTarget) -> tuple[socket.socket | paramiko.Channel, "SSHConnection | None"]:
    """A socket to ``target``'s SSH server: a TCP connection, or a ``direct-tcpip`` channel of a connection to its
    jump host (itself opened with its host key checked, and returned so that the caller closes it last).

    Raises:
        TransportError: the server or the jump host could not be reached within ``connect_timeout_s``.
    """
    label = known_hosts.host_label(target.host, target.port)
    if target.jump is None:
        try:
            return socket.create_connection((target.host, target.port), timeout=target.connect_timeout_s), None
        except (socket.gaierror, UnicodeError) as err:  # the name did not resolve: nothing was tried, nothing timed out
            # UnicodeError: Python's idna codec refuses the name before any lookup (an empty label, or one over
            # 63 characters), as from an SSH config's HostName the inventory's own check never saw.
            why = err.strerror if isinstance(err, socket.gaierror) else "not a host name: a label is empty or too long"
            raise TransportError(f"{target.node}: the name {one_line(target.host)} does not resolve ({why or err}); "
                                 "check the inventory's host, or its HostName in your SSH config") from None
        except OSError as err:
            raise TransportError(f"{target.node}: cannot reach {label} within {target.connect_timeout_s:g} s "
                                 f"({err.strerror or err})") from None
    jump = SSHConnection(target.jump)
    try:
        channel = jump.transport.open_channel("direct-tcpip", (target.host, target.port), ("127.0.0.1", 0),
                                              timeout=target.connect_timeout_s)
    except (paramiko.SSHException, EOFError, OSError) as err:
        jump.close()
        raise TransportError(f"{target.node}: the jump host {target.jump.host} could not reach {label} within "
                             f"{target.connect_timeout_s:g} s ({err or type(err).__name__})") from None
    return channel, jump


class SSHSession(Session):
    """A node-side command running over one SSH channel."""

    def __init__(self, node: str, transport: paramiko.Transport, channel: paramiko.Channel) -> None:
        self.node, self.transport, self.channel = node, transport, channel

    def send(self, data: bytes) -> None:
        try:
            self.channel.sendall(data)
        except (OSError, EOFError, paramiko.SSHException) as err:
            raise Lost(f"{self.node}: the SSH connection dropped while sending ({err})") from None

    def close_stdin(self) -> None:
        try:
            self.channel.shutdown_write()
        except (OSError, EOFError, paramiko.SSHException):
            pass

    def read(self, timeout_s: float) -> bytes | None:
        if not self.channel.recv_ready():
            ready, _, _ = select.select([self.channel], [], [], max(0.0, timeout_s))
            if not ready and not self.channel.recv_ready():
                if not self.transport.is_active():
                    raise Lost(f"{self.node}: the SSH connection dropped")
                return None
        try:
            data = self.channel.recv(65536)
        except (OSError, EOFError, paramiko.SSHException) as err:
            raise Lost(f"{self.node}: the SSH connection dropped ({err})") from None
        if data == b"" and not self.channel.exit_status_ready() and not self.transport.is_active():
            raise Lost(f"{self.node}: the SSH connection dropped")
        return data

    def exit_status(self, timeout_s: float) -> int | None:
        deadline = time.monotonic() + timeout_s
        while not self.channel.exit_status_ready():
            if time.monotonic() >= deadline or not self.transport.is_active():
                return None
            time.sleep(0.02)
        status = self.channel.recv_exit_status()
        return None if status == -1 else status

    def errors(self) -> bytes:
        chunks = []
        try:
            while self.channel.recv_stderr_ready():
                chunks.append(self.channel.recv_stderr(65536))
        except (OSError, EOFError, paramiko.SSHException):
            pass
        return b"".join(chunks)

    def close(self) -> None:
        try:
            self.channel.close()
        except (OSError, EOFError, paramiko.SSHException):
            pass


def identity_problem(path: Path) -> str | None:
    """Why an identity file cannot be used (``not found``, ``is not a regular file``), or None."""
    path = Path(path)
    return None if path.is_file() else "is not a regular file" if path.exists() else "not found"


def _private_keys(target: SSHTarget) -> list[paramiko.PKey]:
    if target.identity is not None:
        what = identity_problem(target.identity)
        if what:
            raise TransportError(f"{target.node}: identity file {target.identity} {what}; fix the inventory's identity")
        try:
            return [paramiko.PKey.from_path(str(target.identity))]
        except Exception as err:  # paramiko raises several types for an unreadable key
            raise TransportError(f"{target.node}: cannot read identity file {target.identity} ({err})") from None
    keys: list[paramiko.PKey] = list(paramiko.Agent().get_keys())
    for name in ("id_ed25519", "id_ecdsa", "id_rsa"):
        path = Path.home() / ".ssh" / name
        if path.is_file():
            try:
                keys.append(paramiko.PKey.from_path(str(path)))
            except Exception:
                continue
    return keys


class SSHConnection(Connection):
    """One SSH connection to a node, shared by every command of one ``flatshare`` run on it."""

    def __init__(self, target: SSHTarget) -> None:
        self.target = target
        self.node = target.node
        self.jump: SSHConnection | None = None
        self.transport = self._open()
        key = self.transport.get_remote_server_key()  # verified against known_hosts in _open
        self.identity = f"{key.get_name()} {key.get_base64()}"

    def _open(self) -> paramiko.Transport:
        t = self.target
        label = known_hosts.host_label(t.host, t.port)
        known = known_hosts.read(t.known_hosts or Path.home() / ".ssh" / "known_hosts")
        keys = _private_keys(t)
        sock, self.jump = open_socket(t)
        transport = paramiko.Transport(sock)
        transport.banner_timeout = t.connect_timeout_s
        transport.auth_timeout = t.connect_timeout_s
        try:
            try:
                transport.start_client(timeout=t.connect_timeout_s)
                server = transport.get_remote_server_key()  # raises when start_client gave up quietly
            except (paramiko.SSHException, EOFError, OSError) as err:
                raise TransportError(f"{t.node}: no SSH handshake with {label} within {t.connect_timeout_s:g} s "
                                     f"({err or type(err).__name__})") from None
            known_hosts.verify(known, t.node, t.host, t.port, server.get_name(), server.asbytes())
            for key in keys:
                try:
                    transport.auth_publickey(t.user, key)
                    break
                except paramiko.AuthenticationException:
                    continue
                except (paramiko.SSHException, EOFError, OSError) as err:
                    raise TransportError(f"{t.node}: authentication with {label} failed ({err})") from None
            if not transport.is_authenticated():
                raise TransportError(f"{t.node}: {t.user}@{label} refused our key(s); check the inventory's identity "
                                     "and the node's authorized_keys")
            transport.set_keepalive(max(1, int(t.keepalive_s)))
        except BaseException:
            transport.close()
            if self.jump is not None:
                self.jump.close()
            raise
        return transport

    def start(self, argv: list[str], stderr_apart: bool = False) -> SSHSession:
        if not self.transport.is_active():
            raise Lost(f"{self.node}: the SSH connection dropped")
        try:
            channel = self.transport.open_session(timeout=self.target.connect_timeout_s)
            channel.set_combine_stderr(not stderr_apart)
            channel.exec_command(shlex.join(argv))
        except (paramiko.SSHException, EOFError, OSError) as err:
            raise Lost(f"{self.node}: could not start a command over SSH within "
                       f"{self.target.connect_timeout_s:g} s ({err})") from None
        return SSHSession(self.node, self.transport, channel)

    def close(self) -> None:
        self.transport.close()
        if self.jump is not None:
            self.jump.close()
