"""The only paramiko user: reach a node over SSH with its host key checked.

Host keys are verified against the inventory's ``known_hosts`` file (or the
operator's ``~/.ssh/known_hosts``) with paramiko's ``RejectPolicy``: an
unknown or changed host key is refused, never added. Commands are given as
argv lists and joined with ``shlex.join``, so no value is spliced into the
remote shell unquoted.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

import paramiko

from .errors import FlatshareError


class RemoteError(FlatshareError):
    """A node could not be reached, or refused us, over SSH."""

    exit_code = 3


@dataclass(frozen=True)
class SSHTarget:
    """Where and how to reach a node over SSH.

    Attributes:
        node: the node's name (for messages).
        host, port, user: the SSH server.
        known_hosts: the known_hosts file to trust, or None for ``~/.ssh/known_hosts``.
        identity: the private key file, or None for the SSH agent / default keys.
    """

    node: str
    host: str
    port: int
    user: str
    known_hosts: Path | None = None
    identity: Path | None = None


@dataclass(frozen=True)
class CommandResult:
    """What a remote command did: exit status and its whole output (text)."""

    status: int
    stdout: str
    stderr: str


def _host_label(target: SSHTarget) -> str:
    return target.host if target.port == 22 else f"[{target.host}]:{target.port}"


def open_ssh(target: SSHTarget, timeout_s: float = 10.0) -> paramiko.SSHClient:
    """Connect to a node, verifying its host key.

    Args:
        target: the node's SSH details.
        timeout_s: TCP and authentication timeout, in seconds.

    Returns:
        A connected paramiko ``SSHClient`` (the caller closes it).

    Raises:
        RemoteError: unknown or changed host key, authentication refused, or
            the node unreachable; the message says which and what to do.
    """
    client = paramiko.SSHClient()
    known = target.known_hosts or Path.home() / ".ssh" / "known_hosts"
    try:
        client.load_host_keys(str(known))
    except FileNotFoundError:
        raise RemoteError(f"{target.node}: known_hosts file {known} not found; add the node's host key first") from None
    except (OSError, UnicodeDecodeError, paramiko.SSHException) as err:
        raise RemoteError(f"{target.node}: known_hosts file {known} is unreadable ({err}); fix or restore it") from None
    if target.identity is not None and not Path(target.identity).is_file():
        raise RemoteError(f"{target.node}: identity file {target.identity} not found; fix the inventory's identity")
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    label = _host_label(target)
    try:
        client.connect(
            target.host,
            port=target.port,
            username=target.user,
            key_filename=str(target.identity) if target.identity else None,
            allow_agent=target.identity is None,
            look_for_keys=target.identity is None,
            timeout=timeout_s,
            banner_timeout=timeout_s,
            auth_timeout=timeout_s,
        )
    except paramiko.BadHostKeyException:
        client.close()
        raise RemoteError(
            f"{target.node}: host key of {label} does not match {known}; refusing to connect. "
            "If the node was reinstalled, verify its new key out of band and update known_hosts"
        ) from None
    except paramiko.AuthenticationException as err:
        client.close()
        raise RemoteError(f"{target.node}: {target.user}@{label} refused our key: {err}") from None
    except paramiko.SSHException as err:
        client.close()
        if "not found in known_hosts" in str(err):
            raise RemoteError(
                f"{target.node}: {label} is not in {known}; refusing an unknown host key "
                "(add it with ssh-keyscan after checking its fingerprint)"
            ) from None
        raise RemoteError(f"{target.node}: SSH to {label} failed: {err}") from None
    except OSError as err:
        client.close()
        raise RemoteError(f"{target.node}: cannot reach {label}: {err.strerror or err}") from None
    return client


def run(client: paramiko.SSHClient, argv: list[str], timeout_s: float | None = None) -> CommandResult:
    """Run ``argv`` on the node (quoted with ``shlex.join``) and collect its output.

    Returns:
        A :class:`CommandResult`.
    """
    _, stdout, stderr = client.exec_command(shlex.join(argv), timeout=timeout_s)
    out = stdout.read().decode(errors="replace")
    err = stderr.read().decode(errors="replace")
    return CommandResult(stdout.channel.recv_exit_status(), out, err)
