"""A fake node connection (pyinfra's ``fake`` connector's idea): it records the commands it is given and
answers as a script says, so that the rollout's decisions are tested in milliseconds, without hosts.
Never instead of the sandbox tests: beside them."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from flatshare_ops.config.inventory import Inventory, Node
from flatshare_ops.control.commands import NodeSpec
from flatshare_ops.control.connection import Connection, Lost, Session
from flatshare_ops.errors import TransportError


class FakeSession(Session):
    """Plays back output chunks; ``None`` in the script is a silent second, ``Lost`` raises, and so does any
    exception instance (an operator's Ctrl-C arriving while the switch runs: ``OperatorInterrupted``)."""

    def __init__(self, node: str, script: list, status: int | None, answers: list) -> None:
        self.node, self.script, self.status, self.answers = node, list(script), status, answers

    def send(self, data: bytes) -> None:
        self.answers.append(data.decode())

    def close_stdin(self) -> None:
        pass

    def read(self, timeout_s: float) -> bytes | None:
        if not self.script:
            return b""
        item = self.script.pop(0)
        if item is None:
            time.sleep(timeout_s)  # a silent stretch, as long as the reader waits
            return None
        if item is Lost:
            raise Lost(f"{self.node}: the SSH connection dropped")
        if isinstance(item, BaseException):
            raise item
        return item

    def exit_status(self, timeout_s: float) -> int | None:
        return self.status

    def close(self) -> None:
        pass


@dataclass
class FakeNode:
    """What one fake node answers.

    Attributes:
        probe: its answer to ``probe`` (does it take calls, is it locked).
        switch_script: output chunks of its ``switch`` (bytes; ``None`` = silence; ``Lost``).
        switch_status: the exit status its ``switch`` ends with (None: ended without one).
        status_answers: successive answers to ``status --switch`` (the last repeats).
        reachable: False makes every connect fail.
        commands: every argv it was given.
        stdin: everything sent to its switch.
        other_output: what any other command prints (its exit status 0).
        identity: its connection's identity (an SSH host key; None: the transport has none).
    """

    probe: dict = field(default_factory=lambda: {"takes_calls": True, "locked": False, "problems": [],
                                                  "holder": None})
    switch_script: list = field(default_factory=list)
    switch_status: int | None = 0
    status_answers: list = field(default_factory=lambda: [{"state": "unknown"}])
    reachable: bool = True
    commands: list = field(default_factory=list)
    stdin: list = field(default_factory=list)
    other_output: bytes = b"{}"
    identity: str | None = None


class FakeConnection(Connection):
    def __init__(self, name: str, node: FakeNode) -> None:
        self.node_name, self.fake = name, node
        self.node = name
        self.identity = node.identity

    def start(self, argv: list[str], stderr_apart: bool = False) -> Session:
        self.fake.commands.append(argv)
        command = argv[1]
        if command == "switch":
            return FakeSession(self.node_name, self.fake.switch_script, self.fake.switch_status, self.fake.stdin)
        if command == "probe":
            output = json.dumps(self.fake.probe).encode()
        elif command == "status":
            answers = self.fake.status_answers
            output = json.dumps(answers.pop(0) if len(answers) > 1 else answers[0]).encode()
        else:
            output = self.fake.other_output
        return FakeSession(self.node_name, [output], 0, [])


class FakeTarget:
    """What the rollout needs of a node target, backed by a :class:`FakeNode`."""

    def __init__(self, name: str, node: FakeNode, settings: Inventory) -> None:
        self.name, self.fake, self.settings = name, node, settings
        self.node = settings.nodes[name]
        self.result = None
        self.local = False
        self.spec = NodeSpec(name, ("flatshare-node",), "/var/lib/flatshare", "system", None, "serving-check")

    def names_itself(self, url: str) -> bool:
        from flatshare_ops.control.targets import names_node

        return names_node(url, self.node.host)

    def connect(self) -> Connection:
        if not self.fake.reachable:
            raise TransportError(f"{self.name}: cannot reach {self.name} within 1 s (fake)")
        return FakeConnection(self.name, self.fake)


def fleet(rollout: dict | None = None, min_serving: int = 1, **nodes: FakeNode) -> list[FakeTarget]:
    """Fake targets for the named nodes (each reached at its name as host), with short transport bounds (and the
    inventory's ``rollout`` table and ``min_serving``)."""
    settings = Inventory.model_validate({
        "schema": 1, "transport": {"silence_s": 2, "reconnect_s": 2, "connect_timeout_s": 1, "command_timeout_s": 2},
        "nodes": {name: Node(host=name, profile="p.toml") for name in nodes}, "min_serving": min_serving,
        **({"rollout": rollout} if rollout else {})})
    return [FakeTarget(name, node, settings) for name, node in nodes.items()]
