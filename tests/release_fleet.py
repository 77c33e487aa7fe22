"""A sandbox fleet for release tests: a scratch checkout and both nodes, with helpers that read the truth
(systemd over D-Bus, files on disk, /proc) rather than what the tool prints."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import threading
import uuid
from contextlib import contextmanager
from pathlib import Path

from conftest import run_cli, scratch_sandbox
from flatshare_ops.check.run import run_checks
from flatshare_ops.control.bundle import bundle
from flatshare_ops.control.targets import targets
from flatshare_ops.sandbox.fleet import SandboxNode
from flatshare_ops.common.systemd import ManagerAddress, connect, unit_property

ENGINE = "flatshare-engine.service"
GATEWAY = "flatshare-gateway.service"
VOICE = "flatshare-voice.service"
HOLD_FLAG = "--additional-config.make_room.decode_hold_tokens"


class Fleet:
    """The release tests' checkout and sandbox."""

    #: How long one of the tool's commands may take (seconds): the real engine's tier raises it.
    cli_timeout_s = 120.0

    def __init__(self, checkout: Path, base: Path, addresses: dict[str, str]) -> None:
        self.checkout, self.base, self.addresses = checkout, base, addresses
        self.inventory = base / "fleet.toml"

    def node(self, name: str) -> SandboxNode:
        return SandboxNode(name, self.addresses[name], self.base)

    def address(self, name: str) -> ManagerAddress:
        return ManagerAddress("user", self.node(name).manager.runtime_dir)

    def release(self, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
        return run_cli("release", "--inventory", str(self.inventory), "--root", str(self.checkout), *args, env=env,
                       timeout=self.cli_timeout_s)

    def rollback(self, *args: str) -> subprocess.CompletedProcess:
        return run_cli("rollback", "--inventory", str(self.inventory), "--root", str(self.checkout), *args,
                       timeout=self.cli_timeout_s)

    def local_release(self, name: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
        """`flatshare release` as run on the node itself (no --node)."""
        return self.release(*args, env={"FLATSHARE_NODE": name, **(env or {})})

    def set_hold(self, value: int) -> None:
        result = run_cli("profiles", "set", "engine.make_room.decode_hold_tokens", str(value), "--root", str(self.checkout))
        assert result.returncode == 0, result.stderr

    def expected_id(self, name: str) -> str:
        (target,) = targets(self.inventory, [name], False)
        return bundle(self.checkout, target)["id"]

    def current(self, name: str) -> str:
        return os.readlink(self.node(name).state_dir / "releases/current")

    def engine(self, name: str) -> tuple[list[str], bytes]:
        """(the engine's argv from /proc, its InvocationID)."""
        with connect(self.address(name)) as bus:
            pid = unit_property(bus, ENGINE, "Service", "MainPID")
            invocation = unit_property(bus, ENGINE, "Unit", "InvocationID")
        argv = [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1]]
        return argv, invocation

    def hold(self, name: str) -> str:
        argv = self.engine(name)[0]
        return argv[argv.index(HOLD_FLAG) + 1]

    def history(self, name: str) -> list[dict]:
        path = self.node(name).state_dir / "releases/history.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def journal(self, name: str) -> Path:
        return self.node(name).state_dir / "releases/switching.json"

    def drain_file(self, name: str) -> Path:
        return self.node(name).run_dir / "voice.drain"

    def check_ok(self, name: str) -> None:
        report = run_checks(self.node(name).state_dir, name, self.node(name).manager.runtime_dir)
        assert report.status == "OK", [(f.check, f.status, f.summary, f.details) for f in report.findings]

    def settled(self, name: str) -> None:
        """The node as every test must leave it."""
        assert not self.journal(name).exists()
        assert not self.drain_file(name).exists()
        self.check_ok(name)


    @contextmanager
    def node_profile(self, name: str, values: dict):
        """The node's own profile with ``values`` ({"engine.max_model_len": 4096}) set, restored byte for byte
        after (tomlkit: the rest of the file is kept as written)."""
        import tomlkit

        path = self.node(name).profile
        saved = path.read_bytes()
        doc = tomlkit.parse(saved.decode())
        for dotted, value in values.items():
            table = doc
            *parents, leaf = dotted.split(".")
            for part in parents:
                table = table.setdefault(part, tomlkit.table())
            table[leaf] = value
        path.write_text(tomlkit.dumps(doc))
        try:
            yield
        finally:
            path.write_bytes(saved)

    def invocations(self, name: str) -> dict[str, bytes]:
        """Each managed service's InvocationID (it changes at every start)."""
        with connect(self.address(name)) as bus:
            return {u: unit_property(bus, u, "Unit", "InvocationID") for u in (ENGINE, GATEWAY, VOICE)}


class Switched(subprocess.CompletedProcess):
    """What a node-side switch did: its exit code, its lines for people (stdout; protocol lines apart), its
    stderr, the outcome it sent last (None when it sent none) and the admission answers it was given."""

    def __init__(self, args, returncode, stdout, stderr, outcome=None, admissions=()) -> None:
        super().__init__(args, returncode, stdout, stderr)
        self.outcome, self.admissions = outcome, list(admissions)


def node_switch(inventory: Path, root: Path, name: str, env: dict | None = None, *, force: bool = False,
                rollback: bool = False, auto_rollback: bool | None = None, timeout_s: float = 180) -> Switched:
    """Run the node's own switch, ``flatshare-node switch``, as a local ``flatshare release`` (or ``rollback``)
    on node ``name`` runs it: the same command line (control/commands.py), the same bundle on stdin
    (control/bundle.py, with the progress cadence of the inventory's silence bound), and an admission
    answered as the operator's side answers it (control/rollout.py, ``admission``): the other nodes probed
    (node/probe.py) and the drain admitted while ``min_serving`` of them take calls and are not being
    released. Nothing of the operator's side runs: no rendering check, no follow-up, no summary.

    ``env`` is added to the switch's environment (tests/faults). Returns a :class:`Switched`.
    """
    from flatshare_ops.common import protocol
    from flatshare_ops.control import commands
    from flatshare_ops.control.bundle import bundle
    from flatshare_ops.control.rollout import progress_cadence
    from flatshare_ops.control.targets import targets

    everyone = targets(inventory, [], True)
    (target,) = [t for t in everyone if t.name == name]
    target.local = True
    payload = {} if rollback else bundle(root, target, ship=False)
    payload["progress_every_s"] = progress_cadence(target.settings.transport.silence_s)
    if auto_rollback is None:
        auto_rollback = rollback or target.loaded.profile.release.auto_rollback
    argv = commands.switch(target.spec, uuid.uuid4().hex[:16], rollout=uuid.uuid4().hex[:12], force=force,
                           rollback=rollback, auto_rollback=auto_rollback)
    errors = tempfile.TemporaryFile("w+")
    process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors,
                               text=True, env={**os.environ, **(env or {})}, start_new_session=True)
    assert process.stdin is not None and process.stdout is not None  # both PIPE
    watchdog = threading.Timer(timeout_s, process.kill)  # a switch that never ends fails the test, not the run
    watchdog.start()
    admissions, people, outcome = [], [], None
    try:
        process.stdin.write(json.dumps(payload) + "\n")
        process.stdin.flush()
        for line in process.stdout:
            message = protocol.parse(line.rstrip("\n"))
            if isinstance(message, protocol.AdmitRequest):
                answer = _admission(target, everyone)
                admissions.append(answer)
                process.stdin.write(protocol.answer_line(answer))
                process.stdin.flush()
            elif isinstance(message, protocol.Outcome):
                outcome = message
            elif not protocol.is_protocol(line):
                people.append(line)
        process.stdin.close()
        code = process.wait(timeout=timeout_s)
    finally:
        watchdog.cancel()
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stdin.close()
        process.stdout.close()
        errors.seek(0)
        said = errors.read()
        errors.close()
    return Switched(argv, code, "".join(people), said, outcome, admissions)


def _admission(target, everyone):
    """The operator's admission rule (control/rollout.py): the others probed, the drain admitted while
    ``min_serving`` of them take calls and no release holds them."""
    from flatshare_ops.common import protocol
    from flatshare_ops.node.context import NodeContext
    from flatshare_ops.node.probe import probe

    serving = []
    for other in everyone:
        if other.name == target.name:
            continue
        spec = other.spec
        runtime = Path(spec.runtime_dir) if spec.runtime_dir else None
        answer = probe(NodeContext(other.name, Path(spec.state_dir), ManagerAddress(spec.scope, runtime)))
        if answer["takes_calls"] and not answer["locked"]:
            serving.append(other.name)
    need = target.settings.min_serving
    if len(serving) >= need:
        return protocol.AdmitAnswer(True)
    return protocol.AdmitAnswer(False, f"{len(serving)} other node(s) take calls and are not being released; "
                                       f"min_serving {need}")


@contextmanager
def sandbox_fleet(tmp_path_factory, addresses: dict[str, str]):
    """Bring up a fleet from a scratch copy of the checkout on ``addresses``; yield a :class:`Fleet`; tear down."""
    with scratch_sandbox(tmp_path_factory, "release", addresses) as (_, checkout, base):
        yield Fleet(checkout, base, addresses)
