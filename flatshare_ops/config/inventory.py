"""The fleet's inventory: which nodes exist, how to reach them, which profile each runs.

``profiles/fleet.toml`` describes production; ``flatshare sandbox up`` writes
``.sandbox/fleet.toml`` for the local sandbox. A node's systemd scope and
layout come from its profile's ``[layout]`` table, so that they are written once.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, BeforeValidator, Field, ValidationError, model_validator

from ..errors import ProfileError
from ..schema_errors import dotted, ordered, rule, spelled
from .profile import Host, StrictModel, key_lines, read_toml

def _node_name(value: str) -> str:
    if not re.fullmatch(r"[a-z][a-z0-9-]*", value):
        raise ValueError(f"node name {spelled(value)} must be lowercase letters, digits and '-', starting with a "
                         "letter (as cyan or gpu-2); rename the table")
    return value


NodeName = Annotated[str, AfterValidator(_node_name)]


class Node(StrictModel):
    """One node: where its SSH server is and which profile (relative to the inventory) it runs."""

    host: Host
    port: int = Field(default=22, ge=1, le=65535)
    user: Annotated[str, Field(pattern=r"^[a-z_][a-z0-9_-]*$")] = "root"
    profile: Annotated[str, Field(min_length=1)]
    known_hosts: str | None = None
    identity: str | None = None
    scope: Literal["system", "user"] = "system"
    runtime_dir: str | None = None

    @model_validator(mode="after")
    def _user_scope_needs_runtime_dir(self) -> "Node":
        if self.scope == "user" and not self.runtime_dir:
            raise ValueError("scope 'user' needs runtime_dir (the user manager's XDG_RUNTIME_DIR)")
        return self


class Transport(StrictModel):
    """The bounds of every SSH exchange (seconds); docs/release.md ("It never hangs and never lies") says what each does."""

    # At least 0.5 s: a TCP connection and an SSH handshake, on the nearest network.
    connect_timeout_s: float = Field(default=10.0, ge=0.5, le=600)
    keepalive_s: float = Field(default=5.0, ge=1, le=600)
    # At least 2 s: a node's first line comes after sshd's exec and two Python starts (about 0.5 s on an idle
    # node), and a node reports every third of this bound (0.2 s at the least); less could never release.
    silence_s: float = Field(default=30.0, ge=2, le=3600)
    reconnect_s: float = Field(default=30.0, ge=1, le=3600)
    # At least 2 s, for the same starts as silence_s: a node command bounded by less never answers.
    command_timeout_s: float = Field(default=30.0, ge=2, le=3600)
    # The operator's SSH config (control/ssh_config.py), relative to the inventory; "none" reads none.
    ssh_config: Annotated[str, Field(min_length=1)] | None = None


class Monitoring(StrictModel):
    """What the rendered alert rules and dashboard need that no profile holds (PRODUCTION.md, "Monitoring").

    Attributes:
        runbook_url: where operators read PRODUCTION.md (an http(s) URL, no fragment); each alert's
            ``runbook_url`` is this plus its section's anchor. None: the checkout's ``PRODUCTION.md#...``.
    """

    runbook_url: Annotated[str, Field(pattern=r"^https?://[^\s#\"\\]+$")] | None = None


#: A share of the fleet, as Ansible's ``serial: "50%"`` and Kamal's ``boot.limit`` write it.
Share = Annotated[str, Field(pattern=r"^([1-9][0-9]?|100)%$")]


def _count_or_share(low: int, high: int | None):
    """A validator for a field that is a count (``low`` to ``high``) or a share ("1%" to "100%"): one rule in
    the message, never pydantic's per-member errors (whose keys, such as ``constrained-int``, name no key of
    the file)."""

    def check(value):
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ValueError(f"must be a count ({low} or more{'' if high is None else f', at most {high}'}) or a "
                             f"share from \"1%\" to \"100%\", got {spelled(value)}")
        if isinstance(value, str):
            if not re.fullmatch(r"([1-9][0-9]?|100)%", value):
                raise ValueError(f"must be a count or a share from \"1%\" to \"100%\" (a whole number and %), "
                                 f"got {spelled(value)}")
        elif value < low or (high is not None and value > high):
            span = f"of {low} or more" if high is None else f"from {low} to {high}"
            raise ValueError(f"must be a count {span}, or a share such as \"50%\", got {value}")
        return value

    return BeforeValidator(check)


def nodes_of(value: int | str, total: int, round_up: bool) -> int:
    """A count of nodes: ``value`` itself, or its share of ``total`` nodes (``"50%"``), rounded up (a floor that
    must hold: ``min_serving``) or down but at least 1 (a batch, as Ansible rounds ``serial``)."""
    if isinstance(value, int):
        return value
    share = int(value.rstrip("%")) * total
    return -(-share // 100) if round_up else max(1, share // 100)


class Strategy(StrictModel):
    """How a rollout (``release --all``, ``rollback --all``) goes through the fleet.

    Attributes:
        canaries: the first batch: these many nodes switch first and are analysed (the profile's
            ``[release.analysis]``) before any other node switches; 0: no canary, no analysis.
        batch: then batches of this many nodes switch at once (a count, or a share of the fleet: "50%");
            each node of a batch is admitted to drain on its own (adr/0007).
        max_failed: nodes after the canaries whose switch may fail (or roll back by itself) before the rollout
            stops (a canary that fails stops it at once); 0: the
            first failure stops it.
    """

    canaries: int = Field(default=1, ge=0, le=1000)
    batch: Annotated[int | str, _count_or_share(1, 1000)] = 1
    max_failed: int = Field(default=0, ge=0, le=1000)

    def batch_size(self, total: int) -> int:
        """Nodes per batch in a fleet of ``total``."""
        return nodes_of(self.batch, total, round_up=False)


class Inventory(StrictModel):
    """The whole inventory file.

    Attributes:
        known_hosts: the fleet's known_hosts file (relative to the inventory), for nodes that name none;
            ``flatshare node bootstrap --accept-host-key`` adds a new node's key there.
        min_serving: how many nodes must take calls at any moment while releases run (default 1), a count
            or a share of the fleet ("50%", rounded up: :attr:`serving_floor`); at most
            ``len(nodes) - serving_floor`` nodes that take calls are drained at once.
        rollout: the rollout strategy (canaries, batches, failures tolerated).
        transport: the SSH bounds.
        monitoring: what the rendered alert rules link to.
    """

    schema_: int = Field(alias="schema", ge=1, le=1)
    known_hosts: str | None = None
    min_serving: Annotated[int | str, _count_or_share(0, None)] = 1
    rollout: Strategy = Field(default_factory=Strategy)
    transport: Transport = Field(default_factory=Transport)
    monitoring: Monitoring = Field(default_factory=Monitoring)
    nodes: dict[NodeName, Node] = Field(min_length=1)

    @model_validator(mode="after")
    def _nodes_share_the_fleets_known_hosts(self) -> "Inventory":
        # The fleet's committed known_hosts (relative to the inventory) for every node that names none.
        if self.known_hosts:
            for name, node in list(self.nodes.items()):
                if node.known_hosts is None:
                    self.nodes[name] = node.model_copy(update={"known_hosts": self.known_hosts})
        return self

    @model_validator(mode="after")
    def _each_node_once(self) -> "Inventory":
        # The admission counts entries as nodes: one node under two names would count twice.
        seen: dict[tuple[str, int], str] = {}
        for name, node in self.nodes.items():
            where = (node.host.lower(), node.port)
            if where in seen:
                raise ValueError(f"nodes: {name} and {seen[where]} are both {node.host} port {node.port}: list each "
                                 "node once (the admission to drain counts every entry as a node of its own)")
            seen[where] = name
        return self

    @model_validator(mode="after")
    def _a_node_can_be_released(self) -> "Inventory":
        if self.serving_floor >= len(self.nodes):
            raise ValueError(f"min_serving: {self.min_serving} leaves no node that may drain among "
                             f"{len(self.nodes)}; use at most {len(self.nodes) - 1} (0 for a one-node fleet)")
        return self

    @property
    def serving_floor(self) -> int:
        """How many nodes must take calls at any moment: ``min_serving``, a share rounded up."""
        return nodes_of(self.min_serving, len(self.nodes), round_up=True)


def load_inventory(path: Path) -> Inventory:
    """Load and validate an inventory file.

    Raises:
        ProfileError: missing or malformed file, or a schema rule broken
            (``FILE:LINE: KEY: RULE``).
    """
    data, text = read_toml(Path(path), kind="inventory")
    try:
        return Inventory.model_validate(data)
    except ValidationError as err:
        first = ordered(err)[0]
        loc = tuple(first["loc"])
        named = re.match(r"(?:Value error, )?([a-z_]+): ", first["msg"])
        if named and first["type"] == "value_error" and not loc:
            loc = (named.group(1),)  # a rule across keys names the key it is about
            first = {**first, "msg": first["msg"].replace(f"{named.group(1)}: ", "", 1)}
        key = dotted(loc)
        line = key_lines(text).get(key, 0)
        place = f"{path}:{line}" if line else str(path)
        raise ProfileError(f"{place}: {key}: {rule(first)}") from None


def node_profile_path(inventory_path: Path, node: Node) -> Path:
    """The profile file a node runs, resolved against the inventory's directory."""
    return Path(inventory_path).parent / node.profile


DEFAULT_INVENTORY = Path("profiles/fleet.toml")


def inventory_path(option: Path | None) -> Path:
    """The inventory to use: the option, else ``$FLATSHARE_INVENTORY``, else ``profiles/fleet.toml``."""
    import os

    return option or Path(os.environ.get("FLATSHARE_INVENTORY") or DEFAULT_INVENTORY)


def resolve(inventory_path: Path, relative: str | None) -> Path | None:
    """A path from the inventory, resolved against the inventory's directory (None stays None)."""
    return None if relative is None else (Path(inventory_path).parent / relative)
