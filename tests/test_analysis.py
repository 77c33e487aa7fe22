"""The canary analysis's rules, each pinned exactly on /metrics texts built here (docs/reference/canary-analysis.md).

The texts are vLLM 0.32.0's exposition as its prometheus_client writes it: its names, its labels
(``model_name``, ``engine``), its buckets (docs/reference/vllm.md#metrics, typed again below as the independent
source), ``# HELP``/``# TYPE`` lines and ``_created`` series. Every expected bucket and interpolated value is
worked out by hand in the test from the counts it puts in; where promtool is installed, Prometheus' own
``histogram_quantile`` checks the interpolation on the same series.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from collections import Counter
from dataclasses import dataclass, field

import pytest

from conftest import run_cli
from flatshare_ops.common.protocol import AnalysisPhase
from flatshare_ops.config.profile import Analysis
from flatshare_ops.control.analysis import (Action, AnalysisRun, FailedScrape, Histogram, MissingWindow, Scrape,
                                            Verdict, assess, measure, quantile, read_scrape, threshold_warnings, window)

# vLLM 0.32.0, vllm/v1/metrics/buckets.py (docs/reference/vllm.md, "Metrics"): written out here, not imported.
TTFT_BOUNDS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0, 160.0, 640.0, 2560.0)
E2E_BOUNDS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
              480.0, 960.0, 1920.0, 7680.0)
REASONS = ("stop", "length", "abort", "error", "repetition")
MODEL = "flatshare-chat"
T0 = 1_764_590_400.0  # 2025-12-01T12:00:00Z

SETTINGS = dict(interval_s=30.0, count=4, min_requests=20, ttft_p95_max_s=0.5, error_share_max=0.01,
                baseline_factor=1.5, baseline_margin_s=0.1, failure_limit=1, inconclusive_limit=1,
                consecutive_error_limit=4, inconclusive="pause")


def settings(**changes) -> Analysis:
    return Analysis(**{**SETTINGS, **changes})


# --- a stand-in for vLLM's metrics, as text --------------------------------


@dataclass
class Engine:
    """One node's vLLM 0.32.0 metrics, cumulative since its start, written as prometheus_client writes them."""

    engines: int = 1
    started: float = T0 - 3600
    ttft: list[Counter] = field(default_factory=list)
    e2e: list[Counter] = field(default_factory=list)
    finished: list[Counter] = field(default_factory=list)
    waiting: int = 0
    created: bool = True

    def __post_init__(self):
        self.restart(self.started)

    def restart(self, at: float) -> None:
        self.started = at
        self.ttft = [Counter() for _ in range(self.engines)]
        self.e2e = [Counter() for _ in range(self.engines)]
        self.finished = [Counter() for _ in range(self.engines)]

    def serve(self, ttft: dict[float, int], *, stop: int | None = None, abort: int = 0, error: int = 0,
              engine: int = 0, e2e_s: float = 2.0) -> None:
        """``ttft``: {seconds: how many first tokens took that long}; the same number of requests finish
        (``stop`` of them normally, unless given), each taking ``e2e_s`` end to end."""
        n = sum(ttft.values())
        self.ttft[engine].update(ttft)
        self.e2e[engine][e2e_s] += n
        self.finished[engine].update({"stop": n - abort - error if stop is None else stop, "abort": abort,
                                      "error": error})

    def text(self) -> str:
        lines = []
        for name, doc, bounds, observed in (
                ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BOUNDS,
                 self.ttft),
                ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", E2E_BOUNDS,
                 self.e2e)):
            lines += [f"# HELP {name} {doc}", f"# TYPE {name} histogram"]
            for e in range(self.engines):
                labels = f'model_name="{MODEL}",engine="{e}"'
                for bound in (*bounds, math.inf):
                    below = sum(n for value, n in observed[e].items() if value <= bound)
                    le = "+Inf" if bound == math.inf else repr(bound)
                    lines.append(f'{name}_bucket{{{labels},le="{le}"}} {float(below)}')
                lines.append(f"{name}_count{{{labels}}} {float(sum(observed[e].values()))}")
                lines.append(f"{name}_sum{{{labels}}} {float(sum(v * n for v, n in observed[e].items()))}")
            if self.created:
                lines += [f"# HELP {name}_created {doc}", f"# TYPE {name}_created gauge"]
                lines += [f'{name}_created{{model_name="{MODEL}",engine="{e}"}} {self.started}'
                          for e in range(self.engines)]
        lines += ["# HELP vllm:request_success_total Count of successfully processed requests.",
                  "# TYPE vllm:request_success_total counter"]
        for e in range(self.engines):
            lines += [f'vllm:request_success_total{{model_name="{MODEL}",engine="{e}",finished_reason="{r}"}} '
                      f"{float(self.finished[e][r])}" for r in REASONS]
        if self.created:
            lines += ["# HELP vllm:request_success_created Count of successfully processed requests.",
                      "# TYPE vllm:request_success_created gauge"]
            lines += [f'vllm:request_success_created{{model_name="{MODEL}",engine="{e}",finished_reason="{r}"}} '
                      f"{self.started}" for e in range(self.engines) for r in REASONS]
        lines += ["# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
                  "# TYPE vllm:num_requests_waiting gauge"]
        lines += [f'vllm:num_requests_waiting{{model_name="{MODEL}",engine="{e}"}} {float(self.waiting)}'
                  for e in range(self.engines)]
        return "\n".join(lines) + "\n"

    def scrape(self, node: str, at: float):
        return read_scrape(node, at, self.text())


def one_measurement(canary: dict[float, int], baseline: dict[float, int] | None = None, number: int = 1,
                    config: Analysis | None = None, **canary_counts):
    """A measurement over one 30 s window in which the canary served ``canary`` and the baseline ``baseline``."""
    config = config or settings()
    c, b = Engine(), Engine()
    c.serve({0.05: 100})  # what each served before the window: it must not count
    b.serve({0.05: 100})
    starts = c.scrape("cyan", T0), b.scrape("peacock", T0)
    c.serve(canary, **canary_counts)
    if baseline is not None:
        b.serve(baseline)
    ends = c.scrape("cyan", T0 + 30), b.scrape("peacock", T0 + 30)
    return measure(number, config, (starts[0], ends[0]), (starts[1], ends[1]))


def check(measurement, rule):
    (found,) = [c for c in measurement.checks if c.rule == rule]
    return found


# --- quantiles as honest as the buckets ------------------------------------

# (first tokens put in, bucket worked out by hand, interpolated value worked out by hand)
QUANTILES = {
    # 40 in all, rank 0.95 x 40 = 38. Cumulative: le 0.06 -> 30 ... le 0.25 -> 30, le 0.5 -> 40 >= 38.
    # 0.25 + (0.5 - 0.25) x (38 - 30) / 10 = 0.45
    "upper buckets": ({0.05: 30, 0.3: 10}, (0.25, 0.5), 0.45),
    # 42 in all, rank 39.9: le 0.25 -> 30, le 0.5 -> 42. 0.25 + 0.25 x 9.9 / 12 = 0.45625
    "a long decimal": ({0.05: 30, 0.3: 12}, (0.25, 0.5), 0.45625),
    # 40 in the lowest bucket, rank 38: 0 + 0.001 x 38 / 40 = 0.00095
    "the lowest bucket": ({0.0005: 40}, (0.0, 0.001), 0.00095),
    # 40, rank 38, le 2560 -> 37 < 38: the +Inf bucket; Prometheus answers the highest finite bound
    "the +Inf bucket": ({0.05: 37, 3000.0: 3}, (2560.0, math.inf), 2560.0),
    # 20, rank 19: le 0.1 -> 19 exactly: the bucket (0.08, 0.1], whose top the rank reaches: 0.08 + 0.02 x 19/19
    "rank on a bound": ({0.09: 19, 0.2: 1}, (0.08, 0.1), 0.1),
}


def _window_of(first_tokens: dict[float, int]):
    engine = Engine()
    engine.serve({0.05: 7})
    start = engine.scrape("cyan", T0)
    engine.serve(first_tokens)
    return window(start, engine.scrape("cyan", T0 + 30))


@pytest.mark.parametrize("case", sorted(QUANTILES))
def test_the_p95_lies_in_the_bucket_worked_out_by_hand_and_is_interpolated_as_prometheus_does(case):
    served, (lower, upper), interpolated = QUANTILES[case]
    p95 = _window_of(served).p95()
    assert (p95.lower_s, p95.upper_s) == (lower, upper)
    assert p95.interpolated_s == pytest.approx(interpolated, rel=1e-12)
    assert p95.observations == sum(served.values())


def test_the_interpolated_value_is_printed_no_finer_than_its_buckets_and_marked_as_interpolated():
    text = _window_of({0.05: 30, 0.3: 12}).text()  # 0.45625 inside (0.25, 0.5]: two places, as the bounds
    assert "0.25 < TTFT p95 <= 0.5 s (interpolated 0.46)" in text
    assert "0.456" not in text
    assert "TTFT p95 > 2560 s" in _window_of({0.05: 37, 3000.0: 3}).text()
    assert "TTFT p95 <= 0.001 s (interpolated 0.001)" in _window_of({0.0005: 40}).text()


def test_a_histogram_without_observations_has_no_quantile():
    with pytest.raises(ValueError, match="no observations"):
        quantile(0.95, Histogram(((0.1, 0), (math.inf, 0))))


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
@pytest.mark.parametrize("case", sorted(QUANTILES))
def test_the_interpolated_value_is_prometheus_histogram_quantile_on_the_same_series(case, tmp_path):
    served = QUANTILES[case][0]
    engine = Engine(engines=2)  # two engines' series: summed by le, as the analysis sums them
    halves = [{v: n // 2 for v, n in served.items()}, {v: n - n // 2 for v, n in served.items()}]
    for e, half in enumerate(halves):
        engine.serve(half, engine=e)
    ours = read_scrape("cyan", T0, engine.text())
    series = []
    for line in engine.text().splitlines():
        if line.startswith("vllm:time_to_first_token_seconds_bucket"):
            name_labels, value = line.rsplit(" ", 1)
            series.append({"series": name_labels, "values": f"{value}x1"})
    expected = quantile(0.95, ours.ttft).interpolated_s
    test = {"rule_files": [], "evaluation_interval": "1m", "tests": [{
        "interval": "1m", "input_series": series,
        "promql_expr_test": [{"expr": "histogram_quantile(0.95, sum by (le) (vllm:time_to_first_token_seconds_bucket))",
                              "eval_time": "0m", "exp_samples": [{"labels": "{}", "value": expected}]}]}]}
    path = tmp_path / "quantile_test.yml"
    path.write_text(json.dumps(test))  # YAML is a superset of JSON
    result = subprocess.run(["promtool", "test", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


# --- scrapes that cannot be read -------------------------------------------

UNREADABLE = {
    "empty": ("", "/metrics is empty"),
    "only blank lines": ("\n\n  \n", "/metrics is empty"),
    "an error page": ("<html><body>502 Bad Gateway</body></html>\n", "/metrics is not Prometheus text: "),
    "a JSON answer": ('{"detail":"Not Found"}', "/metrics is not Prometheus text: "),
    "a value that is no number": ('vllm:num_requests_waiting{engine="0"} many\n', "/metrics is not Prometheus text: "),
    "another program's metrics": ("# TYPE node_load1 gauge\nnode_load1 0.5\n",
                                  "/metrics has no vllm:time_to_first_token_seconds_bucket and no "
                                  "vllm:e2e_request_latency_seconds_bucket and no vllm:request_success_total and "
                                  "no vllm:num_requests_waiting series (1 series read)"),
    "comments only": ("# HELP vllm:num_requests_waiting Number\n# TYPE vllm:num_requests_waiting gauge\n",
                      "/metrics has no vllm:time_to_first_token_seconds_bucket"),
}


@pytest.mark.parametrize("case", sorted(UNREADABLE))
def test_an_empty_malformed_or_series_less_metrics_is_a_failed_scrape_that_says_why(case):
    text, says = UNREADABLE[case]
    scrape = read_scrape("cyan", T0, text)
    assert isinstance(scrape, FailedScrape)
    assert scrape.reason.startswith(says), scrape.reason
    assert "None" not in scrape.reason and "Traceback" not in scrape.reason


def test_a_metrics_without_one_of_the_series_names_it():
    text = "\n".join(line for line in Engine().text().splitlines() if not line.startswith("vllm:num_requests_waiting"))
    scrape = read_scrape("cyan", T0, text)
    assert isinstance(scrape, FailedScrape)
    assert scrape.reason.startswith("/metrics has no vllm:num_requests_waiting series"), scrape.reason


def test_counts_that_are_no_counts_and_buckets_that_are_not_cumulative_are_unreadable():
    engine = Engine()
    engine.serve({0.05: 10})
    good = engine.text()
    negative = good.replace('finished_reason="stop"} 10.0', 'finished_reason="stop"} -1.0')
    falling = good.replace('le="0.08"} 10.0', 'le="0.08"} 3.0')
    for text, says in ((negative, "vllm:request_success_total has the value -1.0, not a count"),
                       (falling, "vllm:time_to_first_token_seconds's bucket counts fall from 10 (le 0.06) to 3 "
                                 "(le 0.08)")):
        scrape = read_scrape("cyan", T0, text)
        assert isinstance(scrape, FailedScrape) and scrape.reason.startswith(says), scrape


@pytest.mark.parametrize("le", ["-Inf", "-1", "-0.001", "NaN"])
def test_a_bucket_bound_that_is_no_latency_is_unreadable_never_a_quantile(le):
    # A breaker's /metrics: buckets at -Inf (or below zero) made the p95 "<= -1 s", or a traceback; a latency
    # bound is 0 or more seconds, or +Inf.
    engine = Engine()
    engine.serve({0.05: 10})
    text = engine.text().replace('le="0.001"}', f'le="{le}"}}')
    scrape = read_scrape("cyan", T0, text)
    assert isinstance(scrape, FailedScrape), scrape
    assert f"vllm:time_to_first_token_seconds_bucket has a series whose le is '{le}', not a bucket bound" \
        == scrape.reason, scrape.reason


@pytest.mark.parametrize("created", ["NaN", "+Inf", "-5.0"])
def test_a_created_timestamp_that_is_no_time_is_unreadable_never_a_restart_each_window(created):
    engine = Engine()
    engine.serve({0.05: 10})
    text = engine.text()
    start = f"}} {engine.started}"
    assert 'vllm:time_to_first_token_seconds_created{' in text and start in text
    text = text.replace(start, f"}} {created}")
    scrape = read_scrape("cyan", T0, text)
    assert isinstance(scrape, FailedScrape) and "_created" in scrape.reason and "not a time" in scrape.reason, scrape


def test_an_unreadable_canary_scrape_is_an_error_measurement_naming_the_node_and_the_cause():
    engine = Engine()
    start = engine.scrape("cyan", T0)
    m = measure(1, settings(), (start, read_scrape("cyan", T0 + 30, "")), None)
    assert m.verdict == Verdict.ERROR
    assert m.reasons == ("canary cyan not measured: /metrics is empty",)
    assert "not measured: /metrics is empty" in m.line()


# --- windows: the series summed, a counter reset ---------------------------


def test_a_window_sums_every_engine_and_counts_only_what_happened_in_it():
    engine = Engine(engines=2)
    engine.serve({0.05: 50}, engine=0)
    engine.serve({0.05: 50}, engine=1)
    start = engine.scrape("cyan", T0)
    engine.serve({0.05: 12, 0.3: 3}, abort=1, engine=0)
    engine.serve({0.05: 10}, error=2, engine=1)
    engine.waiting = 3
    w = window(start, engine.scrape("cyan", T0 + 30))
    assert (w.requests, w.errors, w.first_tokens, w.waiting, w.engine_restarted) == (25, 3, 25, 6.0, False)
    assert w.finished == {"stop": 22, "length": 0, "abort": 1, "error": 2, "repetition": 0}
    assert dict(w.ttft.buckets)[0.06] == 22 and dict(w.ttft.buckets)[0.5] == 25  # cumulative, in the window


def test_a_counter_that_went_backwards_counts_from_zero_and_the_measurement_says_the_engine_restarted():
    canary = Engine(created=False)  # no _created series: the fall of the counters alone shows it
    canary.serve({0.05: 100})
    start = canary.scrape("cyan", T0)
    canary.restart(T0 + 10)
    canary.serve({0.3: 30})  # after the restart: 30 requests, all of them in (0.25, 0.5]
    w = window(start, canary.scrape("cyan", T0 + 30))
    assert w.engine_restarted
    assert (w.requests, w.first_tokens) == (30, 30)  # as rate() counts a reset: the new value, never 30 - 100
    assert (w.p95().lower_s, w.p95().upper_s) == (0.25, 0.5)
    assert "the engine restarted in the window" in w.text()


def test_a_restart_whose_counts_already_exceed_the_old_ones_is_seen_by_its_created_timestamps():
    canary = Engine()
    canary.serve({0.05: 10})
    start = canary.scrape("cyan", T0)
    canary.restart(T0 + 5)
    canary.serve({0.05: 25})  # every counter is higher than before: only _created shows the restart
    w = window(start, canary.scrape("cyan", T0 + 30))
    assert w.engine_restarted and w.requests == 25  # not 25 - 10


def test_a_window_whose_end_is_not_after_its_start_is_an_error_measurement():
    engine = Engine()
    start = engine.scrape("cyan", T0)
    m = measure(1, settings(), (start, engine.scrape("cyan", T0)), None)
    assert m.verdict == Verdict.ERROR and "is not after its start" in m.reasons[0]


# --- one measurement: the threshold ----------------------------------------


def test_a_p95_whose_whole_bucket_is_under_the_threshold_passes():
    m = one_measurement({0.05: 40}, {0.05: 40})  # p95 in (0.04, 0.06]
    assert check(m, "ttft_p95_max_s").verdict == Verdict.PASS
    assert m.verdict == Verdict.PASS


def test_a_p95_whose_whole_bucket_is_over_the_threshold_fails():
    m = one_measurement({0.05: 30, 3.0: 10}, {0.05: 40})  # rank 38 in (2.5, 5]: above 0.5 for certain
    assert check(m, "ttft_p95_max_s").verdict == Verdict.FAIL
    assert check(m, "ttft_p95_max_s").reason == "TTFT p95 > 2.5 s, over ttft_p95_max_s 0.5"
    assert m.verdict == Verdict.FAIL


def test_at_the_threshold_the_bucket_ending_there_passes_and_the_bucket_starting_there_fails():
    ending = one_measurement({0.05: 30, 0.3: 10}, {0.05: 30, 0.3: 10})  # (0.25, 0.5]: p95 <= 0.5
    starting = one_measurement({0.05: 30, 0.6: 10}, {0.05: 30, 0.6: 10})  # (0.5, 0.75]: p95 > 0.5
    assert check(ending, "ttft_p95_max_s").verdict == Verdict.PASS
    assert check(ending, "ttft_p95_max_s").reason == "TTFT p95 <= 0.5 s, within ttft_p95_max_s 0.5"
    assert check(starting, "ttft_p95_max_s").verdict == Verdict.FAIL
    assert check(starting, "ttft_p95_max_s").reason == "TTFT p95 > 0.5 s, over ttft_p95_max_s 0.5"


def test_a_threshold_inside_the_p95s_bucket_is_stated_and_the_measurement_is_inconclusive():
    m = one_measurement({0.05: 30, 0.3: 10}, {0.05: 30, 0.3: 10}, config=settings(ttft_p95_max_s=0.3))
    found = check(m, "ttft_p95_max_s")
    assert found.verdict == Verdict.INCONCLUSIVE
    assert found.reason == "ttft_p95_max_s 0.3 lies inside the TTFT p95's bucket (0.25, 0.5] s: undecided"
    assert m.verdict == Verdict.INCONCLUSIVE


# --- one measurement: errors and the minimum --------------------------------


def test_the_error_share_is_exact_from_the_counters():
    at_limit = one_measurement({0.05: 100}, {0.05: 40}, abort=1)  # 1 of 100 = 1%: at most error_share_max
    over = one_measurement({0.05: 99}, {0.05: 40}, error=1)  # 1 of 99 > 1%
    assert check(at_limit, "error_share_max").verdict == Verdict.PASS
    assert check(over, "error_share_max").verdict == Verdict.FAIL
    assert check(over, "error_share_max").reason.startswith("1 of 99 requests ended in error or abort (1.01%), over")


def test_fewer_than_min_requests_is_inconclusive_and_nothing_else_is_judged():
    few = one_measurement({3.0: 19}, {0.05: 40}, error=19)  # slow and failing, but only 19 requests
    enough = one_measurement({0.05: 20}, {0.05: 40})
    assert few.verdict == Verdict.INCONCLUSIVE
    assert [c.rule for c in few.checks] == ["min_requests"]
    assert few.reasons == ("19 requests finished and 19 first tokens, fewer than min_requests 20: too few to judge",)
    assert enough.verdict == Verdict.PASS


# --- one measurement: the baseline -----------------------------------------

LENIENT = settings(ttft_p95_max_s=1.0)  # the threshold passes these: only the baseline decides


def test_a_canary_better_than_the_baseline_passes_it():
    m = one_measurement({0.05: 40}, {0.05: 30, 0.3: 10}, config=LENIENT)
    # canary (0.04, 0.06]; limit 1.5 x (0.25, 0.5] + 0.1 = (0.475, 0.85]: 0.06 <= 0.475
    assert check(m, "baseline").verdict == Verdict.PASS
    assert check(m, "baseline").reason == \
        "canary TTFT p95 <= 0.06 s, within 1.5 x baseline p95 + 0.1 s (0.475, 0.85] s"
    assert m.verdict == Verdict.PASS


def test_a_canary_worse_than_the_baseline_fails_even_under_the_fixed_threshold():
    m = one_measurement({0.05: 30, 0.6: 10}, {0.05: 40}, config=LENIENT)
    # canary (0.5, 0.75]; limit 1.5 x (0.04, 0.06] + 0.1 = (0.16, 0.19]: 0.5 >= 0.19
    assert check(m, "ttft_p95_max_s").verdict == Verdict.PASS
    assert check(m, "baseline").verdict == Verdict.FAIL
    assert check(m, "baseline").reason == "canary TTFT p95 > 0.5 s, over 1.5 x baseline p95 + 0.1 s (0.16, 0.19] s"
    assert m.verdict == Verdict.FAIL


def test_canary_and_baseline_in_the_same_bucket_pass_only_when_the_margin_covers_the_bucket():
    wide = one_measurement({0.05: 30, 0.3: 10}, {0.05: 30, 0.3: 10}, config=LENIENT)
    # both (0.25, 0.5]; limit (0.475, 0.85]: 0.5 > 0.475 and 0.25 < 0.85: undecided
    assert check(wide, "baseline").verdict == Verdict.INCONCLUSIVE
    assert check(wide, "baseline").reason == ("canary TTFT p95 (0.25, 0.5] s against 1.5 x baseline p95 + 0.1 s "
                                              "(0.475, 0.85] s: undecided")
    narrow = one_measurement({0.05: 30, 0.2: 10}, {0.05: 30, 0.2: 10}, config=LENIENT)
    # both (0.1, 0.25]; limit 1.5 x (0.1, 0.25] + 0.1 = (0.25, 0.475]: 0.25 <= 0.25
    assert check(narrow, "baseline").verdict == Verdict.PASS


def test_the_baseline_limit_is_computed_in_decimals_not_in_binary_floats():
    config = settings(ttft_p95_max_s=1.0, baseline_margin_s=0.01)
    m = one_measurement({0.09: 40}, {0.07: 40}, config=config)
    # canary (0.08, 0.1]; limit 1.5 x (0.06, 0.08] + 0.01 = (0.1, 0.13]: 0.1 <= 0.1. In floats
    # 1.5 * 0.06 + 0.01 is 0.09999999999999999, and the pass would be lost.
    assert 1.5 * 0.06 + 0.01 < 0.1
    assert check(m, "baseline").verdict == Verdict.PASS


def test_a_baseline_with_too_few_requests_is_inconclusive():
    m = one_measurement({0.05: 40}, {0.05: 5})
    assert check(m, "baseline").verdict == Verdict.INCONCLUSIVE
    assert check(m, "baseline").reason == \
        "baseline peacock had 5 first tokens, fewer than min_requests 20: no comparison"
    assert m.verdict == Verdict.INCONCLUSIVE


def test_an_unreadable_baseline_is_inconclusive_unless_the_canary_fails_on_its_own():
    c = Engine()
    start = c.scrape("cyan", T0)
    c.serve({0.05: 40})
    broken = (FailedScrape("peacock", T0, "did not answer within 10 s"),
              FailedScrape("peacock", T0 + 30, "did not answer within 10 s"))
    m = measure(1, settings(), (start, c.scrape("cyan", T0 + 30)), broken)
    assert m.verdict == Verdict.INCONCLUSIVE
    assert m.reasons == ("baseline peacock not measured: did not answer within 10 s: no comparison",)
    middle = c.scrape("cyan", T0 + 30)
    c.serve({3.0: 40})
    failing = measure(2, settings(), (middle, c.scrape("cyan", T0 + 60)), broken)
    assert failing.verdict == Verdict.FAIL


def test_a_baseline_that_stops_answering_for_the_whole_analysis_never_rolls_back_a_healthy_canary():
    # Every measurement: the canary serves well, the baseline node answers nothing (drained, down, cut off).
    # Were a missing baseline an error, consecutive_error_limit 4 would roll back the healthy canary.
    c = Engine()
    scrapes = [c.scrape("cyan", T0)]
    measurements = []
    for n in range(1, 5):
        c.serve({0.05: 40})
        scrapes.append(c.scrape("cyan", T0 + 30 * n))
        lost = (FailedScrape("peacock", T0 + 30 * (n - 1), "refused"), FailedScrape("peacock", T0 + 30 * n, "refused"))
        measurements.append(measure(n, settings(), (scrapes[-2], scrapes[-1]), lost))
    for inconclusive, action in (("pause", Action.PAUSE), ("pass", Action.CONTINUE)):
        result = assess(measurements, settings(inconclusive=inconclusive), canary="cyan", baseline="peacock")
        assert result.tally == {"pass": 0, "fail": 0, "inconclusive": 4, "error": 0}
        assert (result.phase, result.action) == (AnalysisPhase.INCONCLUSIVE, action)


def test_without_a_baseline_node_only_the_fixed_rules_judge_and_the_line_says_so():
    c = Engine()
    start = c.scrape("cyan", T0)
    c.serve({0.05: 40})
    m = measure(1, settings(), (start, c.scrape("cyan", T0 + 30)), None)
    assert [x.rule for x in m.checks] == ["min_requests", "ttft_p95_max_s", "error_share_max"]
    assert m.verdict == Verdict.PASS
    assert "baseline: none (no node on the old release)" in m.line()


# --- the analysis ----------------------------------------------------------


def made(verdict: Verdict, number: int = 1) -> object:
    """A measurement with the given verdict, made from real scrapes."""
    if verdict == Verdict.ERROR:
        e = Engine()
        return measure(number, settings(), (e.scrape("cyan", T0), FailedScrape("cyan", T0 + 30, "lost")), None)
    served = {Verdict.PASS: {0.05: 40}, Verdict.FAIL: {3.0: 40}, Verdict.INCONCLUSIVE: {0.05: 3}}[verdict]
    m = one_measurement(served, {0.05: 40}, number=number)
    assert m.verdict == verdict
    return m


P, F, I, E = Verdict.PASS, Verdict.FAIL, Verdict.INCONCLUSIVE, Verdict.ERROR


def run(verdicts, config=None, dry_run=False):
    config = config or settings()
    return assess([made(v, i + 1) for i, v in enumerate(verdicts)], config, canary="cyan", baseline="peacock",
                  dry_run=dry_run)


def test_one_flaky_measurement_is_tolerated():
    result = run([F, P, P, P])
    assert (result.phase, result.action, result.done) == (AnalysisPhase.PASSED, Action.CONTINUE, True)


def test_a_second_failed_measurement_fails_the_analysis_and_it_stops_early():
    assert run([F, P]).done is False
    result = run([F, P, F])
    assert (result.phase, result.action, result.done) == (AnalysisPhase.FAILED, Action.ROLLBACK, True)
    assert result.reason == "2 measurements failed, more than failure_limit 1"


def test_consecutive_errors_reaching_the_limit_fail_it_and_errors_apart_do_not():
    assert run([E, E, E]).phase == AnalysisPhase.RUNNING
    four = run([E, E, E, E])
    assert (four.phase, four.action) == (AnalysisPhase.FAILED, Action.ROLLBACK)
    assert four.reason == "4 measurements in a row could not be taken (consecutive_error_limit 4)"
    two = run([E, E], config=settings(consecutive_error_limit=2))
    assert (two.phase, two.done) == (AnalysisPhase.FAILED, True)
    apart = run([E, P, E, P], config=settings(consecutive_error_limit=2))
    assert apart.phase == AnalysisPhase.INCONCLUSIVE  # two measurements not taken, more than inconclusive_limit 1


@pytest.mark.parametrize("inconclusive", ["pass", "pause", "fail"])
def test_an_analysis_that_could_take_no_measurement_fails_even_when_its_error_limit_is_above_count(inconclusive):
    # A breaker's profile: consecutive_error_limit 50 with count 4 and inconclusive = "pass" let a canary
    # whose /metrics never read roll on.
    result = run([E, E, E, E], config=settings(consecutive_error_limit=50, inconclusive=inconclusive))
    assert (result.phase, result.action, result.done) == (AnalysisPhase.FAILED, Action.ROLLBACK, True), result.reason
    assert result.reason == "none of the 4 measurements could be taken (consecutive_error_limit 50 is above count 4)"
    assert run([E, P, E, E], config=settings(consecutive_error_limit=50)).phase == AnalysisPhase.INCONCLUSIVE


def test_after_count_measurements_a_few_unclear_ones_are_tolerated_and_more_are_inconclusive():
    assert run([P, I, P, P]).phase == AnalysisPhase.PASSED
    assert run([P, E, P, P]).phase == AnalysisPhase.PASSED  # what could not be seen is tolerated like an inconclusive one
    result = run([P, I, P, I])
    assert (result.phase, result.action) == (AnalysisPhase.INCONCLUSIVE, Action.PAUSE)


@pytest.mark.parametrize("choice, action, done_after", [("fail", Action.ROLLBACK, 2), ("pause", Action.PAUSE, 4),
                                                         ("pass", Action.CONTINUE, 4)])
def test_the_profile_chooses_what_an_inconclusive_analysis_does(choice, action, done_after):
    config = settings(inconclusive=choice)
    quiet = [I] * 4
    assert run(quiet[:done_after - 1], config).done is False
    result = run(quiet[:done_after], config)
    assert (result.phase, result.action, result.done) == (AnalysisPhase.INCONCLUSIVE, action, True)
    assert f'inconclusive = "{choice}"' in result.summary()


def test_a_dry_run_computes_everything_measures_to_the_end_and_says_what_it_would_have_done():
    failed = run([F, F], dry_run=True)
    assert (failed.phase, failed.action, failed.done) == (AnalysisPhase.FAILED, Action.ROLLBACK, False)
    assert failed.rollout_action == Action.MEASURE
    end = run([F, F, P, P], dry_run=True)
    assert (end.phase, end.action, end.done, end.rollout_action) == \
        (AnalysisPhase.FAILED, Action.ROLLBACK, True, Action.CONTINUE)
    assert "it would roll the canary back and stop the rollout; nothing acted on, the rollout goes on" in end.summary()
    assert end.document()["dry_run"] is True and end.document()["action"] == "rollback"
    for_real = run([F, F])
    assert for_real.rollout_action == Action.ROLLBACK


def test_more_measurements_than_count_is_a_bug_of_the_caller():
    with pytest.raises(ValueError, match="more than count 4"):
        run([P] * 5)


# --- the run, and what the operator reads ----------------------------------


def test_a_run_measures_each_interval_and_a_failed_scrape_costs_one_measurement():
    config = settings()
    canary, baseline = Engine(), Engine()
    state = AnalysisRun(config, "cyan", "peacock")
    at = T0
    state = state.record(canary.scrape("cyan", at), baseline.scrape("peacock", at))
    assert state.measurements == () and state.result.phase == AnalysisPhase.RUNNING
    plan = ["serve", "lost", "serve", "serve"]
    for step in plan:
        at += 30
        canary.serve({0.05: 40})
        baseline.serve({0.05: 40})
        scrape = canary.scrape("cyan", at) if step == "serve" else FailedScrape("cyan", at, "the node did not answer")
        state = state.record(scrape, baseline.scrape("peacock", at))
    verdicts = [m.verdict for m in state.measurements]
    assert verdicts == [P, E, P, P]
    third = state.measurements[2]
    assert (third.canary.start, third.canary.end, third.canary.requests) == (T0 + 30, T0 + 90, 80)  # two intervals
    assert state.result.phase == AnalysisPhase.PASSED and state.result.done
    with pytest.raises(ValueError, match="done"):
        state.record(canary.scrape("cyan", at + 30), baseline.scrape("peacock", at + 30))


def test_each_measurement_is_one_line_with_the_window_verdict_and_both_nodes_values():
    m = one_measurement({0.05: 30, 0.6: 10}, {0.05: 30, 0.2: 10})
    line = m.line()
    assert "\n" not in line
    assert line.startswith("measurement 1 of 4, 12:00:00Z-12:00:30Z: fail (TTFT p95 > 0.5 s, over ttft_p95_max_s 0.5;")
    # canary: rank 38, le 0.5 -> 30, (0.5, 0.75] holds 10: 0.5 + 0.25 x 8/10 = 0.7, shown to the bounds' 2 places
    assert "canary cyan: 0.5 < TTFT p95 <= 0.75 s (interpolated 0.70), 40 requests, 0 errors or aborts (0%)" in line
    # baseline: le 0.1 -> 30, (0.1, 0.25] holds 10: 0.1 + 0.15 x 8/10 = 0.22
    assert "baseline peacock: 0.1 < TTFT p95 <= 0.25 s (interpolated 0.22), 40 requests" in line
    assert "None" not in line


def test_each_measurement_is_one_row_of_the_table_under_its_header():
    from flatshare_ops.control.analysis import table_header

    m = one_measurement({0.05: 30, 0.6: 10}, {0.05: 30, 0.2: 10})
    header, row = table_header(), m.row()
    assert "\n" not in row and "None" not in row
    # Each value sits under its column's name: the header's words start where the row's cells do.
    columns = ["#", "canary", "window", "verdict", "TTFT p95 (s)", "requests", "errors", "baseline p95 (s)", "why"]
    starts = [header.index(name) for name in columns]

    def cell(name: str) -> str:
        return row[starts[columns.index(name)]:]

    assert cell("#").startswith("1/4 ") and cell("canary").startswith("cyan ")
    assert cell("window").startswith("12:00:00-12:00:30Z ") and cell("verdict").startswith("fail ")
    # canary: rank 38 in (0.5, 0.75], 0.5 + 0.25 x 8/10 = 0.70 to the bounds' 2 places; baseline 0.1 + 0.15 x 0.8
    assert cell("TTFT p95 (s)").startswith("(0.5, 0.75] ~0.70 ")
    assert row[:header.index("requests") + len("requests")].endswith("      40")  # right-aligned count
    assert cell("errors").startswith("0 (0%) ") and cell("baseline p95 (s)").startswith("(0.1, 0.25] ~0.22 ")
    assert cell("why").startswith("TTFT p95 > 0.5 s, over ttft_p95_max_s 0.5"), row


def test_the_document_is_json_and_carries_every_measurement_with_its_figures():
    result = run([F, P, P, P])
    document = json.loads(json.dumps(result.document(), allow_nan=False))
    assert (document["schema"], document["canary"], document["baseline"]) == (1, "cyan", "peacock")
    assert (document["phase"], document["action"], document["done"]) == ("passed", "continue", True)
    assert document["tally"] == {"pass": 3, "fail": 1, "inconclusive": 0, "error": 0}
    assert document["settings"]["ttft_p95_max_s"] == 0.5
    first = document["measurements"][0]
    assert first["verdict"] == "fail" and first["line"] == result.measurements[0].line()
    p95 = first["canary"]["ttft_p95"]
    assert (p95["lower_s"], p95["upper_s"], p95["observations"]) == (2.5, 5.0, 40)  # 40 first tokens of 3 s
    assert first["canary"]["ttft_buckets"]["+Inf"] == 40 and first["canary"]["ttft_buckets"]["2.5"] == 0
    assert first["canary"]["start"] == "2025-12-01T12:00:00Z"
    assert result.summary().startswith("analysis of canary cyan against baseline peacock: passed, 4 of 4 "
                                       "measurements (3 passed, 1 failed, 0 inconclusive, 0 not taken)")


def test_an_unbounded_p95_is_null_in_the_document_never_infinity():
    m = one_measurement({0.05: 37, 3000.0: 3}, {0.05: 40})
    document = json.loads(json.dumps(m.document(), allow_nan=False))
    assert document["canary"]["ttft_p95"]["upper_s"] is None and document["canary"]["ttft_p95"]["lower_s"] == 2560


# --- the threshold warning -------------------------------------------------


def test_a_threshold_on_a_bucket_bound_gets_no_warning_and_one_inside_a_bucket_gets_one_line():
    assert all(threshold_warnings(settings(ttft_p95_max_s=b)) == [] for b in TTFT_BOUNDS)
    (warning,) = threshold_warnings(settings(ttft_p95_max_s=0.3))
    assert warning == ("release.analysis.ttft_p95_max_s 0.3 is not one of vLLM 0.32.0's "
                       "vllm:time_to_first_token_seconds bucket bounds: a p95 in the bucket (0.25, 0.5] s can never "
                       "be decided against it (inconclusive); use 0.25 or 0.5")
    (beyond,) = threshold_warnings(settings(ttft_p95_max_s=3000.0))
    assert "(2560, +Inf) s" in beyond and beyond.endswith("use 2560")


def test_profiles_verify_warns_about_a_threshold_inside_a_bucket(checkout):
    child = checkout / "profiles" / "child.toml"
    child.write_text('extends = "rtx-5060-ti-serve.toml"\n[release.analysis]\nttft_p95_max_s = 0.3\n')
    result = run_cli("profiles", "verify", "--root", str(checkout), "--profile", "profiles/child.toml")
    assert result.returncode == 0, result.stderr
    assert "warning: release.analysis.ttft_p95_max_s 0.3 is not one of vLLM 0.32.0's" in result.stderr
    plain = run_cli("profiles", "verify", "--root", str(checkout))
    assert plain.returncode == 0 and "ttft_p95_max_s" not in plain.stderr


def test_a_scrape_from_a_real_prometheus_client_registry_reads_the_same(tmp_path):
    """vLLM writes its metrics with prometheus_client: a registry with vLLM's definitions reads as our texts."""
    from prometheus_client import CollectorRegistry, Counter as PromCounter, Gauge, Histogram as PromHistogram
    from prometheus_client.exposition import generate_latest

    registry = CollectorRegistry()
    labels = ["model_name", "engine"]
    ttft = PromHistogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                         labels, buckets=TTFT_BOUNDS, registry=registry)
    e2e = PromHistogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                        labels, buckets=E2E_BOUNDS, registry=registry)
    success = PromCounter("vllm:request_success", "Count of successfully processed requests.",
                          [*labels, "finished_reason"], registry=registry)
    Gauge("vllm:num_requests_waiting", "Number of requests waiting.", labels, registry=registry).labels(MODEL, "0")
    for reason in REASONS:
        success.labels(MODEL, "0", reason)
    for value in [0.05] * 30 + [0.3] * 10:
        ttft.labels(MODEL, "0").observe(value)
        e2e.labels(MODEL, "0").observe(2.0)
        success.labels(MODEL, "0", "stop").inc()
    scrape = read_scrape("cyan", T0, generate_latest(registry).decode())
    assert isinstance(scrape, Scrape), scrape
    ours = Engine()
    ours.serve({0.05: 30, 0.3: 10})
    mine = read_scrape("cyan", T0, ours.text())
    assert (scrape.ttft, scrape.e2e, dict(scrape.finished)) == (mine.ttft, mine.e2e, dict(mine.finished))
    assert quantile(0.95, scrape.ttft).interpolated_s == pytest.approx(0.45)


def test_reading_samples_first_leaves_prometheus_client_whole_for_a_later_import():
    # read_samples imports the parser alone (not the package's __init__); a thread that imports the client while the
    # first reads run (a breaker's case: it got an empty package), and the process after them, get all of it, and
    # its parser as its own attribute, as if read_samples had never run.
    import sys

    code = (
        "import sys, threading\n"
        "from flatshare_ops.common.vllm_metrics import read_samples\n"
        "read, imported = [], []\n"  # the first reads from several threads at once, as a rollout's
        "def client():\n"
        "    import prometheus_client\n"
        "    imported.append(prometheus_client.Counter)\n"
        "threads = [threading.Thread(target=lambda: read.append(read_samples('a_total 1\\n'))) for _ in range(8)]\n"
        "threads.insert(4, threading.Thread(target=client))\n"
        "[t.start() for t in threads]; [t.join() for t in threads]\n"
        "assert read == [[('a_total', {}, 1.0)]] * 8 and len(imported) == 1, (read, imported)\n"
        "import prometheus_client.parser\n"
        "from prometheus_client import CollectorRegistry, Counter\n"
        "from prometheus_client.exposition import generate_latest\n"
        "registry = CollectorRegistry()\n"
        "Counter('b', 'help', registry=registry).inc()\n"
        "text = generate_latest(registry).decode()\n"
        "families = list(prometheus_client.parser.text_string_to_metric_families(text))\n"
        "assert [s.name for f in families for s in f.samples][:1] == ['b_total'], families\n"
        "assert [s[0] for s in read_samples(text)][:1] == ['b_total']\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_a_label_set_the_parser_stumbles_on_is_a_failed_scrape_not_an_exception():
    # A breaker's case: prometheus_client's parser raises IndexError (not ValueError) for an empty label name after
    # a comma and a space; the analysis, which reads ValueError as a page that is not Prometheus' format, crashed.
    from flatshare_ops.common.vllm_metrics import read_samples

    text = 'vllm:num_requests_running{b="c", ="x"} 2\n'
    with pytest.raises(ValueError, match="not Prometheus' text format"):
        read_samples(text)
    assert isinstance(read_scrape("cyan", T0, text), FailedScrape)


def test_missing_windows_carry_the_node_and_times():
    m = made(Verdict.ERROR)
    assert isinstance(m.canary, MissingWindow)
    assert (m.canary.node, m.canary.start, m.canary.end) == ("cyan", T0, T0 + 30)
