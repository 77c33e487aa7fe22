"""The operator's SSH config: how a node's ``host`` resolves, as OpenSSH's ``ssh`` would resolve it.

A node's inventory ``host`` may be a name in the operator's ``~/.ssh/config`` (ssh_config(5)), read with
paramiko's own :class:`paramiko.SSHConfig`: its ``HostName``, ``Port``, ``User``, ``IdentityFile`` and
``ProxyJump`` apply, as Ansible, Kamal and pyinfra apply them. What the inventory sets for the node itself
wins (as a command-line option wins over the config in OpenSSH); what neither sets keeps the inventory's
default (port 22, user root). Each hop of a ``ProxyJump`` is resolved the same way and its host key is
checked against the fleet's known_hosts, as the node's is (no hop is trusted on first use).

Which file: ``$FLATSHARE_SSH_CONFIG``, else the inventory's ``[transport] ssh_config`` (relative to the
inventory), else ``~/.ssh/config`` where it exists. ``none`` in either setting reads no file.
"""

from __future__ import annotations

import os
from pathlib import Path

import paramiko

from ..config.inventory import Inventory, Node, resolve
from ..errors import FlatshareError
from .ssh import SSHTarget

#: The environment variable naming the SSH config file (``none``: read none).
CONFIG_VARIABLE = "FLATSHARE_SSH_CONFIG"
#: How many ProxyJump hops a node may sit behind (OpenSSH has no limit; a loop in a config must end).
MAX_HOPS = 8


def config_path(inventory: Path, settings: Inventory) -> Path | None:
    """The SSH config file to read, or None (module docstring: which file)."""
    named = os.environ.get(CONFIG_VARIABLE) or settings.transport.ssh_config
    if named == "none":
        return None
    if named:
        path = Path(named) if os.environ.get(CONFIG_VARIABLE) else resolve(inventory, named)
        if path is None or not path.is_file():
            where = f"${CONFIG_VARIABLE}" if os.environ.get(CONFIG_VARIABLE) else f"{inventory}: transport.ssh_config"
            raise FlatshareError(f"{where}: {named} is not a file; name the SSH config to read (or 'none')")
        return path
    default = Path.home() / ".ssh" / "config"
    return default if default.is_file() else None


def _read(path: Path | None) -> paramiko.SSHConfig | None:
    if path is None:
        return None
    try:
        return paramiko.SSHConfig.from_path(str(path))
    except (OSError, UnicodeDecodeError, paramiko.ConfigParseError) as err:
        raise FlatshareError(f"{path}: cannot read it as an SSH config ({err}); fix it, or read none with "
                             f"{CONFIG_VARIABLE}=none") from None


def _hop(text: str, config: paramiko.SSHConfig | None, template: SSHTarget, label: str) -> SSHTarget:
    """One ProxyJump hop, ``[user@]host[:port]``, resolved through the config as a host of its own."""
    user, _, rest = text.rpartition("@")
    host, _, port = rest.partition(":")
    if rest.startswith("["):  # [v6]:port
        host, _, port = rest[1:].partition("]")
        port = port.lstrip(":")
    found = config.lookup(host) if config is not None else {}
    try:
        port_number = int(port or found.get("port", "22"))
    except ValueError:
        raise FlatshareError(f"{label}: ProxyJump {text!r}: the port is not a number") from None
    identity = (found.get("identityfile") or [None])[0]
    return SSHTarget(f"{template.node} (through {host})", found.get("hostname", host), port_number,
                     user or found.get("user", "root"), template.known_hosts,
                     Path(identity).expanduser() if identity else template.identity,
                     template.connect_timeout_s, template.keepalive_s)


def ssh_target(name: str, node: Node, inventory: Path, settings: Inventory) -> SSHTarget:
    """How to reach node ``name`` over SSH: the inventory's entry with the SSH config applied (module docstring).

    Raises:
        FlatshareError: the config named cannot be read, or its ProxyJump is malformed or too deep.
    """
    t = settings.transport
    explicit = node.model_fields_set
    config = _read(config_path(inventory, settings))
    found = config.lookup(node.host) if config is not None else {}
    identity = resolve(inventory, node.identity)
    if identity is None and found.get("identityfile"):
        identity = Path(found["identityfile"][0]).expanduser()
    try:
        port = node.port if "port" in explicit or "port" not in found else int(found["port"])
    except ValueError:
        raise FlatshareError(f"{config_path(inventory, settings)}: Host {node.host}: Port {found['port']!r} is not "
                             "a number") from None
    target = SSHTarget(name, found.get("hostname", node.host), port,
                       node.user if "user" in explicit or "user" not in found else found["user"],
                       resolve(inventory, node.known_hosts), identity, t.connect_timeout_s, t.keepalive_s)
    jump = found.get("proxyjump")
    if not jump or jump == "none":
        return target
    hops = [h.strip() for h in jump.split(",") if h.strip()]
    if len(hops) > MAX_HOPS:
        raise FlatshareError(f"{name}: ProxyJump {jump!r} has more than {MAX_HOPS} hops")
    before = None
    for hop in hops:  # the first hop is reached directly, each next one through the one before
        before = _replace(_hop(hop, config, target, name), jump=before)
    return _replace(target, jump=before)


def _replace(target: SSHTarget, **changes) -> SSHTarget:
    from dataclasses import replace

    return replace(target, **changes)
