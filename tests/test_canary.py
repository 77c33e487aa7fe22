"""A rollout's canary is judged by its engine's own metrics before the next batch switches (issue 17).

On the sandbox (stand-in engines, this module's own addresses), with calls streaming through both gateways
(the sandbox's caller, two numbers each, in both orders, so that the canary and the baseline both serve).
The stand-in engine serves vLLM 0.32.0's series and buckets, and its time to first token is chosen through
its environment (docs/reference/stand-ins.md). The truth: each node's history (what the node recorded),
the engine's command line in /proc, and the exit code the README names.

Each class of analysis runs here once on real nodes; the analysis's loop and its rules, case by case, run on a
fake clock in tests/test_canary_clock.py (in ``make check``). Moved there, asserting what they asserted of the
analysis (the rollout's part is its class's case here): a canary worse than its baseline under the fixed
threshold (class: a failing analysis, the time to first token case), an inconclusive analysis whose profile says
"pass" or "fail" (class: "pause", kept), an empty metrics page (class: a malformed one, kept).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import BIN, calls_through_both, loopback_pair, scratch_sandbox

from flatshare_ops.sandbox.fleet import SandboxNode
from flatshare_ops.common.systemd import ManagerAddress, connect, unit_property

ADDRESSES = loopback_pair(82)
NODES = ("cyan", "peacock")
ENGINE = "flatshare-engine.service"
HOLD_FLAG = "--additional-config.make_room.decode_hold_tokens"
#: Short measurements (the profile's values are minutes of calls).
def _rows(text: str) -> list[str]:
    """The canary analysis table's rows in a rollout's output (``  1/3  cyan  12:00:00-12:00:02Z  pass ...``)."""
    return [line.strip() for line in text.splitlines() if re.match(r"\s+\d+/\d+\s", line)]


FAST_ANALYSIS = {"interval_s": 1.5, "count": 3, "min_requests": 4, "failure_limit": 0, "inconclusive_limit": 0}
#: For the tests whose subject is not latency: thresholds no stand-in's time to first token reaches on a busy
#: machine (10 s, a vLLM bucket bound; 10 s over the baseline). With the profile's (0.5 s; 1.5 x the baseline's
#: p95 + 0.1 s) a canary stand-in slowed by the suite's other processes failed a harmless release in CI.
CALM_ANALYSIS = {**FAST_ANALYSIS, "ttft_p95_max_s": 10, "baseline_margin_s": 10}


class Fleet:
    _fresh: int  # the last hold value rendered fresh (set at the first render; see below)

    def __init__(self, checkout: Path, base: Path) -> None:
        self.checkout, self.base = checkout, base
        self.inventory = base / "fleet.toml"

    def node(self, name: str) -> SandboxNode:
        return SandboxNode(name, ADDRESSES[name], self.base)

    @staticmethod
    def operator_env() -> dict[str, str]:
        """The test's environment without what would pick another node or fleet."""
        return {k: v for k, v in os.environ.items() if k not in ("FLATSHARE_NODE", "FLATSHARE_INVENTORY")}

    def cli(self, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
        return subprocess.run([str(BIN / "flatshare"), *args, "--inventory", str(self.inventory), "--root",
                               str(self.checkout)], capture_output=True, text=True, env=self.operator_env(),
                              timeout=timeout)

    def hold_command(self, *args: str) -> subprocess.CompletedProcess:
        """``flatshare hold ...`` (an operator's hold, not make-room's) on this fleet."""
        return subprocess.run([str(BIN / "flatshare"), "hold", *args, "--inventory", str(self.inventory)],
                              capture_output=True, text=True, env=self.operator_env(), timeout=120)

    def release_reading(self, on_line) -> tuple[int, str]:
        """``flatshare release --all``, ``on_line(line)`` called on each line of its output as it comes (to act
        while it runs); returns its exit code and its whole output."""
        running, lines = self.popen_release(), []
        assert running.stdout is not None  # stdout=PIPE
        for line in running.stdout:
            lines.append(line)
            on_line(line)
        running.wait(240)
        return running.returncode, "".join(lines)

    def popen_release(self) -> subprocess.Popen:
        """``flatshare release --all`` started, for the test to read its lines (stdout and stderr) as they come."""
        return subprocess.Popen([str(BIN / "flatshare"), "release", "--all", "--inventory", str(self.inventory),
                                 "--root", str(self.checkout)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env=self.operator_env())

    def history(self, name: str) -> list[dict]:
        path = self.node(name).state_dir / "releases/history.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []

    def current(self, name: str) -> str:
        return os.readlink(self.node(name).state_dir / "releases/current")

    def engine_env(self, name: str) -> dict[str, str]:
        """The running engine's environment, from /proc (the truth of what it runs with)."""
        with connect(ManagerAddress("user", self.node(name).manager.runtime_dir)) as bus:
            pid = unit_property(bus, ENGINE, "Service", "MainPID")
        raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        return dict(item.decode().split("=", 1) for item in raw if b"=" in item)

    def hold(self) -> int:
        text = (self.checkout / "profiles/rtx-5060-ti-serve.toml").read_text()
        found = re.search(r"(?m)^decode_hold_tokens = (\d+)", text)
        assert found is not None, "the profile sets no decode_hold_tokens"
        return int(found.group(1))

    def running_hold(self, name: str) -> int:
        """decode_hold_tokens in the node's running engine's command line (/proc)."""
        with connect(ManagerAddress("user", self.node(name).manager.runtime_dir)) as bus:
            pid = unit_property(bus, ENGINE, "Service", "MainPID")
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        return int(argv[argv.index(HOLD_FLAG) + 1])

    def new_hold(self) -> None:
        """The checkout renders a release neither node runs (relative to what the profile and the engines hold)."""
        # A value never asked for before in this module: a release that failed and was taken back is refused
        # until --retry (control/rollout.py), so no test may render one an earlier test's canary failed.
        taken = {self.hold(), *(self.running_hold(n) for n in NODES)}
        Fleet._fresh = getattr(Fleet, "_fresh", 100)
        value = next(v for v in range(Fleet._fresh + 1, Fleet._fresh + 10) if v not in taken)
        Fleet._fresh = value
        result = subprocess.run([str(BIN / "flatshare"), "profiles", "set", "engine.make_room.decode_hold_tokens",
                                 str(value), "--root", str(self.checkout)], capture_output=True, text=True)
        assert result.returncode == 0, result.stdout + result.stderr

    @contextmanager
    def node_profile(self, name: str, env: dict[str, str] | None = None, analysis: dict | None = None,
                     golden: dict | None = None):
        """The node's own profile with engine environment, [release.analysis] and [release.analysis.golden]
        values, restored after."""
        path = self.node(name).profile
        original = path.read_text()
        text = original
        if env:
            lines = "".join(f'{k} = "{v}"\n' for k, v in env.items())
            text = text.replace("[engine.environment]\n", "[engine.environment]\n" + lines, 1)
            assert text != original, f"{path} has no [engine.environment] table"
        if analysis:
            text += "\n[release.analysis]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in analysis.items())
        if golden:
            text += "\n[release.analysis.golden]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in golden.items())
        path.write_text(text)
        try:
            yield
        finally:
            path.write_text(original)

    def calls(self):
        """Calls streaming through both gateways while the block runs (each caller dials both numbers)."""
        return calls_through_both(ADDRESSES, concurrency=2, tokens=4, timeout_s=30, join_s=60)

    def settled(self, name: str) -> None:
        releases = self.node(name).state_dir / "releases"
        assert not (releases / "switching.json").exists()
        assert not (self.node(name).run_dir / "voice.drain").exists()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    with scratch_sandbox(tmp_path_factory, "canary", ADDRESSES, canaries=True) as (_, checkout, base):
        f = Fleet(checkout, base)
        synced = f.cli("release", "--all", "--analysis", "skip")
        assert synced.returncode in (0, 4), synced.stdout + synced.stderr
        yield f


def _since(fleet: Fleet, name: str, start: int) -> list[tuple]:
    return [(r["result"], r.get("target")) for r in fleet.history(name)[start:]]


def _first_judged(analysis: dict) -> tuple[int, dict]:
    """The analysis's first measurement that judged the canary, with its index: windows of 1.5 s on a loaded
    machine may see fewer calls than min_requests, and such a window before it must be inconclusive (never a pass)."""
    measurements = analysis["measurements"]
    index = next(i for i, m in enumerate(measurements) if m["verdict"] != "inconclusive")
    assert all(m["verdict"] == "inconclusive" for m in measurements[:index]), measurements
    return index, measurements[index]


def test_a_canary_whose_time_to_first_token_is_worse_fails_its_analysis_and_rolls_back_alone(fleet):
    # cyan's new release makes each first token take 0.6 s: over the profile's 0.5 s, and over the baseline's.
    left = {n: fleet.current(n) for n in NODES}
    start = {n: len(fleet.history(n)) for n in NODES}
    fleet.new_hold()
    with fleet.node_profile("cyan", env={"FLATSHARE_STANDIN_TTFT_S": "0.6"}, analysis=FAST_ANALYSIS), fleet.calls():
        result = fleet.cli("release", "--all", "--json")
    text = result.stdout + result.stderr
    assert result.returncode == 10, text  # the canary analysis failed (README, "Exit codes")
    assert "Traceback" not in text
    document = json.loads(result.stdout)
    (analysis,) = document["analyses"]
    assert analysis["canary"] == "cyan" and analysis["baseline"] == "peacock" and analysis["phase"] == "failed"
    index, judged = _first_judged(analysis)
    # With --json the lines for people are on stderr, the document alone on stdout.
    assert re.search(rf"^\s+{index + 1}/3\s+cyan\s+\S+\s+fail\s.*ttft_p95_max_s", result.stderr, re.MULTILINE), text
    rules = {c["rule"]: c["verdict"] for c in judged["checks"]}
    assert rules.get("ttft_p95_max_s") == "fail" and rules.get("baseline") == "fail", rules
    # cyan: released, analysed, rolled back to what it left; peacock never switched.
    assert [r for r, _ in _since(fleet, "cyan", start["cyan"])] == ["released", "analysed", "rolled back"]
    assert fleet.current("cyan") == left["cyan"] and "FLATSHARE_STANDIN_TTFT_S" not in fleet.engine_env("cyan")
    assert _since(fleet, "peacock", start["peacock"]) == [] and fleet.current("peacock") == left["peacock"]
    recorded = fleet.history("cyan")[start["cyan"] + 1]["analysis"]
    assert recorded["phase"] == "failed" and len(recorded["measurements"]) >= 1
    # `flatshare releases` gives the analysis back: each measurement's line as the rollout printed it, and whole
    # as JSON (what history.jsonl on the node holds, read here from the file).
    printed = _rows(result.stderr)  # --json: on stderr
    shown = subprocess.run([str(BIN / "flatshare"), "releases", "--node", "cyan", "--measurements",
                            "--inventory", str(fleet.inventory)], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert [line.strip() for line in shown.stdout.splitlines() if line.startswith("    ")][-len(printed):] == printed
    as_json = subprocess.run([str(BIN / "flatshare"), "releases", "--node", "cyan", "--json",
                              "--inventory", str(fleet.inventory)], capture_output=True, text=True, timeout=120)
    assert as_json.returncode == 0, as_json.stdout + as_json.stderr
    assert json.loads(as_json.stdout)["cyan"]["records"][-2]["analysis"] == recorded
    for name in NODES:
        fleet.settled(name)


def test_with_no_calls_the_analysis_is_inconclusive_and_pauses_as_the_profile_says(fleet):
    # The profile's "pass" and "fail": tests/test_canary_clock.py.
    start = {n: len(fleet.history(n)) for n in NODES}
    fleet.new_hold()
    with fleet.node_profile("cyan", analysis={**CALM_ANALYSIS, "inconclusive": "pause"}):
        result = fleet.cli("release", "--all")
    text = result.stdout + result.stderr
    assert result.returncode == 11, text
    assert re.search(r"^\s+1/3\s+cyan\s+\S+\s+inconclusive\s.*min_requests", result.stdout, re.MULTILINE), text
    assert [r for r, _ in _since(fleet, "cyan", start["cyan"])] == ["released", "analysed"]
    assert _since(fleet, "peacock", start["peacock"]) == [], text
    # The command to go on, copied as printed and run from the checkout: it names this fleet's inventory (a new
    # user's copy of it once reached production's inventory and was refused there).
    (printed,) = re.findall(r"To go on: '(flatshare release --all --analysis skip[^']*)'", result.stdout)
    assert printed == f"flatshare release --all --analysis skip --inventory {shlex.quote(str(fleet.inventory))}"
    resumed = subprocess.run([str(BIN / "flatshare"), *shlex.split(printed)[1:]], cwd=fleet.checkout,
                             capture_output=True, text=True, env=fleet.operator_env(), timeout=240)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    for name in NODES:
        fleet.settled(name)


def test_a_harmless_change_passes_its_analysis_and_rolls_on(fleet):
    start = {n: len(fleet.history(n)) for n in NODES}
    fleet.new_hold()
    with fleet.node_profile("cyan", analysis=CALM_ANALYSIS), fleet.calls() as reports:
        result = fleet.cli("release", "--all")
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"analysis of canary cyan against baseline peacock: passed", result.stdout), result.stdout
    assert [r for r, _ in _since(fleet, "cyan", start["cyan"])] == ["released", "analysed"]
    assert [r for r, _ in _since(fleet, "peacock", start["peacock"])] == ["released"]
    assert reports and all(r.done for r in reports), [r for r in reports if not r.done][:3]
    for name in NODES:
        fleet.settled(name)


def test_a_dry_run_analysis_measures_and_reports_and_decides_nothing(fleet):
    start = {n: len(fleet.history(n)) for n in NODES}
    fleet.new_hold()
    with fleet.node_profile("cyan", env={"FLATSHARE_STANDIN_TTFT_S": "0.6"}, analysis=FAST_ANALYSIS), fleet.calls():
        result = fleet.cli("release", "--all", "--analysis", "dry-run")
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"dry run: analysis of canary cyan .*: failed, .*it would roll the canary back", result.stdout)
    assert [r for r, _ in _since(fleet, "cyan", start["cyan"])] == ["released", "analysed"]
    assert [r for r, _ in _since(fleet, "peacock", start["peacock"])] == ["released"]
    assert fleet.history("cyan")[start["cyan"] + 1]["analysis"]["dry_run"] is True
    fleet.cli("release", "--all", "--analysis", "skip")  # cyan back to the checkout's render without the slow engine


@pytest.mark.parametrize("page", ["malformed"])  # "empty": tests/test_canary_clock.py
def test_a_metrics_page_without_vllms_series_is_a_measurement_not_taken_and_enough_of_them_fail_the_analysis(
        fleet, page):
    # The stand-in engine serves an empty page, or a page that is not Prometheus' text format.
    start = len(fleet.history("cyan"))
    fleet.new_hold()
    analysis = {**CALM_ANALYSIS, "consecutive_error_limit": 2}
    with fleet.node_profile("cyan", env={"FLATSHARE_STANDIN_METRICS": page}, analysis=analysis), fleet.calls():
        result = fleet.cli("release", "--all")
    assert result.returncode == 10, result.stdout + result.stderr
    assert re.search(r"^\s+1/3\s+cyan\s+\S+\s+error\s", result.stdout, re.MULTILINE), result.stdout
    assert "2 measurements in a row could not be taken" in result.stdout, result.stdout
    assert "Traceback" not in result.stdout + result.stderr
    assert [r for r, _ in _since(fleet, "cyan", start)] == ["released", "analysed", "rolled back"]


def test_a_canary_whose_requests_end_in_error_fails_once_more_measurements_fail_than_failure_limit(fleet):
    # Half of cyan's new engine's requests end in error (vLLM's finished_reason="error"): over error_share_max in
    # every measurement that judges, and the analysis fails once failure_limit (1: one flaky measurement is
    # tolerated) is exceeded, not at the first.
    start = len(fleet.history("cyan"))
    fleet.new_hold()
    analysis = {**CALM_ANALYSIS, "count": 4, "min_requests": 2, "failure_limit": 1, "inconclusive_limit": 2,
                "error_share_max": 0.1}
    with fleet.node_profile("cyan", env={"FLATSHARE_STANDIN_ERROR_SHARE": "0.5"}, analysis=analysis), fleet.calls():
        result = fleet.cli("release", "--all", "--json")
    assert result.returncode == 10, result.stdout + result.stderr
    (doc,) = json.loads(result.stdout)["analyses"]
    verdicts = [m["verdict"] for m in doc["measurements"]]
    failed = [i for i, v in enumerate(verdicts) if v == "fail"]
    assert len(failed) == 2 and "pass" not in verdicts[: failed[-1]], verdicts  # the second failure decided
    for i in failed:
        rules = {c["rule"]: c["verdict"] for c in doc["measurements"][i]["checks"]}
        assert rules.get("error_share_max") == "fail", doc["measurements"][i]
    assert re.search(rf"^\s+{failed[0] + 1}/4\s+cyan\s+\S+\s+fail\s.*error_share_max", result.stderr,
                     re.MULTILINE), result.stderr
    assert "more than failure_limit 1" in result.stdout, result.stdout
    assert [r for r, _ in _since(fleet, "cyan", start)] == ["released", "analysed", "rolled back"]


def test_counters_the_canarys_engine_reset_during_the_analysis_count_from_zero_and_say_so(fleet):
    # The stand-in engine's counters and histograms go back to zero in the middle of the analysis, as after an
    # engine restart (its /flatshare-standin/reset): that window counts from zero, says the engine restarted,
    # and a harmless change still passes.
    import urllib.request

    start = {n: len(fleet.history(n)) for n in NODES}
    fleet.new_hold()
    reset = urllib.request.Request(f"http://{ADDRESSES['cyan']}:8000/flatshare-standin/reset", method="POST", data=b"")
    done: list = []

    def on_line(line: str) -> None:
        if re.match(r"\s+1/\d+\s", line) and not done:  # between the second scrape and the third
            with urllib.request.urlopen(reset, timeout=10) as answer:
                done.append(answer.status)

    with fleet.node_profile("cyan", analysis={**CALM_ANALYSIS, "interval_s": 2}), fleet.calls():
        code, text = fleet.release_reading(on_line)
    assert done == [200], text
    assert code == 0, text
    windows = _rows(text)
    # One window holds the reset: the one after measurement 1 was printed, or a later one on a busy machine
    # (the reset is asked for when the line is read, which may be after the next scrape began).
    restarted = [i for i, line in enumerate(windows) if "engine restarted" in line]
    assert len(restarted) == 1 and restarted[0] >= 1, windows
    assert "the engine restarted in the window (counts since its start)" in windows[restarted[0]], windows
    assert re.search(r"analysis of canary cyan against baseline peacock: passed", text), text
    assert [r for r, _ in _since(fleet, "cyan", start["cyan"])] == ["released", "analysed"]
    for name in NODES:
        fleet.settled(name)


def test_a_skipped_analysis_is_recorded_in_the_canarys_history(fleet):
    start = len(fleet.history("cyan"))
    fleet.new_hold()
    result = fleet.cli("release", "--all", "--analysis", "skip")
    assert result.returncode == 0, result.stdout + result.stderr
    records = fleet.history("cyan")[start:]
    assert [r["result"] for r in records] == ["released", "analysed"]
    assert records[1]["analysis"]["skipped"] is True
    shown = subprocess.run([str(BIN / "flatshare"), "releases", "--node", "cyan", "--inventory", str(fleet.inventory)],
                           capture_output=True, text=True, timeout=120)
    assert "the canary analysis was skipped (--analysis skip)" in shown.stdout, shown.stdout


def test_a_rollout_stopped_during_its_analysis_analyses_the_canary_again_before_the_next_batch(fleet):
    # A breaker's case: SIGTERM to `release --all` during the canary's analysis, then `release --all` again:
    # the canary had nothing to do, and peacock switched with no analysis ever having passed the canary.
    import signal

    start = {n: len(fleet.history(n)) for n in NODES}
    fleet.new_hold()
    with fleet.node_profile("cyan", analysis={**CALM_ANALYSIS, "interval_s": 5, "inconclusive": "pause"}):
        first = fleet.popen_release()
        seen = []
        for line in first.stdout:
            seen.append(line)
            if line.startswith("canary analysis of cyan"):
                first.send_signal(signal.SIGTERM)
                break
        rest = first.communicate(timeout=120)[0]
        assert first.returncode == 143, "".join(seen) + rest
        assert [r for r, _ in _since(fleet, "cyan", start["cyan"])] == ["released"]  # no analysis recorded
        again = fleet.cli("release", "--all")
    text = again.stdout + again.stderr
    assert again.returncode == 11, text  # no calls: inconclusive, and the profile says pause
    assert re.search(r"^cyan runs this release, but no canary analysis passed it \(its switch [0-9a-f]+\)",
                     again.stdout, re.MULTILINE), text
    assert re.search(r"^\s+1/3\s+cyan\s+\S+\s+inconclusive\s", again.stdout, re.MULTILINE), text
    assert [r for r, _ in _since(fleet, "cyan", start["cyan"])] == ["released", "analysed"]
    assert _since(fleet, "peacock", start["peacock"]) == []  # peacock never switched
    resumed = fleet.cli("release", "--all", "--analysis", "skip")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    for name in NODES:
        fleet.settled(name)


def test_a_failed_canarys_rollback_that_did_not_happen_is_owed_and_the_next_rollout_carries_it_out(fleet):
    # A breaker's case: a hold placed during the analysis refused the rollback it decided; the rollout still
    # said exit 10 ("the canary rolled back"), and the next release --all analysed the canary again instead.
    left = {n: fleet.current(n) for n in NODES}
    start = {n: len(fleet.history(n)) for n in NODES}
    fleet.new_hold()
    with fleet.node_profile("cyan", env={"FLATSHARE_STANDIN_TTFT_S": "0.6"}, analysis=FAST_ANALYSIS), fleet.calls():
        def hold_at_the_analysis(line: str) -> None:
            if line.startswith("canary analysis of cyan"):
                held = fleet.hold_command("place", "--node", "cyan", "-m", "looking at it")
                assert held.returncode == 0, held.stdout + held.stderr

        code, text = fleet.release_reading(hold_at_the_analysis)
        try:
            assert code == 3, text  # the rollback's own code (refused by the hold), not 10
            assert re.search(r"^cyan: refused: rollback refused: cyan is held by .*: looking at it; .* \(analysis "
                             r"failed, its rollback ended with exit 3\)$", text, re.MULTILINE), text
            assert fleet.current("cyan") != left["cyan"] and fleet.current("peacock") == left["peacock"]
        finally:
            lifted = fleet.hold_command("lift", "--node", "cyan")
            assert lifted.returncode == 0, lifted.stdout + lifted.stderr
        # Another breaker's case: the release whose analysis failed, released to peacock alone while cyan's
        # rollback was owed, went ahead (the guard listed only releases already taken back).
        alone = fleet.cli("release", "--node", "peacock")
        assert alone.returncode == 3, alone.stdout + alone.stderr
        # The node asks for a go-ahead after its preflight (the guard is read beside it) and says the refusal.
        assert re.search(r"^\[peacock \S+\] flatshare: release refused: this checkout's release for cyan \(\S+\) "
                         r"failed there \(its canary analysis failed, .*\) and cyan still runs it: its rollback is owed",
                         alone.stdout, re.MULTILINE), alone.stdout
        assert fleet.current("peacock") == left["peacock"]
        listed = subprocess.run([str(BIN / "flatshare"), "releases", "--node", "cyan", "--inventory", str(fleet.inventory)],
                                capture_output=True, text=True, env=fleet.operator_env(), timeout=120)
        assert re.search(r"^  FAILED \S+: its canary analysis failed \(.*\); cyan still runs it: its rollback is owed",
                         listed.stdout, re.MULTILINE), listed.stdout
        owed = fleet.cli("release", "--all")
    assert owed.returncode == 10, owed.stdout + owed.stderr  # rolled back now: the rollback the analysis decided
    assert re.search(r"^cyan: its canary analysis failed in rollout \S+ and it was not rolled back: rolling it back "
                     r"now; the rollout stops$", owed.stdout, re.MULTILINE), owed.stdout
    assert "canary analysis of" not in owed.stdout, owed.stdout  # not analysed again
    assert fleet.current("cyan") == left["cyan"] and fleet.current("peacock") == left["peacock"]
    assert [r for r, _ in _since(fleet, "cyan", start["cyan"])] == ["released", "analysed", "rolled back"]
    assert _since(fleet, "peacock", start["peacock"]) == []
    for name in NODES:
        fleet.settled(name)


def test_an_analysis_whose_canary_another_rollback_switches_stops_and_decides_nothing(fleet):
    # A breaker's case: `rollback --node cyan` during the analysis; the analysis went on measuring cyan's old
    # release, "passed" the new one, and switched peacock to it.
    left = {n: fleet.current(n) for n in NODES}
    start = {n: len(fleet.history(n)) for n in NODES}
    fleet.new_hold()
    slow = {**CALM_ANALYSIS, "interval_s": 2, "count": 8}
    with fleet.node_profile("cyan", analysis=slow), fleet.calls():
        seen: dict[str, str] = {}

        def roll_back_at_the_first_measurement(line: str) -> None:
            if re.match(r"\s+1/8\s", line):
                seen["new"] = fleet.current("cyan")
                back = fleet.cli("rollback", "--node", "cyan")
                assert back.returncode == 0, back.stdout + back.stderr

        code, text = fleet.release_reading(roll_back_at_the_first_measurement)
    new = seen.get("new")
    assert new is not None and new != left["cyan"], text
    assert code == 11, text  # stopped, nothing decided
    assert re.search(rf"^the canary analysis stops: canary cyan now runs release {left['cyan']}, not {new}, the "
                     r"release judged", text, re.MULTILINE), text
    assert fleet.current("peacock") == left["peacock"] and _since(fleet, "peacock", start["peacock"]) == []
    assert "analysed" not in [r for r, _ in _since(fleet, "cyan", start["cyan"])]
    for name in NODES:
        fleet.settled(name)


def test_rollback_all_after_a_paused_canary_analysed_again_undoes_the_release_not_the_analysis(fleet):
    # A breaker's case: a second `release --all` re-analysed the paused canary; its analysis record (the later
    # rollout's id, before = after = the new release) was taken for the rollout to undo, and `rollback --all`
    # said "already on it, nothing to do", paused again, and again.
    left = {n: fleet.current(n) for n in NODES}
    fleet.new_hold()
    with fleet.node_profile("cyan", analysis={**CALM_ANALYSIS, "interval_s": 1, "count": 2,
                                              "inconclusive": "pause"}):  # no calls: inconclusive
        for _ in range(2):
            paused = fleet.cli("release", "--all")
            assert paused.returncode == 11, paused.stdout + paused.stderr
        assert fleet.history("cyan")[-1]["result"] == "analysed" and fleet.current("cyan") != left["cyan"]
        undone = fleet.cli("rollback", "--all", "--analysis", "skip")
    assert undone.returncode == 0, undone.stdout + undone.stderr
    assert fleet.current("cyan") == left["cyan"] and fleet.current("peacock") == left["peacock"]
    for name in NODES:
        fleet.settled(name)


GOLDEN = {"prompts": ["The capital of France is", "1, 2, 3,"], "max_tokens": 8}


#: The most a profile allows: 16 prompts of 2,000 characters, none of them ASCII (a breaker's case: as one JSON
#: argument on the node's command line they went past Linux's 128 KiB bound, and the check was silently lost).
BIGGEST = {"prompts": [f"{i:02d}" + "é" * 1998 for i in range(16)], "max_tokens": 8}


@pytest.mark.parametrize("golden", [GOLDEN, BIGGEST], ids=["two prompts", "the most a profile allows"])
def test_golden_answers_equal_on_both_nodes_pass_and_are_recorded_with_the_analysis(fleet, golden):
    # The stand-ins answer as greedy decoding of the same weights does: the same token ids for the same prompt.
    start = {n: len(fleet.history(n)) for n in NODES}
    fleet.new_hold()
    count = len(golden["prompts"])
    with fleet.node_profile("cyan", analysis=CALM_ANALYSIS, golden=golden), fleet.calls():
        result = fleet.cli("release", "--all", "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    (doc,) = json.loads(result.stdout)["analyses"]
    golden = doc["golden"]
    assert (golden["against"], golden["failed"], golden["differences"], golden["errors"]) == ("peacock", False, [], [])
    assert golden["canary_answers"] == golden["other_answers"]
    assert [len(a) for a in golden["canary_answers"]] == [8] * count  # max_tokens each (the stand-in never stops early)
    recorded = fleet.history("cyan")[start["cyan"] + 1]["analysis"]["golden"]
    assert recorded["canary_answers"] == golden["canary_answers"]
    assert [r for r, _ in _since(fleet, "peacock", start["peacock"])] == ["released"]
    # `releases --measurements` gives the golden answers' line back with the table, as the rollout printed it.
    shown = subprocess.run([str(BIN / "flatshare"), "releases", "--node", "cyan", "--measurements",
                            "--inventory", str(fleet.inventory)], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert f"    {golden['line']}" in shown.stdout.splitlines(), shown.stdout
    assert golden["line"].startswith(f"golden answers of cyan against peacock's: {count} of {count} prompt(s) "
                                     "agree"), golden


@pytest.mark.parametrize("changes_answers", [False, True])
def test_golden_answers_that_differ_fail_the_analysis_named_unless_the_release_says_it_changes_answers(
        fleet, changes_answers):
    # cyan's new engine answers differently from the fourth token on (position 3).
    start = {n: len(fleet.history(n)) for n in NODES}
    fleet.new_hold()
    with fleet.node_profile("cyan", env={"FLATSHARE_STANDIN_ANSWER_SHIFT": "3"}, analysis=CALM_ANALYSIS,
                            golden=GOLDEN), fleet.calls():
        result = fleet.cli("release", "--all", "--json", *(["--changes-answers"] if changes_answers else []))
    text = result.stdout + result.stderr
    (doc,) = json.loads(result.stdout)["analyses"]
    golden = doc["golden"]
    assert [(d["prompt_number"], d["position"]) for d in golden["differences"]] == [(1, 3), (2, 3)], golden
    for d, mine, theirs in zip(golden["differences"], golden["canary_answers"], golden["other_answers"]):
        assert mine[:3] == theirs[:3] and (d["canary_token"], d["other_token"]) == (mine[3], theirs[3])
    assert golden["changes_answers"] is changes_answers
    if changes_answers:
        assert result.returncode == 0, text
        assert [r for r, _ in _since(fleet, "cyan", start["cyan"])] == ["released", "analysed"]
        assert fleet.history("cyan")[start["cyan"] + 1]["analysis"]["golden"]["changes_answers"] is True
    else:
        assert result.returncode == 10, text
        assert doc["phase"] == "failed" and doc["measurements"] == []  # decided before any measurement
        assert "prompt 1 ('The capital of France is') first differs at token 3" in doc["reason"], doc["reason"]
        assert [r for r, _ in _since(fleet, "cyan", start["cyan"])] == ["released", "analysed", "rolled back"]
        assert _since(fleet, "peacock", start["peacock"]) == []


def test_a_damaged_history_on_another_node_is_said_in_the_nodes_own_words_and_refuses_nothing(fleet):
    # A breaker's case: the retry guard reads every node's history; peacock's, a symlink (the node's reader
    # refuses it: exit 5), was said as "did not answer JSON", not as what the node said.
    path = fleet.node("peacock").state_dir / "releases/history.jsonl"
    kept = path.with_name("history.kept")
    os.replace(path, kept)
    os.symlink(kept, path)
    try:
        fleet.new_hold()
        result = fleet.cli("release", "--node", "cyan")
    finally:
        os.unlink(path)
        os.replace(kept, path)
    text = result.stdout + result.stderr
    assert result.returncode == 0, text  # not known there: said, and cyan's release goes ahead
    said = [line for line in text.splitlines() if line.startswith("peacock: its history could not be read")]
    assert said and "exit 5: " in said[0] and "history.jsonl" in said[0], text
    assert "did not answer JSON" not in text and "Traceback" not in text


def test_a_profile_that_does_not_load_on_another_node_is_said_and_refuses_only_the_drain_it_leaves_unknown(fleet):
    # A breaker's case: peacock's profile with a key of the wrong type stopped `release --node cyan` as bad
    # input (exit 2, the run's own usage error). How to ask peacock is then not known: the retry guard says so,
    # and cyan's admission, which cannot count peacock as taking calls, refuses its drain (exit 3), naming why.
    path = fleet.node("peacock").profile
    original = path.read_text()
    before = fleet.current("cyan")
    path.write_text(original + "\n[release.admission]\nseats_share = \"many\"\n")
    try:
        fleet.new_hold()
        result = fleet.cli("release", "--node", "cyan")
    finally:
        path.write_text(original)
    text = result.stdout + result.stderr
    assert result.returncode == 3, text
    said = [line for line in text.splitlines() if line.startswith("peacock: its profile does not render")]
    assert said and "seats_share" in said[0], text
    assert re.search(r"^peacock: UNKNOWN: it cannot be asked \(.*seats_share", text, re.MULTILINE), text
    assert fleet.current("cyan") == before and "Traceback" not in text
