"""A drain is a cost: a release restarts exactly what changed, refuses before draining what cannot start,
and serving-check reads the engine's flags as vLLM reads them. On the sandbox, against systemd's truth
(InvocationID changes at every start; ActiveState sampled while a release runs)."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
import threading
import time

import pytest

from conftest import loopback_pair, run_cli
from flatshare_ops.control.bundle import bundle
from flatshare_ops.control.targets import targets
from flatshare_ops.node.store import release_id
from flatshare_ops.render.systemd_escape import exec_command
from flatshare_ops.common.systemd import connect, daemon_reload, run_job, unit_property
from release_fleet import ENGINE, GATEWAY, VOICE, HOLD_FLAG, sandbox_fleet

ADDRESSES = loopback_pair(11)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    with sandbox_fleet(tmp_path_factory, ADDRESSES) as f:
        yield f


def _set(fleet, key: str, value: str) -> None:
    result = run_cli("profiles", "set", key, value, "--root", str(fleet.checkout))
    assert result.returncode == 0, result.stderr


def _value(fleet, key: str):
    """The checkout profile's value of ``key`` (dotted), as loaded."""
    from flatshare_ops.config.profile import load_profile

    value = load_profile(fleet.checkout / "profiles/rtx-5060-ti-serve.toml").profile
    for part in key.split("."):
        value = getattr(value, part)
    return value


def _log_since(fleet, name: str, start: int) -> str:
    return (fleet.node(name).state_dir / "releases/release.log").read_text()[start:]


def _log_size(fleet, name: str) -> int:
    log = fleet.node(name).state_dir / "releases/release.log"
    return log.stat().st_size if log.exists() else 0


def test_a_documentation_only_change_is_nothing_to_do_and_restarts_nothing(fleet):
    assert fleet.release("--all").returncode in (0, 4)
    before = {n: fleet.invocations(n) for n in ("cyan", "peacock")}
    readme = fleet.checkout / "README.md"
    readme.write_text(readme.read_text() + "\nAn operator's note at the end of the README.\n")
    result = fleet.release("--all")
    assert result.returncode == 4, result.stdout + result.stderr
    assert {n: fleet.invocations(n) for n in ("cyan", "peacock")} == before
    for name in ("cyan", "peacock"):
        fleet.settled(name)


def test_a_value_no_unit_reads_switches_the_release_without_a_drain(fleet):
    name = "cyan"
    before = fleet.invocations(name)
    current = fleet.current(name)
    serving = json.loads((fleet.node(name).state_dir / f"releases/{current}/serving.json").read_text())
    timeout = 21 if serving["voice"]["drain_timeout_s"] != 21 else 22
    profile = fleet.node(name).profile  # the sandbox node's profile sets [voice] drain_timeout_s
    original = profile.read_text()
    profile.write_text(original.replace("drain_timeout_s = 20", f"drain_timeout_s = {timeout}"))
    start = _log_size(fleet, name)
    try:
        result = fleet.release("--node", name)
        assert result.returncode == 0, result.stdout
        assert fleet.current(name) != current
        assert fleet.invocations(name) == before
        assert "drain-voice" not in _log_since(fleet, name, start).split("steps:")[-1]
    finally:
        profile.write_text(original)
    assert fleet.release("--node", name).returncode == 0
    assert fleet.invocations(name) == before
    fleet.settled(name)


def test_a_gateway_change_restarts_only_the_gateway(fleet):
    name = "peacock"
    before = fleet.invocations(name)
    profile = fleet.node(name).profile
    original = profile.read_text()
    profile.write_text(original.replace("[gateway]\n", "[gateway]\n# test: a gateway-only change\n")
                       .replace("drain_timeout_s = 5", "drain_timeout_s = 6"))
    try:
        result = fleet.release("--node", name, "-v")  # -v: the whole plan, its steps
        assert result.returncode == 0, result.stdout
        assert "steps:" in result.stdout, result.stdout
        after = fleet.invocations(name)
        assert after[GATEWAY] != before[GATEWAY]
        assert (after[ENGINE], after[VOICE]) == (before[ENGINE], before[VOICE])
        assert "drain-voice" not in result.stdout.split("steps:")[-1]
    finally:
        profile.write_text(original)
    assert fleet.release("--node", name).returncode == 0
    fleet.settled(name)


def test_a_voice_change_restarts_only_the_voice_worker(fleet):
    name = "cyan"
    before = fleet.invocations(name)
    current = json.loads((fleet.node(name).state_dir / "releases/current/serving.json").read_text())
    del current
    kept = _value(fleet, "voice.endpointing_max_s")
    _set(fleet, "voice.endpointing_max_s", "2.5" if kept != 2.5 else "2.75")  # a change, whatever it holds
    try:
        result = fleet.release("--node", name, "-v")  # -v: the whole plan, its steps and units
        assert result.returncode == 0, result.stdout
        assert "steps:" in result.stdout and "units:" in result.stdout, result.stdout
        after = fleet.invocations(name)
        assert after[VOICE] != before[VOICE]
        assert (after[ENGINE], after[GATEWAY]) == (before[ENGINE], before[GATEWAY])
        assert "restart-engine" not in result.stdout.split("steps:")[-1].split("units:")[0]
    finally:
        _set(fleet, "voice.endpointing_max_s", str(kept))
    assert fleet.release("--node", name).returncode == 0
    fleet.settled(name)


def test_a_timer_change_restarts_the_timer_and_drains_nothing(fleet):
    name = "peacock"
    before = fleet.invocations(name)
    with connect(fleet.address(name)) as bus:
        timer_before = unit_property(bus, "serving-check.timer", "Unit", "InvocationID")
    kept = _value(fleet, "check.interval_s")
    _set(fleet, "check.interval_s", "120" if kept != 120 else "90")  # a change, whatever it holds
    try:
        result = fleet.release("--node", name)
        assert result.returncode == 0, result.stdout
        assert fleet.invocations(name) == before
        with connect(fleet.address(name)) as bus:
            assert unit_property(bus, "serving-check.timer", "Unit", "InvocationID") != timer_before
    finally:
        _set(fleet, "check.interval_s", str(kept))
    assert fleet.release("--node", name).returncode == 0
    fleet.settled(name)


def _switch_directly(fleet, name: str, payload: dict) -> subprocess.CompletedProcess:
    """The node's side given a bundle directly (as an older or altered operator's side could send it)."""
    node = fleet.node(name)
    argv = [sys.executable, "-m", "flatshare_ops.node", "switch", "--node", name, "--state-dir", str(node.state_dir),
            "--scope", "user", "--runtime-dir", str(node.manager.runtime_dir), "--switch-id", "t"]
    answer = json.dumps({"admit": True, "reason": None})
    return subprocess.run(argv, input=json.dumps(payload) + "\n" + answer + "\n", capture_output=True, text=True,
                          timeout=120)


def test_a_release_whose_engine_vllm_rejects_is_refused_before_any_drain(fleet):
    name = "cyan"
    fleet.set_hold(48 if fleet.hold(name) == "0" else 0)
    (target,) = targets(fleet.inventory, [name], False)
    payload = bundle(fleet.checkout, target)
    serving = json.loads(payload["files"]["serving.json"])
    argv = serving["engine"]["argv"]
    argv[argv.index("--served-model-name") + 1] = "--port"  # vLLM: expected at least one argument
    serving["engine"]["argv"] = argv
    unit = payload["files"][f"units/{ENGINE}"]
    line = next(row for row in unit.splitlines() if row.startswith("ExecStart="))
    payload["files"][f"units/{ENGINE}"] = unit = unit.replace(line, "ExecStart=" + exec_command(argv))
    serving["units"][ENGINE] = hashlib.sha256(unit.encode()).hexdigest()
    payload["files"]["serving.json"] = json.dumps(serving)
    payload["id"] = rejected = release_id(payload["files"])  # a consistent bundle: only vLLM refuses it
    before = fleet.invocations(name)
    states, stop = [], threading.Event()

    def watch():
        while not stop.is_set():
            with connect(fleet.address(name)) as bus:
                states.append(unit_property(bus, GATEWAY, "Unit", "ActiveState"))
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        result = _switch_directly(fleet, name, payload)
    finally:
        stop.set()
        watcher.join()
    assert result.returncode == 3, result.stdout + result.stderr
    assert "refused before draining" in result.stdout
    assert "argument --served-model-name: expected at least one argument" in result.stdout
    assert fleet.invocations(name) == before
    assert states and set(states) == {b"active"}
    assert not (fleet.node(name).state_dir / "releases" / rejected).exists()
    fleet.settled(name)


class _EngineDropIn:
    """A drop-in that changes the engine's command line; removed (and the engine restarted) after."""

    def __init__(self, fleet, name: str, argv: list[str]) -> None:
        self.fleet, self.name = fleet, name
        directory = fleet.node(name).manager.unit_dir / f"{ENGINE}.d"
        directory.mkdir(exist_ok=True)
        self.path = directory / "50-flags.conf"
        self.path.write_text(f"[Service]\nExecStart=\nExecStart={exec_command(argv)}\n")
        self._restart()

    def _restart(self) -> None:
        with connect(self.fleet.address(self.name)) as bus:
            daemon_reload(bus)
            run_job(bus, "restart", ENGINE, 60)

    def remove(self) -> None:
        self.path.unlink()
        self._restart()


def _check(fleet, name: str) -> subprocess.CompletedProcess:
    node = fleet.node(name)
    return run_cli("--state-dir", str(node.state_dir), "--runtime-dir", str(node.manager.runtime_dir), "--json",
                   program="serving-check")


def _flags_finding(result) -> dict:
    return next(f for f in json.loads(result.stdout)["findings"] if f["check"] == "flags")


@pytest.mark.parametrize("json_first", [False, True])
def test_a_json_form_beside_the_dotted_flags_is_read_as_vllm_drops_it(fleet, json_first):
    name = "peacock"
    argv = json.loads((fleet.node(name).state_dir / "releases/current/serving.json").read_text())["engine"]["argv"]
    dropped = ["--additional-config", '{"make_room": {"decode_hold_tokens": 0}}']
    changed = argv[:3] + dropped + argv[3:] if json_first else argv + dropped
    drop_in = _EngineDropIn(fleet, name, changed)
    try:
        time.sleep(1.5)  # the stand-in's load time; the flags are what is checked
        finding = _flags_finding(_check(fleet, name))
        # vLLM keeps the dotted keys (the profile's values) and drops the JSON: no difference, but a WARNING.
        assert finding["status"] == "WARNING", finding
        assert any("--additional-config" in d and "is ignored" in d for d in finding["details"]), finding
    finally:
        drop_in.remove()


def test_a_quoted_string_is_not_the_number_the_profile_says(fleet):
    name = "peacock"
    argv = json.loads((fleet.node(name).state_dir / "releases/current/serving.json").read_text())["engine"]["argv"]
    changed = list(argv)
    index = changed.index(HOLD_FLAG) + 1
    changed[index] = json.dumps(changed[index])  # "48": a string to vLLM
    drop_in = _EngineDropIn(fleet, name, changed)
    try:
        finding = _flags_finding(_check(fleet, name))
        assert finding["status"] == "CRITICAL"
        assert f'{HOLD_FLAG}: running "{argv[index]}", profile {argv[index]}' in finding["details"]
    finally:
        drop_in.remove()


def test_an_e2_link_in_a_prefix_drop_in_directory_is_refused_and_reported(fleet):
    name = "cyan"
    node = fleet.node(name)
    fleet.set_hold(48 if fleet.hold(name) == "0" else 0)
    target = node.root / "bench/e2/prefix-point.conf"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text('[Service]\nEnvironment="E2_POINT=11"\n')
    link = node.manager.unit_dir / "flatshare-.service.d/e2-prefix.conf"  # applies to every flatshare-*.service
    link.parent.mkdir(exist_ok=True)
    link.symlink_to(target)
    try:
        before = fleet.current(name)
        refused = fleet.release("--node", name)
        assert refused.returncode == 3, refused.stdout
        assert f"flatshare-.service.d/e2-prefix.conf -> {target}" in refused.stdout
        assert fleet.current(name) == before
        report = json.loads(_check(fleet, name).stdout)
        (drop_ins,) = [f for f in report["findings"] if f["check"] == "drop_ins"]
        assert drop_ins["status"] == "WARNING" and any(str(link) in d for d in drop_ins["details"])
    finally:
        link.unlink()
        with connect(fleet.address(name)) as bus:
            daemon_reload(bus)
    fleet.settled(name)


def test_profile_set_writes_through_a_symlink_and_keeps_mode_and_line_endings(tmp_path, checkout):
    real = tmp_path / "operator/rtx-5060-ti-serve.toml"
    real.parent.mkdir()
    original = (checkout / "profiles/rtx-5060-ti-serve.toml").read_text()
    real.write_bytes(original.replace("\n", "\r\n").encode())
    real.chmod(0o640)
    link = checkout / "profiles/rtx-5060-ti-serve.toml"
    link.unlink()
    link.symlink_to(real)
    result = run_cli("profiles", "set", "engine.make_room.retain_s", "31", "--root", str(checkout))
    assert result.returncode == 0, result.stderr
    assert link.is_symlink() and os.readlink(link) == str(real)
    data = real.read_bytes()
    assert b"retain_s = 31" in data and b"\r\n" in data and b"\n" not in data.replace(b"\r\n", b"")
    assert stat.S_IMODE(real.stat().st_mode) == 0o640


# --- what the real engine's tier (tests/test_real_engine.py) checks, on the stand-in ---------------------------


def test_a_max_model_len_above_the_models_positions_is_refused_before_any_drain_on_the_stand_in(fleet):
    # The stand-in model's config.json holds 16,384 positions; the stand-in's engine config refuses more, in
    # vLLM's words, as vLLM's create_engine_config does (the real one: tests/test_real_engine.py).
    name = "cyan"
    before = fleet.invocations(name)
    with fleet.node_profile(name, {"engine.max_model_len": 20000}):
        result = fleet.release("--node", name)
    assert result.returncode == 3, result.stdout + result.stderr
    assert "refused before draining" in result.stdout
    assert "is greater than the derived max_model_len (max_position_embeddings=16384" in result.stdout
    assert fleet.invocations(name) == before
    fleet.settled(name)


def test_a_failed_start_quotes_the_engines_last_lines_on_the_stand_in(fleet):
    # The stand-in engine reads its load time from its environment: "never" fails its start after the
    # preflight passed (the preflight does not read it); the engine's own output says why.
    name = "cyan"
    served = fleet.current(name)
    with fleet.node_profile(name, {"engine.environment.FLATSHARE_STANDIN_LOAD_S": "never"}):
        # --no-auto-rollback: the node stays failed, so its own record says why (auto-rollback: test_node_state)
        result = fleet.release("--node", name, "--no-auto-rollback")
    try:
        assert result.returncode == 1, result.stdout + result.stderr
        assert "preflight passed" in result.stdout
        assert "the engine exited during its start" in result.stdout, result.stdout
        said = "FLATSHARE_STANDIN_LOAD_S: must be a number of seconds from 0 to 3600, got 'never'"
        assert said in result.stdout, result.stdout
        record = fleet.history(name)[-1]
        assert (record["result"], record["step"]) == ("failed", "restart-engine")
        assert said in record["reason"]
        # The engine exited: the early end does not wait out its start budget for systemd's restarts of the
        # same command line; the gateway stays stopped and the record says so.
        assert "the engine is still starting" not in result.stdout, result.stdout
        assert "flatshare-gateway.service left stopped" in record["calls"], record
        with connect(fleet.address(name)) as bus:
            assert unit_property(bus, GATEWAY, "Unit", "ActiveState") != "active"
    finally:
        back = fleet.rollback("--node", name)
    assert back.returncode == 0, back.stdout + back.stderr
    assert fleet.current(name) == served
    fleet.settled(name)


def test_serving_check_quotes_a_stopped_engines_last_lines(fleet):
    from flatshare_ops.check.run import run_checks

    name = "peacock"
    log = fleet.node(name).output_dir / f"{ENGINE}.log"
    last = [line for line in log.read_text().splitlines() if line.strip()][-1]
    with connect(fleet.address(name)) as bus:
        run_job(bus, "stop", ENGINE, 30)
    try:
        report = run_checks(fleet.node(name).state_dir, name, fleet.node(name).manager.runtime_dir)
        unit = {f.check: f for f in report.findings}["engine_unit"]
        assert unit.status == "CRITICAL"
        assert any(last in detail and str(log) in detail for detail in unit.details), unit.details
    finally:
        assert fleet.release("--node", name).returncode == 0  # repaired: the node does not serve
    fleet.settled(name)


def test_a_venv_whose_vllm_carries_a_local_label_releases_and_checks_on_the_stand_in(fleet, tmp_path):
    # PEP 440: 0.32.0+cpu is release 0.32.0 with a local label (the real engine's venv says so too).
    from flatshare_ops.sandbox.fleet import make_engine_venv

    name = "cyan"
    synced = fleet.release("--node", name)  # on the checkout's own release first (an earlier case may leave another)
    assert synced.returncode in (0, 4), synced.stdout + synced.stderr
    served = fleet.current(name)
    venv = tmp_path / "engine-venv-cpu"
    make_engine_venv(fleet.node(name), "0.32.0+cpu", venv)
    assert (next(venv.glob("lib/python*/site-packages")) / "vllm-0.32.0+cpu.dist-info/METADATA").is_file()
    with fleet.node_profile(name, {"engine.venv": str(venv)}):
        result = fleet.release("--node", name)
        assert result.returncode == 0, result.stdout + result.stderr
        from flatshare_ops.check.run import run_checks

        report = run_checks(fleet.node(name).state_dir, name, fleet.node(name).manager.runtime_dir)
        found = {f.check: f for f in report.findings}
        assert report.status == "OK", [(f.check, f.status, f.summary) for f in report.findings]
        assert "0.32.0+cpu" in found["vllm_release"].summary
    assert fleet.release("--node", name).returncode == 0  # back to the node's own venv
    assert fleet.current(name) == served
    fleet.settled(name)


def test_a_speculative_draft_model_that_is_not_on_the_node_is_refused_before_any_drain(fleet, tmp_path):
    # vLLM's parser takes any path for the draft model; the engine would fail at start, after the drain.
    name = "cyan"
    synced = fleet.release("--node", name)  # on the checkout's own release first (an earlier case may leave another)
    assert synced.returncode in (0, 4), synced.stdout + synced.stderr
    served, before, start = fleet.current(name), fleet.invocations(name), _log_size(fleet, name)
    draft = tmp_path / "no-such-draft"
    with fleet.node_profile(name, {"engine.speculative.enabled": True, "engine.speculative.model": str(draft)}):
        result = fleet.release("--node", name)
    assert result.returncode == 3, result.stdout + result.stderr  # refused, nothing changed
    assert "refused before draining" in result.stdout, result.stdout
    assert f"the speculative draft model path {draft} does not exist on this node" in result.stdout, result.stdout
    assert fleet.invocations(name) == before and fleet.current(name) == served  # the gateway never stopped
    assert "drained" not in _log_since(fleet, name, start)  # no voice drain began
    fleet.settled(name)
