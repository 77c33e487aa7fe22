"""The canary analysis's loop (control/canary.py ``analyse``) on a fake clock, in milliseconds: its scrapes go to
fake engines whose ``/metrics`` pages are written by the stand-in engine's own writer (sandbox/engine_metrics.py,
vLLM 0.32.0's series and buckets), and each wait of the loop moves the fake clock and lets the engines serve
that long. The sandbox's tests (tests/test_canary.py) run one case of each class on real nodes: a failing
analysis and its rollback (time to first token), a passing one, an inconclusive one that pauses, a page that is
not Prometheus text, requests ending in error, an engine reset mid-analysis. The cases below that moved from
there (list in tests/test_canary.py's docstring) assert what they asserted of the analysis; what the rollout
then does with its action is the sandbox's class test's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import json

import pytest

from conftest import REPO
from flatshare_ops.config.profile import Golden, load_profile
from flatshare_ops.control.analysis import Action
from flatshare_ops.control.canary import Clock, analyse
from flatshare_ops.control.commands import NodeSpec
from flatshare_ops.control.connection import CommandResult
from flatshare_ops.sandbox.engine_metrics import MALFORMED, EngineMetrics

#: The short analysis tests/test_canary.py gives its canary (the profile's values are minutes of calls).
FAST_ANALYSIS = {"interval_s": 1.5, "count": 3, "min_requests": 4, "failure_limit": 0, "inconclusive_limit": 0}
#: Thresholds no stand-in's first token reaches (test_canary.py's CALM_ANALYSIS).
CALM_ANALYSIS = {**FAST_ANALYSIS, "ttft_p95_max_s": 10, "baseline_margin_s": 10}
START = 1_800_000_000.0  # the fake wall clock's start (Unix seconds)


class FakeClock:
    """A clock that only moves when the analysis waits; every wait lets each engine serve that long first."""

    def __init__(self) -> None:
        self.now = START
        self.waits: list[float] = []
        self.engines: list[FakeEngine] = []

    def sleep(self, seconds: float) -> None:
        self.waits.append(seconds)
        for engine in self.engines:
            engine.serve(seconds)
        self.now += seconds

    def clock(self) -> Clock:
        return Clock(monotonic=lambda: self.now - START, wall=lambda: self.now, sleep=self.sleep)


@dataclass
class FakeEngine:
    """One node's engine: ``per_s`` requests a second, each with this first-token time, a share of them ending in
    error; ``page`` (``"empty"``, ``"malformed"``) served instead of its metrics; reset (as after a restart)
    before serving the wait numbered ``reset_at`` (1: the first wait)."""

    clock: FakeClock
    per_s: float = 4.0
    ttft_s: float = 0.02
    error_share: float = 0.0
    page: str | None = None
    reset_at: int | None = None
    metrics: EngineMetrics = field(init=False)
    served_waits: int = 0

    def __post_init__(self) -> None:
        self.metrics = EngineMetrics("flatshare-chat", {"block_size": "16", "cache_dtype": "auto"})
        self.metrics.created = self.clock.now
        self.clock.engines.append(self)

    def serve(self, seconds: float) -> None:
        self.served_waits += 1
        if self.served_waits == self.reset_at:
            self.metrics.reset()
            self.metrics.created = self.clock.now + seconds / 2
        requests = round(self.per_s * seconds)
        errors = round(requests * self.error_share)
        if errors:
            self.metrics.finished("error", None, 0.5, 8, 0, times=errors)
        if requests - errors:
            self.metrics.finished("length", self.ttft_s, self.ttft_s + 0.2, 8, 4, times=requests - errors)

    def text(self) -> str:
        """Its ``/metrics`` page now."""
        return self.metrics.exposition() if self.page is None else {"empty": "", "malformed": MALFORMED}[self.page]


class FakeRollout:
    """What ``analyse`` asks of a rollout: its lines, each node's ``flatshare-node metrics`` answer, the release
    each canary's switch installed."""

    def __init__(self, engines: dict[str, FakeEngine]) -> None:
        self.engines = engines
        self.lines: list[str] = []
        self.asked: list[tuple[str, str]] = []
        self.outcomes = {name: SimpleNamespace(release="a1b2c3d4e5f60718") for name in engines}
        self.out = SimpleNamespace(line=self.lines.append)
        self.changes_answers = False

    def run_command(self, target, argv: list[str], stdin: bytes = b"") -> CommandResult:
        self.asked.append((target.name, argv[1]))
        assert argv[1] == "metrics", argv  # the analysis only scrapes (no golden prompts here)
        answer = {"node": target.name, "at": 0, "release": "a1b2c3d4e5f60718", "status": 200,
                  "text": self.engines[target.name].text()}
        return CommandResult(0, json.dumps(answer) + "\n")


def target(name: str, **analysis):
    """A node target whose profile's ``[release.analysis]`` is production's with ``analysis`` over it (and no
    golden prompts: tests/test_golden.py has them)."""
    profile = load_profile(REPO / "profiles/rtx-5060-ti-serve.toml").profile
    settings = profile.release.analysis.model_copy(update={**analysis, "golden": Golden()})
    loaded = SimpleNamespace(profile=SimpleNamespace(release=SimpleNamespace(analysis=settings)))
    spec = NodeSpec(name, ("flatshare-node",), "/var/lib/flatshare", "system", None, "serving-check")
    return SimpleNamespace(name=name, loaded=loaded, spec=spec)


def run(analysis: dict, canary: dict, baseline: dict | None = None, dry_run: bool = False):
    """The analysis of canary cyan against baseline peacock: (the verdict, cyan's result document, the lines said,
    the fake clock)."""
    clock = FakeClock()
    engines = {"cyan": FakeEngine(clock, **canary), "peacock": FakeEngine(clock, **(baseline or {}))}
    rollout = FakeRollout(engines)
    verdict = analyse(rollout, [target("cyan", **analysis)], target("peacock", **analysis), dry_run, clock.clock())
    return verdict, verdict.results["cyan"].document(), rollout.lines, clock


def first_judged(document: dict) -> tuple[int, dict]:
    """The first measurement that judged the canary (test_canary.py ``_first_judged``)."""
    index = next(i for i, m in enumerate(document["measurements"]) if m["verdict"] != "inconclusive")
    return index, document["measurements"][index]


def rules(measurement: dict) -> dict[str, str]:
    return {c["rule"]: c["verdict"] for c in measurement["checks"]}


def test_the_loop_measures_every_interval_on_its_clock_and_a_harmless_change_passes():
    verdict, document, lines, clock = run(CALM_ANALYSIS, {})
    assert (document["phase"], verdict.action) == ("passed", Action.CONTINUE), document["reason"]
    assert [m["verdict"] for m in document["measurements"]] == ["pass", "pass", "pass"]
    assert clock.waits == [1.5, 1.5, 1.5]  # one scrape to start from, then one each interval_s, none after the last
    windows = [m["canary"] for m in document["measurements"]]
    assert [(w["start_s"], w["end_s"]) for w in windows] == [(START + 1.5 * i, START + 1.5 * (i + 1)) for i in range(3)]
    assert all(w["requests"] == 6 for w in windows)  # 4 a second for 1.5 s: the window's own, not the total
    assert "analysis of canary cyan against baseline peacock: passed" in lines[-1], lines


def test_a_canary_worse_than_its_baseline_fails_even_under_the_fixed_threshold():
    # Moved from test_canary.py: 0.3 s to the first token, under a relaxed 5 s threshold, far over 1.5 x the
    # baseline's p95 + 0.1 s.
    verdict, document, _, _ = run({**FAST_ANALYSIS, "ttft_p95_max_s": 5}, {"ttft_s": 0.3})
    assert (document["phase"], verdict.action) == ("failed", Action.ROLLBACK), document["reason"]
    found = rules(first_judged(document)[1])
    assert found.get("ttft_p95_max_s") == "pass" and found.get("baseline") == "fail", found


@pytest.mark.parametrize("inconclusive, action", [("pause", Action.PAUSE), ("pass", Action.CONTINUE),
                                                  ("fail", Action.ROLLBACK)])
def test_with_no_calls_the_analysis_is_inconclusive_and_does_what_the_profile_says(inconclusive, action):
    # Moved from test_canary.py ("pass" and "fail"; "pause" runs there too, with the command to go on).
    verdict, document, lines, _ = run({**CALM_ANALYSIS, "inconclusive": inconclusive}, {"per_s": 0},
                                      {"per_s": 0})
    assert (document["phase"], verdict.action) == ("inconclusive", action), document["reason"]
    first = document["measurements"][0]
    assert first["verdict"] == "inconclusive" and any("min_requests" in r for r in first["reasons"]), first
    assert any(line.lstrip().startswith("1/3") and " inconclusive " in line and "min_requests" in line
               for line in lines), lines


@pytest.mark.parametrize("page", ["empty", "malformed"])
def test_a_metrics_page_without_vllms_series_is_a_measurement_not_taken_and_enough_of_them_fail_the_analysis(page):
    # Moved from test_canary.py ("empty"; "malformed" runs there too, through a real node's metrics command).
    verdict, document, lines, _ = run({**CALM_ANALYSIS, "consecutive_error_limit": 2}, {"page": page})
    assert (document["phase"], verdict.action) == ("failed", Action.ROLLBACK), document["reason"]
    assert document["measurements"][0]["verdict"] == "error", document["measurements"][0]
    assert "2 measurements in a row could not be taken" in document["reason"], document["reason"]
    assert any(line.lstrip().startswith("1/3") and " error " in line for line in lines), lines


def test_a_canary_whose_requests_end_in_error_fails_once_more_measurements_fail_than_failure_limit():
    # As test_canary.py's case (which stays there too): the second failed measurement decides, not the first.
    analysis = {**CALM_ANALYSIS, "count": 4, "min_requests": 2, "failure_limit": 1, "inconclusive_limit": 2,
                "error_share_max": 0.1}
    verdict, document, _, clock = run(analysis, {"error_share": 0.5})
    verdicts = [m["verdict"] for m in document["measurements"]]
    assert verdicts == ["fail", "fail"], verdicts  # stopped early: the result can no longer change
    assert len(clock.waits) == 2
    assert all(rules(m).get("error_share_max") == "fail" for m in document["measurements"]), document
    assert (document["phase"], verdict.action) == ("failed", Action.ROLLBACK)
    assert "more than failure_limit 1" in document["reason"], document["reason"]


def test_counters_the_canarys_engine_reset_during_the_analysis_count_from_zero_and_say_so():
    # As test_canary.py's case (which stays there too): the canary's engine restarts in the second window.
    verdict, document, lines, _ = run({**CALM_ANALYSIS, "interval_s": 2}, {"reset_at": 2})
    rows = [line for line in lines if line.lstrip()[:1].isdigit()]
    restarted = [i for i, row in enumerate(rows) if "engine restarted" in row]
    assert restarted == [1], rows
    assert "the engine restarted in the window (counts since its start)" in rows[1], rows
    window = document["measurements"][1]["canary"]
    assert window["engine_restarted"] is True and window["requests"] == 8  # counted from zero: its own 2 s
    assert (document["phase"], verdict.action) == ("passed", Action.CONTINUE), document["reason"]


def test_a_dry_run_analysis_measures_to_the_end_and_decides_nothing():
    verdict, document, lines, clock = run(FAST_ANALYSIS, {"ttft_s": 0.6}, dry_run=True)
    assert document["phase"] == "failed" and document["action"] == "rollback"  # what it would do
    assert verdict.action == Action.CONTINUE and document["rollout_action"] == "continue"
    assert len(document["measurements"]) == 3 and len(clock.waits) == 3  # every measurement, though failed early
    assert "it would roll the canary back" in lines[-1], lines
