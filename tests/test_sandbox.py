"""The sandbox fleet: separate managers, real SSH with host keys checked, stand-ins on their interfaces,
and the rendered units installed and running."""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from conftest import REPO, TEST_ADDRESSES, loopback_pair, run_cli, without_canaries
from flatshare_ops.config.inventory import load_inventory, resolve
from flatshare_ops.config.profile import load_profile
from flatshare_ops.control.ssh import SSHConnection, SSHTarget
from flatshare_ops.errors import TransportError
from flatshare_ops.render import render_profile
from flatshare_ops.sandbox.fleet import SandboxNode, down, status, up
from flatshare_ops.sandbox.manager import start_manager, stop_manager
from flatshare_ops.common.systemd import ManagerAddress, connect, daemon_reload, run_job, unit_property


def _address(base: Path, node: str) -> ManagerAddress:
    return ManagerAddress("user", SandboxNode(node, TEST_ADDRESSES[node], base).manager.runtime_dir)


def _target(base: Path, node: str, known_hosts: Path | None = None) -> SSHTarget:
    inventory = load_inventory(base / "fleet.toml")
    n = inventory.nodes[node]
    return SSHTarget(node, n.host, n.port, n.user, known_hosts or resolve(base / "fleet.toml", n.known_hosts),
                     resolve(base / "fleet.toml", n.identity))


def _get(url: str) -> tuple[int, dict, bytes]:
    """(status, headers, body); status 0 when nothing listens."""
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()
    except urllib.error.URLError:
        return 0, {}, b""


def _post(url: str) -> tuple[int, dict, bytes]:
    request = urllib.request.Request(url, method="POST", data=b"")
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def _wait_for(predicate, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


def test_a_unit_started_on_cyan_is_not_seen_by_peacocks_manager(sandbox):
    name = f"probe-{uuid.uuid4().hex[:8]}.service"
    unit_file = SandboxNode("cyan", "", sandbox).manager.unit_dir / name
    unit_file.write_text("[Service]\nType=exec\nExecStart=/bin/sleep 300\n")
    try:
        with connect(_address(sandbox, "cyan")) as bus:
            daemon_reload(bus)
            run_job(bus, "start", name, 10)
            assert unit_property(bus, name, "Unit", "ActiveState") == b"active"
        with connect(_address(sandbox, "peacock")) as bus:
            assert unit_property(bus, name, "Unit", "LoadState") == b"not-found"
            assert unit_property(bus, name, "Unit", "ActiveState") == b"inactive"
    finally:
        with connect(_address(sandbox, "cyan")) as bus:
            run_job(bus, "stop", name, 10)
        unit_file.unlink()


def test_each_node_manager_runs_in_its_own_cgroup(sandbox):
    state = json.loads((sandbox / "state.json").read_text())
    groups = {}
    for node, record in state["nodes"].items():
        groups[node] = Path(f"/proc/{record['manager_pid']}/cgroup").read_text()
    assert groups["cyan"] != groups["peacock"]
    assert "flatshare-cyan-" in groups["cyan"] and "flatshare-peacock-" in groups["peacock"]


@pytest.mark.parametrize("node", ["cyan", "peacock"])
def test_ssh_reaches_each_node_with_its_host_key_checked(sandbox, node):
    conn = SSHConnection(_target(sandbox, node))
    try:
        result = conn.run(["sh", "-c", 'printf %s "$FLATSHARE_NODE"'])
    finally:
        conn.close()
    assert (result.status, result.output) == (0, node)


#: Kills the nearest sshd ancestor of the command: its session on the node ends with no exit status.
KILL_MY_SESSION = """
import os, signal
pid = os.getppid()
while pid > 1:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        if f.read().split(b"\\0")[0].split(b"/")[-1].startswith(b"sshd"):
            os.kill(pid, signal.SIGKILL)
            break
    with open(f"/proc/{pid}/stat") as f:
        pid = int(f.read().rsplit(")", 1)[1].split()[1])
"""


@pytest.mark.parametrize("how", ["its session on the node is killed", "a signal ends it"])
def test_a_command_that_ends_without_an_exit_status_is_lost_never_a_result(sandbox, how):
    # A breaker's case: a session killed while the retry guard read a node's history came back as a result with
    # no exit status ("exit None: no output"), the guard took it for a history it could not read and let through
    # a release it refuses; a lost session is asked again on a new connection (control/rollout.py run_command).
    from flatshare_ops.control.connection import Lost

    argv = {"its session on the node is killed": [sys.executable, "-c", KILL_MY_SESSION],
            "a signal ends it": ["sh", "-c", 'kill -KILL "$$"']}[how]
    conn = SSHConnection(_target(sandbox, "cyan"))
    try:
        with pytest.raises(Lost, match="ended without an exit status"):
            conn.run(argv, timeout_s=30)
    finally:
        conn.close()
    again = SSHConnection(_target(sandbox, "cyan"))  # the node is still there: a new connection answers
    try:
        assert again.run(["sh", "-c", "echo answered"]).output == "answered\n"
    finally:
        again.close()


def test_each_nodes_ssh_sessions_have_a_home_of_their_own_and_this_pythons_path(sandbox):
    # bash reads ~/.bashrc for every command sshd runs: the node's own, not this machine user's.
    home = SandboxNode("cyan", TEST_ADDRESSES["cyan"], sandbox).root / "home"
    (home / ".bashrc").write_text("export FLATSHARE_HOME_MARK=cyan-home\n")
    try:
        conn = SSHConnection(_target(sandbox, "cyan"))
        try:
            result = conn.run(["sh", "-c", 'printf "%s|%s|%s" "$HOME" "$FLATSHARE_HOME_MARK" "$(command -v python3)"'])
        finally:
            conn.close()
    finally:
        (home / ".bashrc").unlink()
    assert result.output.split("|") == [str(home), "cyan-home", str(Path(sys.base_prefix) / "bin/python3")]


def test_sandbox_up_starts_sshd_again_on_an_sshd_config_it_rewrote(sandbox):
    before = json.loads((sandbox / "state.json").read_text())["nodes"]
    config = sandbox / "peacock/ssh/sshd_config"
    written = config.read_text()
    config.write_text(written.replace("PasswordAuthentication no", "PasswordAuthentication yes"))
    up(sandbox, REPO / "profiles/rtx-5060-ti-serve.toml", TEST_ADDRESSES, echo=lambda _l: None)
    after = json.loads((sandbox / "state.json").read_text())["nodes"]
    assert config.read_text() == written
    assert after["cyan"]["sshd_pid"] == before["cyan"]["sshd_pid"]
    assert after["peacock"]["sshd_pid"] != before["peacock"]["sshd_pid"]
    assert str(config) in Path(f"/proc/{after['peacock']['sshd_pid']}/cmdline").read_text()
    conn = SSHConnection(_target(sandbox, "peacock"))
    try:
        assert conn.run(["sh", "-c", 'printf %s "$FLATSHARE_NODE"']).output == "peacock"
    finally:
        conn.close()


def test_a_changed_host_key_is_refused(sandbox, tmp_path):
    impostor = tmp_path / "impostor"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(impostor)], check=True)
    kind, blob = impostor.with_suffix(".pub").read_text().split()[:2]
    known = tmp_path / "known_hosts"
    known.write_text(f"[{TEST_ADDRESSES['cyan']}]:2222 {kind} {blob}\n")
    with pytest.raises(TransportError, match="does not match"):
        SSHConnection(_target(sandbox, "cyan", known))


def test_an_unknown_host_is_refused_not_added(sandbox, tmp_path):
    known = tmp_path / "known_hosts"
    known.write_text("")
    with pytest.raises(TransportError, match="is not in"):
        SSHConnection(_target(sandbox, "cyan", known))
    assert known.read_text() == ""


def test_stand_in_engine_answers_health_version_and_metrics(sandbox):
    node = SandboxNode("cyan", TEST_ADDRESSES["cyan"], sandbox)
    url = f"http://{node.address}:8000"
    assert _get(url + "/health")[0] == 200
    metadata = next(node.venv.glob("lib/python*/site-packages/vllm-*.dist-info/METADATA")).read_text()
    installed = next(line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Version:"))
    assert json.loads(_get(url + "/version")[2]) == {"version": installed} == {"version": "0.32.0"}
    metrics = _get(url + "/metrics")[2].decode()
    assert 'vllm:num_requests_running{engine="0",model_name="flatshare-chat"}' in metrics  # vLLM's own labels
    assert 'cache_dtype="auto"' in metrics
    assert "flatshare:make_room_turns_announced_total" in metrics


def test_stand_in_engine_refuses_an_unknown_flag(sandbox):
    node = SandboxNode("cyan", TEST_ADDRESSES["cyan"], sandbox)
    result = subprocess.run([str(node.venv / "bin/vllm"), "serve", "/m", "--bogus-flag", "1"], capture_output=True, text=True)
    assert result.returncode == 2
    assert "unrecognized arguments: --bogus-flag 1" in result.stderr


@pytest.mark.parametrize("node", ["cyan", "peacock"])
def test_rendered_units_are_installed_and_running(sandbox, node):
    n = SandboxNode(node, TEST_ADDRESSES[node], sandbox)
    rendered = render_profile(load_profile(n.profile))
    for name, text in rendered.units.items():
        assert (n.manager.unit_dir / name).read_text() == text
    with connect(_address(sandbox, node)) as bus:
        for name in ("flatshare.target", "flatshare-engine.service", "flatshare-gateway.service", "flatshare-voice.service"):
            assert unit_property(bus, name, "Unit", "ActiveState") == b"active", name
        pid = unit_property(bus, "flatshare-engine.service", "Service", "MainPID")
    cmdline = [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1]]
    # The console script runs under its interpreter: [python, VENV/bin/vllm, serve, MODEL, flags...]
    assert cmdline[1:] == rendered.argv
    # The pre-start step built the module the node's profile pins.
    import hashlib

    module = load_profile(n.profile).profile.module
    assert hashlib.sha256(Path(module.path).read_bytes()).hexdigest() == module.sha256


def test_gateway_drains_on_stop_503_with_retry_after_and_lets_requests_finish(sandbox):
    node = SandboxNode("peacock", TEST_ADDRESSES["peacock"], sandbox)
    gateway = f"http://{node.address}:8080"
    results = {}
    slow = threading.Thread(target=lambda: results.setdefault("slow", _post(gateway + "/v1/chat?hold=1.5")))
    slow.start()
    _wait_for(lambda: json.loads(_get(gateway + "/stats")[2])["in_flight"] == 1)
    def stop_gateway():
        # Its own connection: an sd-bus connection belongs to one thread.
        with connect(_address(sandbox, "peacock")) as bus:
            run_job(bus, "stop", "flatshare-gateway.service", 30)

    stopper = threading.Thread(target=stop_gateway)
    stopper.start()
    try:
        _wait_for(lambda: _get(gateway + "/health")[0] == 503)
        status, headers, _ = _post(gateway + "/v1/chat")
        stopper.join()
        slow.join()
        assert status == 503 and headers.get("Retry-After") == "1"
        assert results["slow"][0] == 200
    finally:
        stopper.join()
        with connect(_address(sandbox, "peacock")) as bus:
            run_job(bus, "start", "flatshare-gateway.service", 30)
    _wait_for(lambda: _get(gateway + "/health")[0] == 200)


def _voice_status(node: SandboxNode) -> dict:
    return json.loads((node.run_dir / "voice.status").read_text())


def test_voice_worker_drains_after_its_calls_end_and_serves_again(sandbox):
    node = SandboxNode("cyan", TEST_ADDRESSES["cyan"], sandbox)
    voice = f"http://{node.address}:8090"
    drain_file = node.run_dir / "voice.drain"
    assert _post(voice + "/calls/start?seconds=1&turns=1")[0] == 200
    began = time.time()
    drain_id = uuid.uuid4().hex
    drain_file.write_text(drain_id)
    try:
        draining = _wait_for(lambda: (s := _voice_status(node))["drain_id"] == drain_id and s)
        assert draining["state"] == "draining" and draining["calls_in_progress"] == 1
        assert _post(voice + "/calls/start")[0] == 503
        drained = _wait_for(lambda: (s := _voice_status(node))["state"] == "drained" and s)
        assert drained["drain_id"] == drain_id and drained["written_at"] >= began
        assert drained["calls_in_progress"] == 0
    finally:
        drain_file.unlink()
    _wait_for(lambda: _voice_status(node)["state"] == "serving")
    assert _post(voice + "/calls/start?seconds=0.1")[0] == 200


def _turns(url: str) -> float:
    for line in _get(url + "/metrics")[2].decode().splitlines():
        if line.startswith("flatshare:make_room_turns_announced_total"):
            return float(line.split()[-1])
    raise AssertionError("no turns counter")


def test_voice_worker_announces_turns_to_the_engine_when_hints_are_on(sandbox):
    node = SandboxNode("peacock", TEST_ADDRESSES["peacock"], sandbox)
    engine = f"http://{node.address}:8000"
    before = _turns(engine)
    assert _post(f"http://{node.address}:8090/calls/start?seconds=0.3&turns=3")[0] == 200
    _wait_for(lambda: _turns(engine) == before + 3)


def test_sandbox_up_again_changes_nothing(sandbox):
    before_state = (sandbox / "state.json").read_text()
    with connect(_address(sandbox, "cyan")) as bus:
        invocation = unit_property(bus, "flatshare-engine.service", "Unit", "InvocationID")
    up(sandbox, REPO / "profiles/rtx-5060-ti-serve.toml", TEST_ADDRESSES, echo=lambda _l: None)
    assert (sandbox / "state.json").read_text() == before_state
    with connect(_address(sandbox, "cyan")) as bus:
        assert unit_property(bus, "flatshare-engine.service", "Unit", "InvocationID") == invocation


def _crash(base: Path, name: str) -> None:
    """Kill a node's manager and everything it runs (as a power loss does); its release stays on disk."""
    import json as json_

    record = json_.loads((base / "state.json").read_text())["nodes"][name]
    stop_manager(SandboxNode(name, TEST_ADDRESSES[name], base).manager.name, record["manager_pid"])


def _serves(base: Path, name: str) -> dict:
    """What callers of a node meet, at once (no wait): its services' ActiveState and both /health answers."""
    units = ("flatshare-engine.service", "flatshare-gateway.service", "flatshare-voice.service")
    with connect(_address(base, name)) as bus:
        found = {unit: unit_property(bus, unit, "Unit", "ActiveState") for unit in units}
    address = TEST_ADDRESSES[name]
    found.update(engine=_get(f"http://{address}:8000/health")[0], gateway=_get(f"http://{address}:8080/health")[0])
    return found


SERVING = {"flatshare-engine.service": b"active", "flatshare-gateway.service": b"active",
           "flatshare-voice.service": b"active", "engine": 200, "gateway": 200}


def test_sandbox_up_after_a_nodes_manager_died_returns_once_its_release_serves_again(sandbox):
    """A node whose manager and everything it ran died (the machine lost power) but whose release is kept:
    ``up`` starts the manager, which starts the release's units by itself, and returns only when the node serves,
    so that a release run right after finds it taking calls (``make demo`` after a reboot of this machine: both
    nodes were still starting, and the release was refused for want of a node taking calls)."""
    _crash(sandbox, "cyan")
    assert _get(f"http://{TEST_ADDRESSES['cyan']}:8080/health")[0] == 0  # nothing serves
    said: list[str] = []
    up(sandbox, REPO / "profiles/rtx-5060-ti-serve.toml", TEST_ADDRESSES, echo=said.append)
    assert _serves(sandbox, "cyan") == SERVING  # at once, no wait
    assert any(line.startswith("cyan: its release serves") for line in said), said
    assert not any(line.startswith("peacock: its release") for line in said), said  # peacock's manager ran on


def _user_managers(base: Path, name: str) -> list[int]:
    """The ``systemd --user`` processes in node ``name``'s cgroup, found by scanning /proc (proc(5): cmdline,
    cgroup), not through what the sandbox recorded."""
    group = f"/flatshare-{SandboxNode(name, TEST_ADDRESSES[name], base).manager.name}"
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            groups = (entry / "cgroup").read_text()
        except OSError:
            continue
        if len(argv) > 1 and argv[0].endswith(b"/systemd") and argv[1] == b"--user" and \
                any(line.endswith(group) or f"{group}/" in line for line in groups.splitlines()):
            found.append(int(entry.name))
    return found


def test_sandbox_up_with_a_managers_pid_lost_from_its_state_runs_one_manager_a_node(sandbox):
    # A breaker's case: state.json with cyan's manager_pid null (damaged by hand, or written before the pid was)
    # made `sandbox up` start a second manager for cyan beside the running one, both managing cyan's units.
    path = sandbox / "state.json"
    state = json.loads(path.read_text())
    (running,) = _user_managers(sandbox, "cyan")
    state["nodes"]["cyan"]["manager_pid"] = None
    path.write_text(json.dumps(state))
    up(sandbox, REPO / "profiles/rtx-5060-ti-serve.toml", TEST_ADDRESSES, echo=lambda _line: None)
    (manager,) = _user_managers(sandbox, "cyan")
    assert manager != running and json.loads(path.read_text())["nodes"]["cyan"]["manager_pid"] == manager
    assert _serves(sandbox, "cyan") == SERVING


def test_sandbox_up_waits_for_a_manager_still_starting_its_release_that_another_command_started(sandbox):
    """A manager started by another command (``sandbox reboot``, or an ``up`` interrupted during its wait) that is
    still starting its release's units is waited for too. A drop-in makes the stand-in engine load for 4 s."""
    from flatshare_ops.sandbox.fleet import reboot

    drop_in = SandboxNode("cyan", TEST_ADDRESSES["cyan"], sandbox).manager.unit_dir / \
        "flatshare-engine.service.d/zz-slow-load.conf"
    drop_in.parent.mkdir(exist_ok=True)
    drop_in.write_text("[Service]\nEnvironment=FLATSHARE_STANDIN_LOAD_S=4\n")
    try:
        reboot(sandbox, "cyan", echo=lambda _l: None)
        said: list[str] = []
        up(sandbox, REPO / "profiles/rtx-5060-ti-serve.toml", TEST_ADDRESSES, echo=said.append)
        assert _serves(sandbox, "cyan") == SERVING, said
        assert any(line.startswith("cyan: its release serves") for line in said), said
    finally:
        drop_in.unlink()
        with connect(_address(sandbox, "cyan")) as bus:
            daemon_reload(bus)
            run_job(bus, "restart", "flatshare-engine.service", 60)
        _wait_for(lambda: _serves(sandbox, "cyan") == SERVING, 60)


def test_sandbox_up_fails_naming_a_service_that_restarts_for_ever_after_a_crash(sandbox, monkeypatch):
    """A service that exits at its start (its port taken by another process) is restarted by systemd for ever,
    never "failed", and its manager has no job left: ``up`` says the release does not serve, naming the unit,
    and fails, never that it started."""
    import socket

    from flatshare_ops.sandbox import fleet
    from flatshare_ops.sandbox.manager import SandboxError

    monkeypatch.setattr(fleet, "START_WAIT_S", 12.0)
    _crash(sandbox, "cyan")
    squatter = socket.socket()
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    squatter.bind((TEST_ADDRESSES["cyan"], 8090))  # the voice worker's port
    squatter.listen()
    said: list[str] = []
    try:
        with pytest.raises(SandboxError) as failed:
            up(sandbox, REPO / "profiles/rtx-5060-ti-serve.toml", TEST_ADDRESSES, echo=said.append)
        assert failed.value.exit_code == 1 and "cyan" in str(failed.value), failed.value
        (line,) = [x for x in said if x.startswith("cyan: its release")]
        assert "does not serve" in line and "flatshare-voice.service" in line, said
        with connect(_address(sandbox, "cyan")) as bus:  # systemd's own count: it was started again and again
            assert unit_property(bus, "flatshare-voice.service", "Service", "NRestarts") >= 2
    finally:
        squatter.close()
        _wait_for(lambda: _serves(sandbox, "cyan") == SERVING, 60)  # systemd starts it again by itself


def test_sandbox_up_keeps_a_node_profile_changed_by_hand_and_says_so(sandbox):
    # A breaker's case: an operator's edit of a node's profile was overwritten by the next `up` without a word.
    profile = sandbox / "cyan/profile.toml"
    written = profile.read_bytes()
    edited = written + b"\n# tried by hand: a longer drain\n"
    profile.write_bytes(edited)
    said: list[str] = []
    try:
        up(sandbox, REPO / "profiles/rtx-5060-ti-serve.toml", TEST_ADDRESSES, echo=said.append)
        assert profile.read_bytes() == edited
        assert f"cyan: {profile} was changed since sandbox up wrote it; kept as it is (move it aside to have " \
               "sandbox up write it afresh)" in said, said
        assert not [line for line in said if "peacock/profile.toml" in line], said
    finally:
        profile.write_bytes(written)
    said.clear()
    up(sandbox, REPO / "profiles/rtx-5060-ti-serve.toml", TEST_ADDRESSES, echo=said.append)
    assert profile.read_bytes() == written and not [line for line in said if "was changed" in line], said


@pytest.mark.parametrize("damage", ["fifo", "directory", "not-json", "dangling-link", "wrong-shape"])
def test_sandbox_up_refuses_a_damaged_note_of_what_it_wrote_and_overwrites_no_profile(sandbox, damage):
    # A breaker's cases: a FIFO there hung `up`, a directory gave a traceback, and a note that was not JSON or
    # a dangling link let `up` overwrite a profile changed by hand without a word.
    from flatshare_ops.sandbox.fleet import SandboxError

    note, profile = sandbox / "cyan/.profiles-written.json", sandbox / "cyan/profile.toml"
    kept_note, written = note.read_bytes(), profile.read_bytes()
    profile.write_bytes(written + b"\n# tried by hand\n")
    note.unlink()
    {"fifo": lambda: os.mkfifo(note), "directory": note.mkdir, "not-json": lambda: note.write_bytes(b"{torn"),
     "dangling-link": lambda: note.symlink_to(sandbox / "nowhere"),
     "wrong-shape": lambda: note.write_text('{"profile.toml": 5}')}[damage]()
    try:
        with pytest.raises(SandboxError) as refused:
            up(sandbox, REPO / "profiles/rtx-5060-ti-serve.toml", TEST_ADDRESSES, echo=lambda _l: None)
        assert refused.value.exit_code == 2 and str(refused.value).startswith(f"{note}: "), refused.value
        assert "move it aside" in str(refused.value) and "\n" not in str(refused.value)
        assert profile.read_bytes() == written + b"\n# tried by hand\n"
    finally:
        if note.is_dir() and not note.is_symlink():
            note.rmdir()
        else:
            note.unlink()
        note.write_bytes(kept_note)
        profile.write_bytes(written)


def test_status_reports_each_node(sandbox):
    result = run_cli("sandbox", "status", "--dir", str(sandbox), "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert set(report) == {"cyan", "peacock"}
    assert all(entry["engine_health"] == 200 for entry in report.values())


def _short_dir(tmp_path_factory) -> Path:
    """A sandbox directory with a short path: a node's manager binds BASE/NODE/run/user/systemd/private, and a
    unix socket's path has at most 107 bytes (a test's own tmp_path under pytest-xdist, .../popen-gw1/
    test_down_stops_every_process_0/sb/peacock/..., has 108: that manager never opened its socket)."""
    return tmp_path_factory.mktemp("sb")


def test_down_stops_every_process_it_started(tmp_path_factory):
    addresses = loopback_pair(1)
    base = _short_dir(tmp_path_factory)
    try:
        up(base, REPO / "profiles/rtx-5060-ti-serve.toml", addresses, echo=lambda _l: None)
        without_canaries(base)
    except BaseException:
        down(base, echo=lambda _l: None)  # what came up before the failure: never left running
        raise
    state = json.loads((base / "state.json").read_text())
    pids = [record[k] for record in state["nodes"].values() for k in ("manager_pid", "sshd_pid")]
    groups = [Path(f"/sys/fs/cgroup/{hierarchy}/flatshare-{SandboxNode(n, a, base.resolve()).manager.name}")
              for n, a in addresses.items() for hierarchy in ("systemd", "unified")
              if Path(f"/sys/fs/cgroup/{hierarchy}/cgroup.procs").exists()]
    assert groups and all(g.is_dir() for g in groups)
    down(base, echo=lambda _l: None)
    for pid in pids:
        stat = Path(f"/proc/{pid}/stat")
        assert not stat.exists() or stat.read_text().split(")")[1].split()[0] == "Z", f"pid {pid} still runs"
    for group in groups:
        assert not group.exists(), f"{group} is left behind"  # its processes gone and the directory removed
    assert status(base) == {}


@pytest.mark.parametrize("state", [
    '{"schema": 1, "nodes": {"cyan": {"manager_pid": -1, "sshd_pid": 0}}}',
    '{"schema": 1, "nodes": {"cyan": {"manager_pid": true}}}',
    '{"nodes": []}',
    "[]",
    "not json",
])
def test_down_refuses_a_corrupt_state_file_and_signals_nothing(tmp_path, state):
    (tmp_path / "state.json").write_text(state)
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        result = run_cli("sandbox", "down", "--dir", str(tmp_path))
        assert result.returncode == 2, result.stdout + result.stderr
        assert "state.json: unreadable sandbox state" in result.stderr
        assert "Traceback" not in result.stderr
        assert sleeper.poll() is None, "an unrelated process was signalled"
    finally:
        sleeper.kill()


def test_down_never_signals_a_recorded_pid_that_is_not_the_sandboxs(tmp_path):
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        (tmp_path / "state.json").write_text(json.dumps(
            {"schema": 1, "nodes": {"cyan": {"manager_pid": sleeper.pid, "sshd_pid": sleeper.pid}}}))
        result = run_cli("sandbox", "down", "--dir", str(tmp_path))
        assert result.returncode == 0, result.stderr
        assert f"sshd pid {sleeper.pid} is gone or no longer ours; not touched" in result.stdout
        assert sleeper.poll() is None
    finally:
        sleeper.kill()


def test_up_refuses_an_address_another_process_holds_and_leaves_nothing_running(tmp_path_factory):
    addresses = loopback_pair(2)
    holder = socket.create_server((addresses["peacock"], 2222))
    base = _short_dir(tmp_path_factory)
    try:
        result = run_cli("sandbox", "up", "--dir", str(base), "--root", str(REPO), "--engine", "stand-in",
                         env={"FLATSHARE_SANDBOX_ADDRESSES": f"cyan={addresses['cyan']},peacock={addresses['peacock']}"})
        assert result.returncode == 1
        assert f"peacock: {addresses['peacock']}:2222 is already in use" in result.stderr
    finally:
        holder.close()
        assert run_cli("sandbox", "down", "--dir", str(base)).returncode == 0
    state = base / "state.json"
    assert not state.exists()
    group = Path(f"/sys/fs/cgroup/systemd/flatshare-{SandboxNode('cyan', '', base.resolve()).manager.name}")
    assert not group.exists() or not [p for f in group.rglob("cgroup.procs") for p in f.read_text().split()]


def test_a_node_sandbox_up_made_is_enabled_and_comes_back_after_a_reboot(sandbox):
    """A node's first release (the real one, which `up` runs) enables what a release enables: a reboot
    right after it (no release since) finds the node serving (systemd's own UnitFileState, then /health)."""
    from flatshare_ops.sandbox.fleet import reboot

    with connect(_address(sandbox, "cyan")) as bus:
        for unit in ("flatshare.target", "serving-check.timer"):
            assert unit_property(bus, unit, "Unit", "UnitFileState") == b"enabled", unit
    reboot(sandbox, "cyan", echo=lambda _l: None)
    address = TEST_ADDRESSES["cyan"]
    _wait_for(lambda: _get(f"http://{address}:8000/health")[0] == 200, 60)
    _wait_for(lambda: _get(f"http://{address}:8080/health")[0] == 200, 30)


def test_a_running_node_is_not_remade_bare_in_place(sandbox):
    from flatshare_ops.sandbox.fleet import SandboxError

    profile = SandboxNode("cyan", TEST_ADDRESSES["cyan"], sandbox).profile
    before = profile.read_bytes()
    with pytest.raises(SandboxError, match="already up as a user-scope node; bring the sandbox down first"):
        up(sandbox, REPO / "profiles/rtx-5060-ti-serve.toml", TEST_ADDRESSES, echo=lambda _l: None, bare=("cyan",))
    assert profile.read_bytes() == before
    assert _get(f"http://{TEST_ADDRESSES['cyan']}:8000/health")[0] == 200


def test_up_refuses_a_directory_made_for_other_addresses_before_starting_anything(tmp_path_factory):
    from flatshare_ops.sandbox.fleet import SandboxError

    base = _short_dir(tmp_path_factory)
    releases = SandboxNode("cyan", TEST_ADDRESSES["cyan"], base).state_dir / "releases"
    (releases / "r1").mkdir(parents=True)
    (releases / "r1/serving.json").write_text('{"engine": {"url": "http://127.99.0.2:8000"}}\n')
    (releases / "current").symlink_to("r1")
    with pytest.raises(SandboxError, match="holds a node made for address 127.99.0.2") as refused:
        up(base, REPO / "profiles/rtx-5060-ti-serve.toml", TEST_ADDRESSES, echo=lambda _l: None)
    assert refused.value.exit_code == 2
    assert not (base / "state.json").exists()  # nothing was started


def test_each_nodes_first_release_is_the_real_one(sandbox):
    # One writer of the history: the node's switch. 'up' ran the real release ('flatshare release --all').
    for name in ("cyan", "peacock"):
        state = sandbox / name / "var/lib/flatshare/releases"
        records = [json.loads(line) for line in (state / "history.jsonl").read_text().splitlines()]
        assert [(r["kind"], r["result"], r["before"], r["served"]) for r in records[:1]] == [
            ("release", "released", None, True)]
        assert records[0]["after"] == os.readlink(state / "current")
        assert f"switching (no release) -> {records[0]['after']}" in (state / "release.log").read_text()


def test_sandbox_up_leaves_each_nodes_first_release_to_the_real_release(tmp_path_factory):
    # What `make demo` meets on a fresh clone: bootstrapped nodes with no release, so its release is a
    # real switch on each node.
    addresses = loopback_pair(2)
    base = _short_dir(tmp_path_factory)
    env = {"FLATSHARE_SANDBOX_ADDRESSES": f"cyan={addresses['cyan']},peacock={addresses['peacock']}"}
    try:
        result = run_cli("sandbox", "up", "--dir", str(base), "--root", str(REPO), "--engine", "stand-in", env=env)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "its first is the real one" in result.stdout
        for name in ("cyan", "peacock"):
            state = base / name / "var/lib/flatshare"
            assert not (state / "releases/current").exists() and not (state / "releases/history.jsonl").exists()
            assert (state / "module/flatshare_make_room_serve.py").is_file()  # built once, as bootstrap builds it
            assert not list((base / name / "etc/systemd/user").glob("flatshare*"))
        # No engine yet: status says so in words (exit 1: not serving), never Python's None.
        status = run_cli("sandbox", "status", "--dir", str(base))
        assert status.returncode == 1, status.stdout + status.stderr
        for name in ("cyan", "peacock"):
            (line,) = [line for line in status.stdout.splitlines() if line.startswith(f"{name}: ")]
            assert line.endswith("no engine process, /health answered nothing") and "None" not in line, line
        released = run_cli("release", "--all", "--inventory", str(base / "fleet.toml"), "--root", str(REPO))
        assert released.returncode == 0, released.stdout + released.stderr
        for name in ("cyan", "peacock"):
            assert re.search(rf"^\[{name} [0-9:]+\] {name}: switching \(no release\) -> ", released.stdout, re.MULTILINE)
        # The canary's first release: nothing to compare with or go back to, so no analysis (and no wait for
        # calls that a fresh fleet has none of); the skip is in cyan's history.
        assert "canary analysis skipped: cyan had no release before" in released.stdout, released.stdout
        assert "roll back to); recorded in its history" in released.stdout, released.stdout  # one canary: its own
        records = [json.loads(line) for line in
                   (base / "cyan/var/lib/flatshare/releases/history.jsonl").read_text().splitlines()]
        assert [r.get("analysis", {}).get("skipped") for r in records if r.get("result") == "analysed"] == [True]
        # Asked for the analyses' measurements where none were taken, the history listing says so for each node.
        listing = run_cli("releases", "--measurements", "--inventory", str(base / "fleet.toml"))
        assert listing.returncode == 0, listing.stdout + listing.stderr
        for name in ("cyan", "peacock"):
            assert f"  no canary analysis of {name} has measurements in its history" in listing.stdout.splitlines()
    finally:
        assert run_cli("sandbox", "down", "--dir", str(base)).returncode == 0


@pytest.mark.parametrize("damage", ["torn", "not-utf8", "against-schema", "directory"])
def test_sandbox_up_refuses_an_inventory_it_cannot_keep_before_anything_starts(tmp_path_factory, damage):
    # A breaker's cases: a torn or non-UTF-8 fleet.toml was replaced without a word (what an operator added to it
    # lost), one against the schema was kept (every later command then refused), a directory gave a traceback.
    base = _short_dir(tmp_path_factory)
    path = base / "fleet.toml"
    if damage == "directory":
        path.mkdir()
    else:
        path.write_bytes({"torn": b"schema = 1\n[rollout\ncanaries = 1\n", "not-utf8": b"schema = 1\n\xff\xfe = 1\n",
                          "against-schema": b"schema = 1\n[rollout]\ncanaries = -5\n"}[damage])
    before = path.read_bytes() if path.is_file() else None
    addresses = loopback_pair(2)
    env = {"FLATSHARE_SANDBOX_ADDRESSES": f"cyan={addresses['cyan']},peacock={addresses['peacock']}"}
    result = run_cli("sandbox", "up", "--dir", str(base), "--root", str(REPO), "--engine", "stand-in", env=env)
    said = (result.stdout + result.stderr).strip()
    assert result.returncode == 2 and "Traceback" not in said, said
    assert str(path) in said and "move it aside" in said, said
    assert (path.read_bytes() if path.is_file() else None) == before
    assert not (base / "cyan").exists() and not (base / "state.json").exists()  # nothing started


def _base_for_socket_path(parent: Path, size: int) -> Path:
    """A sandbox directory under parent whose peacock manager's private socket path is exactly size bytes."""
    tail = len(os.fsencode("/peacock/run/user/systemd/private"))
    room = size - tail - len(os.fsencode(parent)) - 1  # the '/' before the directory's own name
    assert room > 0, f"{parent} is already too long for a {size}-byte socket path"
    return parent / ("d" * room)


def test_sandbox_up_refuses_a_directory_too_deep_for_its_managers_sockets_before_anything_is_made(
        tmp_path_factory):
    # Seen in every full suite run: under pytest-xdist a test's tmp_path made peacock's private socket path 108
    # bytes; its manager ran without the socket, and `sandbox up` waited 90 s for nothing.
    addresses = loopback_pair(2)
    base = _base_for_socket_path(tmp_path_factory.mktemp("deep"), 108)
    socket_path = base / "peacock/run/user/systemd/private"
    assert len(os.fsencode(socket_path)) == 108  # unix(7): sun_path holds 108 bytes, one of them the NUL
    env = {"FLATSHARE_SANDBOX_ADDRESSES": f"cyan={addresses['cyan']},peacock={addresses['peacock']}"}
    result = run_cli("sandbox", "up", "--dir", str(base), "--root", str(REPO), "--engine", "stand-in", env=env)
    said = (result.stdout + result.stderr).strip()
    assert result.returncode == 2 and "Traceback" not in said, said
    assert said.splitlines() == [f"flatshare: {socket_path}: 108 bytes, longer than a Unix socket's path can be "
                                 f"(107 bytes, unix(7)): peacock-{_sha(base)}'s systemd could not open its sockets "
                                 "there; give the sandbox a directory 1 or more bytes shorter (--dir)"], said
    assert not base.exists()  # nothing made


def _sha(base: Path) -> str:
    return hashlib.sha256(str(base.resolve()).encode()).hexdigest()[:8]


def test_a_manager_whose_private_socket_path_is_107_bytes_answers_systemctl(tmp_path_factory):
    # The bound's other side, against systemd's own tool: at 107 bytes the manager opens its socket.
    base = _base_for_socket_path(tmp_path_factory.mktemp("deep"), 107)
    dirs = SandboxNode("peacock", "", base).manager
    assert len(os.fsencode(dirs.private_socket)) == 107
    pid = start_manager(dirs)
    try:
        shown = subprocess.run(["systemctl", "--user", "show", "--property=Version"], capture_output=True, text=True,
                               env={**os.environ, "XDG_RUNTIME_DIR": str(dirs.runtime_dir)}, timeout=30)
        assert shown.returncode == 0 and shown.stdout.startswith("Version="), shown.stderr
    finally:
        stop_manager(dirs.name, pid)


def test_a_manager_whose_directories_cannot_be_made_is_refused_in_one_line(tmp_path):
    """A breaker's case: a runtime directory that cannot be written (a read-only mount there) gave a traceback."""
    from flatshare_ops.sandbox.manager import ManagerDirs, SandboxError

    (tmp_path / "run").write_text("a file where the runtime directory belongs\n")
    dirs = ManagerDirs("blocked", tmp_path / "run" / "user", tmp_path / "config", tmp_path / "log")
    with pytest.raises(SandboxError) as refused:
        start_manager(dirs)
    assert str(tmp_path / "run") in str(refused.value) and "\n" not in str(refused.value), refused.value
