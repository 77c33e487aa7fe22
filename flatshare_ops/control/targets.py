"""The nodes a command acts on, from the inventory, and how each is reached: decided once, here.

A node named with ``--node`` or ``--all`` is reached over SSH; without them,
the command acts on the node it runs on (``FLATSHARE_NODE`` or the host
name), reached as a child process (:mod:`.local`). Either way the same
node-side commands run (:mod:`.commands`).
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from ..common.text import one_line
from ..config.inventory import Inventory, Node, load_inventory, node_profile_path, resolve
from ..errors import FlatshareError
from .commands import NodeSpec
from .connection import Connection


def names_node(url: str, host: str) -> bool:
    """Whether ``url`` names the node the inventory reaches at ``host``: the URL's host is ``host`` or one of its
    addresses (both resolved as SSH resolves them: ``127.95.3`` is 127.95.0.3), or only loopback addresses
    while ``host`` has none (the node's own loopback, as the probe on the node asks it). A loopback address of
    another node of a fleet on one machine (the sandbox's 127.x nodes) is not this node's.
    """
    import ipaddress
    import socket
    from urllib.parse import urlsplit

    def addresses(name: str) -> set[str]:
        try:
            return {str(info[4][0]) for info in socket.getaddrinfo(name, None)}
        except (OSError, UnicodeError, ValueError):
            return set()

    def loopback(address: str) -> bool:
        try:
            return ipaddress.ip_address(address.split("%")[0]).is_loopback
        except ValueError:
            return False

    try:
        named = (urlsplit(url).hostname or "").lower().rstrip(".")  # DNS names are case-blind; a root dot is the same name
    except ValueError:
        return False
    mine = host.strip("[]").lower().rstrip(".")
    if not named:
        return False
    if named == mine:
        return True
    theirs, ours = addresses(named), addresses(mine)
    if theirs & ours:
        return True
    return bool(theirs) and all(loopback(a) for a in theirs) and not any(loopback(a) for a in ours)


@dataclass
class NodeTarget:
    """One node as the operator's side sees it.

    Attributes:
        name: the node's name.
        node: its inventory entry.
        inventory: the inventory file (paths in it are relative to it).
        settings: the whole inventory (transport bounds, min_serving).
        local: True when it is this machine (reached as a child process, not over SSH).
        result: the exit code of what was done to it in this command (None: not started).
    """

    name: str
    node: Node
    inventory: Path
    settings: Inventory
    local: bool = False
    result: int | None = field(default=None)

    @property
    def profile_path(self) -> Path:
        """The profile file the node runs."""
        return node_profile_path(self.inventory, self.node)

    def names_itself(self, url: str) -> bool:
        """Whether ``url`` (a gateway URL in the node's profile or probe answer) names this node
        (:func:`names_node`)."""
        try:
            host = self.ssh_target.host  # the HostName the operator's SSH config gives an alias
        except FlatshareError:
            host = self.node.host
        return names_node(url, host)

    @cached_property
    def loaded(self):
        """The node's profile, loaded once."""
        from ..config.profile import load_profile

        return load_profile(self.profile_path)

    @cached_property
    def spec(self) -> NodeSpec:
        """How to run the node's side there (:mod:`.commands`).

        Raises:
            ProfileError: the node's profile does not load.
            FlatshareError: the inventory's scope for the node is not its profile's ``layout.scope``.
        """
        profile = self.loaded.profile
        if profile.layout.scope != self.node.scope:
            raise FlatshareError(
                f"{self.inventory}: nodes.{self.name}.scope is {self.node.scope!r} but its profile "
                f"{self.profile_path} has layout.scope {profile.layout.scope!r}; make them agree")
        check = profile.check.command[0]
        if self.local:
            program: tuple[str, ...] = (sys.executable, "-m", "flatshare_ops.node")
        else:
            program = (str(Path(check).parent / "flatshare-node"),)
        runtime = resolve(self.inventory, self.node.runtime_dir)
        return NodeSpec(self.name, program, profile.layout.state_dir, self.node.scope,
                        str(runtime.resolve()) if runtime else None, check)

    def connect(self) -> Connection:
        """Open the connection to the node (bounded; host key checked over SSH).

        Raises:
            TransportError: the node could not be reached (the message names the bound or the cause).
        """
        if self.local:
            from .local import LocalConnection

            return LocalConnection(self.name)
        from .ssh import SSHConnection

        return SSHConnection(self.ssh_target)

    @cached_property
    def ssh_target(self):
        """How the node is reached over SSH: its inventory entry with the operator's SSH config applied
        (:func:`.ssh_config.ssh_target`)."""
        from .ssh_config import ssh_target

        return ssh_target(self.name, self.node, self.inventory, self.settings)


def this_node() -> str:
    """The node this command runs on: ``$FLATSHARE_NODE``, else the short host name."""
    return os.environ.get("FLATSHARE_NODE") or socket.gethostname().split(".")[0]


def targets(inventory_file: Path, names: list[str], all_nodes: bool) -> list[NodeTarget]:
    """The nodes to act on, in inventory order; without names, the node this command runs on.

    Raises:
        FlatshareError: an unknown node name, ``--all`` with names, or (without names)
            this machine is not in the inventory.
    """
    inventory = load_inventory(inventory_file)
    if all_nodes and names:
        raise FlatshareError("give --node NAME... or --all, not both")
    if any(not n for n in names):
        raise FlatshareError("--node needs a node name")
    if all_nodes or names:
        unknown = [n for n in names if n not in inventory.nodes]
        if unknown:
            raise FlatshareError(f"{inventory_file}: no node {', '.join(one_line(n) for n in unknown)}; known nodes: "
                                 f"{', '.join(inventory.nodes)}")
        chosen = list(inventory.nodes) if all_nodes else [n for n in inventory.nodes if n in names]
        return [NodeTarget(n, inventory.nodes[n], inventory_file, inventory) for n in chosen]
    here = this_node()
    if here not in inventory.nodes:
        raise FlatshareError(
            f"this machine ({one_line(here)}) is not a node of {inventory_file}; pass --node NAME or --all "
            "(or set FLATSHARE_NODE)"
        )
    return [NodeTarget(here, inventory.nodes[here], inventory_file, inventory, local=True)]


def every_node(inventory_file: Path, chosen: list[NodeTarget]) -> list[NodeTarget]:
    """Every node of the inventory; the chosen ones are the same objects (so results are shared)."""
    by_name = {t.name: t for t in chosen}
    return [by_name.get(t.name, t) for t in targets(inventory_file, [], True)]
