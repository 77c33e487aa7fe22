"""flatshare release on the sandbox fleet: a journaled, crash-resumable, drained switch, node by node.

A module-scoped fleet is brought up from a scratch copy of the checkout, so
tests can change the profile (decode_hold_tokens 48 <-> 0) and release it.
Every test leaves the fleet healthy, with no journal and no drain file.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import BIN, faults, loopback_pair, run_cli
from node_processes import switch_pids
from release_fleet import ENGINE, HOLD_FLAG, Fleet, sandbox_fleet  # noqa: F401
from flatshare_ops.common.http import wait_for_200
from flatshare_ops.node.drain import DrainError, begin, wait_drained
from flatshare_ops.common.systemd import connect, daemon_reload, run_job, unit_property

ADDRESSES = loopback_pair(3)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    with sandbox_fleet(tmp_path_factory, ADDRESSES) as f:
        yield f


def test_release_of_both_nodes_switches_the_flag_and_passes_serving_check(fleet):
    before = {n: fleet.engine(n)[1] for n in ("cyan", "peacock")}
    hold = next(v for v in ("0", "48", "16") if v not in {fleet.hold(n) for n in ("cyan", "peacock")})
    fleet.set_hold(int(hold))  # a change for both nodes, whatever the checkout's profile holds
    result = fleet.release("--all")
    assert result.returncode == 0, result.stdout + result.stderr
    for name in ("cyan", "peacock"):
        assert fleet.current(name) == fleet.expected_id(name)
        assert fleet.hold(name) == hold
        assert fleet.engine(name)[1] != before[name], "the engine was not restarted"
        assert fleet.history(name)[-1]["result"] == "released"
        assert run_cli("--state-dir", str(fleet.node(name).state_dir), "--runtime-dir",
                       str(fleet.node(name).manager.runtime_dir), program="serving-check").returncode == 0
        fleet.settled(name)
    assert "cyan: released" in result.stdout and "peacock: released" in result.stdout
    # The other node was asked, while cyan held its lock, before cyan was drained.
    assert "peacock: takes calls, no release holds it (must stay so while cyan drains)" in result.stdout


def test_a_second_release_of_the_same_checkout_has_nothing_to_do(fleet):
    for dry in ((), ("--dry-run",)):
        result = fleet.release("--node", "cyan", *dry)
        assert result.returncode == 4, result.stdout
        said = [line.split("] ", 1)[-1] for line in result.stdout.splitlines() if line.startswith("[cyan ")]
        # Its last words are that it has nothing to do: the go-ahead it still asks (the retry guard's) is not said.
        assert said[-1].startswith("cyan: already on") and said[-1].endswith("; nothing to do"), result.stdout


def test_dry_run_prints_the_plan_and_changes_nothing(fleet):
    fleet.set_hold(48 if fleet.hold("cyan") == "0" else 0)
    before = (fleet.current("cyan"), fleet.engine("cyan")[1])
    result = fleet.release("--node", "cyan", "--dry-run")
    assert result.returncode == 0, result.stdout
    assert "flatshare-engine.service: restart" in result.stdout
    assert "flatshare.target: unchanged" in result.stdout
    new = "48" if fleet.hold("cyan") == "0" else "0"
    assert f"{HOLD_FLAG}: {fleet.hold('cyan')} -> {new}" in result.stdout
    assert (fleet.current("cyan"), fleet.engine("cyan")[1]) == before
    assert not fleet.journal("cyan").exists()


def _crash_then_finish(fleet: Fleet, step: str) -> None:
    name = "cyan"
    fleet.set_hold(48 if fleet.hold(name) == "0" else 0)
    expected_hold = "48" if fleet.hold(name) == "0" else "0"
    before_invocation = fleet.engine(name)[1]
    killed = fleet.local_release(name, env=faults(kill_after_step=step))
    assert "the node-side command ended without its outcome" in killed.stdout, killed.stdout + killed.stderr
    if step != "record-history":
        journal = json.loads(fleet.journal(name).read_text())
        assert {s["name"]: s["state"] for s in journal["steps"]}[step] == "done"
        finished = fleet.local_release(name)
        assert finished.returncode == 0, finished.stdout + finished.stderr
        assert "finishing an interrupted switch" in finished.stdout
    else:
        assert fleet.local_release(name).returncode == 4
    # The same end state as an uninterrupted release.
    expected = fleet.expected_id(name)
    assert fleet.current(name) == expected
    release_units = fleet.node(name).state_dir / "releases" / expected / "units"
    for unit in release_units.iterdir():
        assert (fleet.node(name).manager.unit_dir / unit.name).read_text() == unit.read_text()
    assert fleet.hold(name) == expected_hold
    assert fleet.engine(name)[1] != before_invocation
    last = fleet.history(name)[-1]
    assert (last["target"], last["after"], last["result"], last["served"]) == (expected, expected, "released", True)
    fleet.settled(name)


@pytest.mark.xdist_group("test_release_crashes")  # on a fleet of its own, apart from the rest of the module
@pytest.mark.parametrize("step", ["drain-voice", "stop-gateway", "install-units", "restart-engine", "start-gateway",
                                  "end-voice-drain", "switch-current", "serving-check", "record-history"])
def test_release_killed_after_each_step_is_finished_by_the_next_run(fleet, step):
    _crash_then_finish(fleet, step)


def test_a_dropped_ssh_session_does_not_stop_the_release_on_the_node(fleet):
    name = "peacock"
    fleet.set_hold(48 if fleet.hold(name) == "0" else 0)
    expected = fleet.expected_id(name)
    log = fleet.node(name).state_dir / "releases/release.log"
    start = log.stat().st_size if log.exists() else 0
    operator = subprocess.Popen(
        [str(BIN / "flatshare"), "release", "--node", name, "--inventory", str(fleet.inventory),
         "--root", str(fleet.checkout)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if log.exists() and re.search(r"step \d+/\d+ restart-engine", log.read_text()[start:]):
            break
        time.sleep(0.05)
    operator.kill()  # the operator's client dies: its SSH connection drops mid-release
    operator.wait()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (fleet.history(name) and fleet.history(name)[-1]["target"] == expected):
        time.sleep(0.1)
    assert fleet.history(name)[-1]["result"] == "released"
    # The node says so in its log once the history record is written (right after it: wait for the line).
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and f"{name}: released {expected}" not in log.read_text()[start:]:
        time.sleep(0.05)
    text = log.read_text()[start:]
    total = int(re.search(r"step 1/(\d+) ", text).group(1))
    for number in range(1, total + 1):
        assert f"step {number}/{total}" in text
    assert f"{name}: released {expected}" in text
    fleet.settled(name)


def test_a_closed_stdout_does_not_stop_a_release(fleet):
    name = "cyan"
    fleet.set_hold(48 if fleet.hold(name) == "0" else 0)
    expected = fleet.expected_id(name)
    process = subprocess.Popen(
        [str(BIN / "flatshare"), "release", "--inventory", str(fleet.inventory), "--root", str(fleet.checkout)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "FLATSHARE_NODE": name})
    process.stdout.readline()
    process.stdout.close()  # the reader goes away: later writes get EPIPE
    assert process.wait(timeout=120) == 0, process.stderr.read().decode()
    assert fleet.current(name) == expected
    assert "Traceback" not in process.stderr.read().decode()
    fleet.settled(name)


def test_a_second_release_at_once_is_refused_with_the_first_ones_details(fleet):
    name = "cyan"
    fleet.set_hold(48 if fleet.hold(name) == "0" else 0)
    node = fleet.node(name)
    # A call in progress keeps the first release waiting in its voice drain: 15 s, inside the sandbox's voice
    # drain_timeout_s (20), and long enough for the second release's start on a loaded machine (with 6 s, a
    # loaded CI run saw the first release end before the second asked: "nothing to do").
    import urllib.request

    urllib.request.urlopen(urllib.request.Request(
        f"http://{node.address}:8090/calls/start?seconds=15&turns=1", method="POST", data=b""), timeout=5).read()
    first = subprocess.Popen(
        [str(BIN / "flatshare"), "release", "--inventory", str(fleet.inventory), "--root", str(fleet.checkout)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "FLATSHARE_NODE": name})
    holder = node.state_dir / "releases/lock.json"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not holder.exists():
        time.sleep(0.02)
    # The first release's node-side switch, as the kernel's process table shows it while it holds the lock
    # (read now: the first release may have ended by the time the second has said why it was refused).
    switches = switch_pids(node.state_dir)
    assert len(switches) == 1, switches
    second = fleet.local_release(name)
    assert second.returncode == 3, second.stdout
    match = re.search(rf"release refused: {name} is being released by \S+ pid (\d+)\b", second.stdout)
    assert match, second.stdout
    assert int(match.group(1)) == switches[0], (switches, second.stdout)
    out, err = first.communicate(timeout=120)
    assert first.returncode == 0, out + err
    fleet.settled(name)


def _link_e2_drop_in(fleet: Fleet, name: str, point: int = 7, link_name: str = "e2-point.conf",
                     reload: bool = True) -> tuple[Path, Path]:
    """Link a benchmark point's drop-in into the engine unit, as the benchmark tool does (a symlink)."""
    node = fleet.node(name)
    target = node.root / f"bench/e2/point-{point}.conf"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(f'[Service]\nEnvironment="E2_POINT={point}"\n')
    link = node.manager.unit_dir / f"{ENGINE}.d/{link_name}"
    link.parent.mkdir(exist_ok=True)
    link.symlink_to(target)
    if reload:
        with connect(fleet.address(name)) as bus:
            daemon_reload(bus)
    return link, target


def test_e2_drop_ins_refuse_a_release_and_force_releases_and_records_it(fleet):
    name = "cyan"
    fleet.set_hold(48 if fleet.hold(name) == "0" else 0)
    link, target = _link_e2_drop_in(fleet, name)
    try:
        before = fleet.current(name)
        refused = fleet.release("--node", name)
        assert refused.returncode == 3
        assert f"release refused: {name} has E2 drop-ins linked: {ENGINE}.d/e2-point.conf -> {target}" in refused.stdout
        assert "flatshare-bench e2 reset" in refused.stdout and "--force" in refused.stdout
        assert fleet.current(name) == before and not fleet.journal(name).exists()

        forced = fleet.release("--node", name, "--force")
        assert forced.returncode == 0, forced.stdout
        assert fleet.current(name) == fleet.expected_id(name)
        assert fleet.history(name)[-1]["forced"] is True
    finally:
        link.unlink()
        with connect(fleet.address(name)) as bus:
            daemon_reload(bus)
            run_job(bus, "restart", ENGINE, 60)
    assert wait_for_200(f"http://{fleet.node(name).address}:8000/health", 30) == 200
    fleet.settled(name)


def test_a_stale_voice_status_is_not_trusted(tmp_path):
    drain_file, status_file = tmp_path / "voice.drain", tmp_path / "voice.status"
    drain = begin(drain_file, status_file)
    assert drain_file.read_text().strip() == drain.drain_id
    # Left from an earlier drain: another id, and written before this drain began.
    status_file.write_text(json.dumps({"state": "drained", "drain_id": "earlier", "written_at": time.time()}))
    with pytest.raises(DrainError):
        wait_drained(drain, 0.5)
    status_file.write_text(json.dumps({"state": "drained", "drain_id": drain.drain_id, "written_at": drain.began_at - 1}))
    with pytest.raises(DrainError):
        wait_drained(drain, 0.5)
    status_file.write_text(json.dumps({"state": "drained", "drain_id": drain.drain_id, "written_at": time.time()}))
    assert wait_drained(drain, 0.5)["state"] == "drained"


def test_a_drain_that_times_out_removes_the_drain_file_and_keeps_the_journal(fleet):
    name = "peacock"
    node = fleet.node(name)
    profile = node.profile
    original = profile.read_text()
    profile.write_text(original.replace("drain_timeout_s = 20", "drain_timeout_s = 2"))
    fleet.set_hold(48 if fleet.hold(name) == "0" else 0)
    # The worker stays active (a stopped one has no calls to drain and is not waited for) but is frozen:
    # it will never confirm the drain.
    with connect(fleet.address(name)) as bus:
        worker = unit_property(bus, "flatshare-voice.service", "Service", "MainPID")
    stale = {"schema": 1, "state": "drained", "drain_id": "earlier", "written_at": time.time(), "calls_in_progress": 0}
    (node.run_dir / "voice.status").write_text(json.dumps(stale))
    os.kill(worker, signal.SIGSTOP)
    try:
        result = fleet.release("--node", name)
        assert result.returncode == 1, result.stdout
        assert re.search(r"step 1/\d+ drain-voice failed", result.stdout), result.stdout
        assert "next 'flatshare release' finishes" in result.stdout
        assert not fleet.drain_file(name).exists(), "an early end must remove the drain file"
        journal = json.loads(fleet.journal(name).read_text())
        assert journal["steps"][0] == {**journal["steps"][0], "name": "drain-voice", "state": "failed"}
    finally:
        os.kill(worker, signal.SIGCONT)
        profile.write_text(original)
    finished = fleet.release("--node", name)
    assert finished.returncode == 0, finished.stdout
    fleet.settled(name)


def test_rollback_returns_to_the_previous_release(fleet):
    name = "peacock"
    previous = fleet.current(name)
    previous_hold = fleet.hold(name)
    fleet.set_hold(48 if previous_hold == "0" else 0)
    assert fleet.release("--node", name).returncode == 0
    assert fleet.current(name) != previous
    result = run_cli("rollback", "--node", name, "--inventory", str(fleet.inventory), "--root", str(fleet.checkout))
    assert result.returncode == 0, result.stdout
    assert fleet.current(name) == previous
    assert fleet.hold(name) == previous_hold
    fleet.settled(name)


@pytest.mark.parametrize("text", ['{"schema": 1, "from": "a", "to": "b", "steps": [{"na', "", "[]", '{"schema": 9}'])
def test_a_corrupt_journal_is_a_clear_error(fleet, text):
    name = "cyan"
    fleet.journal(name).write_text(text)
    try:
        before = fleet.current(name)
        result = fleet.release("--node", name)
        assert result.returncode == 5, result.stdout  # damaged node state
        # The node's one line, and the run's last line for the node saying the same reason.
        lines = [line for line in result.stdout.splitlines() if "switching.json" in line]
        node_lines = [line for line in lines if line.startswith(f"[{name} ")]
        assert len(node_lines) == 1 and "corrupt or truncated journal" in node_lines[0] and "mv " in node_lines[0]
        assert lines[-1].startswith(f"{name}: ") and "corrupt or truncated journal" in lines[-1], result.stdout
        assert len(lines) == 2, result.stdout
        assert "Traceback" not in result.stdout + result.stderr
        assert fleet.current(name) == before
    finally:
        fleet.journal(name).unlink()


def test_status_and_history_over_ssh(fleet):
    result = run_cli("status", "--inventory", str(fleet.inventory), "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert {n: r["release"] for n, r in report.items()} == {n: fleet.current(n) for n in ("cyan", "peacock")}
    assert all(r["switching"] is None for r in report.values())
    history = run_cli("releases", "--node", "cyan", "--inventory", str(fleet.inventory))
    assert history.returncode == 0 and "released" in history.stdout


def test_a_drifted_checkout_is_refused(fleet):
    unit = fleet.checkout / "units/flatshare-voice.service"
    original = unit.read_text()
    unit.write_text(original + "# hand edit\n")
    try:
        result = fleet.release("--node", "cyan")
        assert result.returncode == 3
        assert "rendered files drifted from the profile (units/flatshare-voice.service)" in result.stderr
    finally:
        unit.write_text(original)


@pytest.mark.parametrize("bundle, message", [
    ({"id": "../../etc", "files": {"serving.json": "{}"}}, "is not a plain name"),
    ({"id": "ok-1", "files": {"units/../../x.service": ""}}, "is not serving.json, profile.json or units/UNIT"),
    ({"id": "ok-1", "files": {"units/x.service": ""}}, "has no serving.json"),
    ([], "must be"),
])
def test_node_switch_refuses_a_malformed_bundle_before_writing(tmp_path, bundle, message):
    result = subprocess.run(
        [str(BIN / "flatshare-node"), "switch", "--node", "n", "--state-dir", str(tmp_path), "--scope", "user",
         "--runtime-dir", str(tmp_path / "run")],
        input=json.dumps(bundle) + "\n", capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stdout
    assert [p for p in tmp_path.rglob("*")] == []  # refused before anything was written


def test_a_batch_that_would_drain_every_node_is_refused(fleet):
    result = fleet.release("--all", "--batch-size", "2")
    assert result.returncode == 2
    assert ("batches of 2 would drain more than 1 of 2 nodes at once (min_serving 1); use at most 1 (--batch-size, "
            "or the inventory's rollout.batch)") in result.stderr, result.stderr


def test_all_and_node_together_are_bad_input(fleet):
    result = fleet.release("--all", "--node", "cyan")
    assert result.returncode == 2 and "not both" in result.stderr


def test_a_node_is_not_drained_while_the_other_is_being_released(fleet):
    from filelock import FileLock

    fleet.set_hold(48 if fleet.hold("cyan") == "0" else 0)
    lock = FileLock(str(fleet.node("peacock").state_dir / "releases/.lock"))
    lock.acquire(timeout=0)  # what a release on peacock holds, as the kernel's lock table shows it
    try:
        before = fleet.current("cyan")
        result = fleet.release("--node", "cyan")
        assert result.returncode == 3, result.stdout
        assert f"peacock: being released by pid {os.getpid()}, whose record lock.json is missing" in result.stdout
        assert "cyan may not drain now" in result.stdout
        assert fleet.current("cyan") == before
    finally:
        lock.release()
    fleet.settled("cyan")


def test_a_node_is_not_drained_while_the_other_takes_no_calls(fleet):
    fleet.set_hold(48 if fleet.hold("cyan") == "0" else 0)
    with connect(fleet.address("peacock")) as bus:
        run_job(bus, "stop", "flatshare-gateway.service", 30)
    try:
        result = fleet.release("--node", "cyan")
        assert result.returncode == 3, result.stdout
        assert "peacock: does not take calls (flatshare-gateway.service is inactive)" in result.stdout
    finally:
        with connect(fleet.address("peacock")) as bus:
            run_job(bus, "start", "flatshare-gateway.service", 30)
    fleet.settled("peacock")


def test_rollback_abandons_an_interrupted_switch(fleet):
    name = "cyan"
    before = fleet.current(name)
    before_hold = fleet.hold(name)
    fleet.set_hold(48 if before_hold == "0" else 0)
    killed = fleet.local_release(name, env=faults(kill_after_step="install-units"))
    assert "the node-side command ended without its outcome" in killed.stdout, killed.stdout
    assert fleet.journal(name).exists()
    result = run_cli("rollback", "--inventory", str(fleet.inventory), "--root", str(fleet.checkout),
                     env={"FLATSHARE_NODE": name})
    assert result.returncode == 0, result.stdout
    assert "abandoning the interrupted switch" in result.stdout
    assert fleet.current(name) == before and fleet.hold(name) == before_hold
    results = [r["result"] for r in fleet.history(name)[-2:]]
    assert results == ["abandoned", "rolled back"]
    assert fleet.history(name)[-1]["kind"] == "rollback"
    fleet.settled(name)
    # Bring the node to the checkout's release again for the tests after this one.
    assert fleet.release("--node", name).returncode == 0
    fleet.settled(name)


def test_a_release_repairs_a_node_already_on_its_release_that_does_not_serve(fleet):
    name = "peacock"
    assert fleet.release("--node", name).returncode in (0, 4)
    with connect(fleet.address(name)) as bus:
        run_job(bus, "stop", ENGINE, 30)
    result = fleet.release("--node", name)
    assert result.returncode == 0, result.stdout
    assert "but it does not serve" in result.stdout and "switching again to repair it" in result.stdout
    assert (fleet.history(name)[-1]["kind"], fleet.history(name)[-1]["result"]) == ("repair", "repaired")
    fleet.settled(name)


def test_an_e2_drop_in_linked_without_a_reload_is_refused_and_shown_by_a_dry_run(fleet):
    name = "cyan"
    fleet.set_hold(48 if fleet.hold(name) == "0" else 0)
    # No daemon-reload: systemd does not list it yet.
    link, target = _link_e2_drop_in(fleet, name, point=8, link_name="e2-late.conf", reload=False)
    try:
        dry = fleet.release("--node", name, "--dry-run")
        assert dry.returncode == 3 and f"{ENGINE}.d/e2-late.conf -> {target}" in dry.stdout
        refused = fleet.release("--node", name)
        assert refused.returncode == 3 and "E2 drop-ins linked" in refused.stdout
        # The run's last line for the node says why, not only "refused" (a breaker's single-node case).
        said = [line for line in refused.stdout.splitlines() if line.startswith(f"{name}: refused")]
        assert said and "E2 drop-ins linked" in said[-1], refused.stdout
    finally:
        link.unlink()
    fleet.settled(name)


def test_with_all_a_node_with_nothing_to_do_needs_no_gate_and_the_broken_one_is_repaired(fleet):
    assert fleet.release("--all").returncode in (0, 4)
    with connect(fleet.address("peacock")) as bus:
        run_job(bus, "stop", "flatshare-gateway.service", 30)
    dry = fleet.release("--all", "--dry-run")
    assert re.search(r"^\[cyan [0-9:]+\] cyan: already on", dry.stdout, re.MULTILINE) and "cyan: nothing to do" in dry.stdout, dry.stdout
    assert "peacock: does not take calls now" in dry.stdout and "no admission needed" in dry.stdout
    result = fleet.release("--all")
    assert result.returncode == 0, result.stdout
    assert "cyan: nothing to do" in result.stdout and "switching again to repair it" in result.stdout
    for name in ("cyan", "peacock"):
        fleet.settled(name)


def test_a_bug_before_any_step_is_one_line_and_its_traceback_is_kept_in_the_log(fleet):
    name = "cyan"
    fleet.set_hold(48 if fleet.hold(name) == "0" else 0)
    result = fleet.local_release(name, env=faults(bug_in_plan=True))
    out = result.stdout + result.stderr
    assert result.returncode == 1 and "Traceback" not in out, out
    assert "unexpected RuntimeError: injected bug (a bug in flatshare-ops; the traceback is in" in out, out
    log = (fleet.node(name).state_dir / "releases/release.log").read_text()
    assert "Traceback (most recent call last)" in log and "RuntimeError: injected bug" in log
    assert fleet.release("--node", name).returncode == 0  # the node is fine: the next release goes ahead
    fleet.settled(name)


def _new_hold(fleet) -> int:
    """A decode_hold_tokens value neither node runs: a release that switches both."""
    return next(v for v in (0, 48, 16, 8) if str(v) not in {fleet.hold(n) for n in ("cyan", "peacock")})


def test_json_is_one_document_on_stdout_and_the_summary_says_what_each_node_history_says(fleet):
    """`release --json`: stdout is one JSON document (people's lines on stderr); its summary of each node agrees
    with what the node recorded (history.jsonl) and with the step table's timings being inside the switch."""
    before = {n: fleet.current(n) for n in ("cyan", "peacock")}
    fleet.set_hold(_new_hold(fleet))
    result = fleet.release("--all", "--analysis", "skip", "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads(result.stdout)  # the whole of stdout: one document, nothing else
    assert "[cyan " in result.stderr and "rollout " in result.stderr, result.stderr
    assert summary["code"] == 0 and summary["mode"] == "release" and summary["dry_run"] is False, summary
    assert list(summary["nodes"]) == ["cyan", "peacock"], summary
    for name, entry in summary["nodes"].items():
        record = fleet.history(name)[-1]  # the node's own record of the switch: an independent source
        assert (entry["from"], entry["to"]) == (before[name], fleet.current(name)) == (record["before"],
                                                                                        record["target"]), entry
        assert entry["result"] == record["result"] == "released" and entry["switch"] == record["switch"], entry
        assert entry["code"] == 0 and entry["commit"] == record.get("commit"), (entry, record)
        # The engine's restart is inside the drain, which is inside the node's switch, inside the node's time.
        assert 0 < entry["engine_start_s"] < entry["drained_s"] <= record["duration_s"] <= entry["duration_s"], \
            (entry, record)
    assert summary["duration_s"] >= sum(e["duration_s"] for e in summary["nodes"].values()), summary
    fleet.settled("cyan")
    fleet.settled("peacock")


def test_a_dry_run_with_json_gives_each_nodes_plan_as_data(fleet):
    fleet.set_hold(_new_hold(fleet))
    result = fleet.release("--all", "--dry-run", "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads(result.stdout)
    for name, entry in summary["nodes"].items():
        plan = entry["plan"]
        assert (plan["node"], plan["from_id"], plan["to_id"]) == (name, fleet.current(name), fleet.expected_id(name))
        assert "restart-engine" in plan["steps"] and plan["drains"] is True, plan
        assert any(change.startswith(HOLD_FLAG) for change in plan["flag_changes"]), plan
        assert entry["result"] == "planned (dry run)" and fleet.current(name) == plan["from_id"], entry
    fleet.release("--all", "--analysis", "skip")  # both on the checkout's release again


def _with_silence_bound(fleet, seconds: int):
    """The fleet's inventory with ``[transport] silence_s`` set (the node's progress cadence is a third of it)."""
    import tomlkit

    path = fleet.inventory
    saved = path.read_bytes()
    doc = tomlkit.parse(saved.decode())
    doc.setdefault("transport", tomlkit.table())["silence_s"] = seconds
    path.write_text(tomlkit.dumps(doc))
    return saved


def test_on_a_terminal_an_engine_start_is_one_live_line_quoting_the_engine_and_piped_it_is_plain_lines(fleet):
    """On a pseudo-terminal the engine start's waits are drawn in place (carriage return, erase line) quoting the
    engine's latest output line; piped, the same run prints plain lines with no control characters."""
    import pty

    saved = _with_silence_bound(fleet, 3)  # progress every second
    log = fleet.node("cyan").root / "var/log/flatshare/flatshare-engine.service.log"
    try:
        with fleet.node_profile("cyan", {"engine.environment.FLATSHARE_STANDIN_LOAD_S": "5"}):
            fleet.set_hold(_new_hold(fleet))
            leader, follower = pty.openpty()
            env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "FLATSHARE_NODE")}
            process = subprocess.Popen(
                [str(BIN / "flatshare"), "release", "--node", "cyan", "--inventory", str(fleet.inventory),
                 "--root", str(fleet.checkout)], stdin=subprocess.DEVNULL, stdout=follower, stderr=follower,
                env={**env, "TERM": "xterm", "COLUMNS": "300"})
            os.close(follower)
            seen = b""
            while True:
                try:
                    chunk = os.read(leader, 65536)
                except OSError:  # EIO: the process closed the terminal
                    break
                if not chunk:
                    break
                seen += chunk
            assert process.wait(120) == 0, seen.decode(errors="replace")
            os.close(leader)
            text = seen.decode(errors="replace")
            quoted = re.findall(r"\r\x1b\[K\[cyan [0-9:]+\]\s+still waiting for \S+ to answer 200 \(\d+ s of \d+ s\); "
                                r"the engine's latest line: ([^\r\n]*)", text)
            assert quoted, text
            engine_lines = log.read_text().splitlines()  # what the engine wrote: the node's own output file
            assert all(line.rstrip("…").strip() and any(e.startswith(line.rstrip("…").strip()) for e in engine_lines)
                       for line in quoted), (quoted, engine_lines[-5:])
            # Each status line is replaced in place (erased by the next one): none ends a line of its own.
            assert not re.search(r"still waiting for [^\r\n]*\n", text.replace("\r\n", "\n")), text

            fleet.set_hold(_new_hold(fleet))
            piped = fleet.release("--node", "cyan")
            assert piped.returncode == 0, piped.stdout + piped.stderr
            assert "\x1b" not in piped.stdout + piped.stderr and "\r" not in piped.stdout + piped.stderr
            assert re.search(r"^\[cyan [0-9:]+\]\s+still waiting for .*; the engine's latest line: ", piped.stdout,
                             re.MULTILINE), piped.stdout
    finally:
        fleet.inventory.write_bytes(saved)
    fleet.release("--all", "--analysis", "skip")
    fleet.settled("cyan")
