"""A promtool unit-test suite for the rendered rules, written from a checkout's profile and inventory.

For every alert: input series that make it fire, with the exact labels and annotations expected
(written out here, the specification), and series that must not: a value at its threshold, a blip
shorter than its ``for``. The recordings are checked with ``promql_expr_test``. The thresholds come
from the checkout (so an operator's ``flatshare profiles set`` of them keeps the suite meaningful);
the inputs are placed around them. Prometheus' test format: docs/reference/monitoring.md,
"Prometheus rules and their tests". JSON is YAML, so the suite is written as JSON.
"""

from __future__ import annotations

import json
import math
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, cast

from flatshare_ops.config.inventory import load_inventory, node_profile_path
from flatshare_ops.config.profile import load_profile

#: vLLM 0.32.0's bucket bounds (docs/reference/monitoring.md, "vLLM's metrics").
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40,
                80, 160, 640, 2560]
REQUEST_BUCKETS = [0.3, 0.5, 0.8, 1, 1.5, 2, 2.5, 5, 10, 15, 20, 30, 40, 50, 60, 120, 240, 480, 960, 1920, 7680]

TTFT_P = "node_quantile:vllm_time_to_first_token_seconds:histogram_quantile5m"
E2E_P = "node_quantile:vllm_e2e_request_latency_seconds:histogram_quantile5m"
SHARE = "node:vllm_request_error_share:ratio_rate5m"


@dataclass
class Fleet:
    """What the suite reads from the checkout: the values the rules must have been rendered with."""

    nodes: list[str]
    min_serving: int
    runbook: str
    interval_s: int
    switch_budget_s: float
    ttft_p95_max_s: float
    error_share_max: float

    @classmethod
    def of(cls, root: Path) -> "Fleet":
        """The fleet of a checkout whose nodes all share their profile's values."""
        inventory = load_inventory(root / "profiles/fleet.toml")
        profiles = [load_profile(node_profile_path(root / "profiles/fleet.toml", n)).profile
                    for n in inventory.nodes.values()]
        p = profiles[0]
        # The checkout's fleet.toml gives min_serving as a count (a share is refused by the suite's alerts' maths).
        return cls(list(inventory.nodes), cast(int, inventory.min_serving), inventory.monitoring.runbook_url or "PRODUCTION.md",
                   p.check.interval_s,
                   p.engine.start_timeout_s + p.engine.stop_timeout_s + p.voice.drain_timeout_s + p.gateway.drain_timeout_s,
                   p.release.analysis.ttft_p95_max_s, p.release.analysis.error_share_max)


def _alert(labels: dict, summary: str, description: str, runbook: str) -> dict:
    return {"exp_labels": labels, "exp_annotations": {"summary": summary, "description": description,
                                                      "runbook_url": runbook}}


def _check(name: str, at: str, alerts: list[dict]) -> dict:
    return {"eval_time": at, "alertname": name, "exp_alerts": alerts}


def _bucket_series(name: str, node: str, bounds: list[float], per_step: Callable[[float], float], steps: int) -> list[dict]:
    """A histogram's cumulative bucket counters growing by ``per_step(bound)`` each step (and +Inf)."""
    series = []
    for bound in [*bounds, math.inf]:
        le = "+Inf" if bound == math.inf else repr(float(bound))
        series.append({"series": f'{name}_bucket{{node="{node}",le="{le}"}}', "values": f"0+{per_step(bound)}x{steps}"})
    return series


def suite(fleet: Fleet, rules_file: Path) -> dict:
    """The promtool test document for ``rules_file`` rendered with ``fleet``'s values."""
    I = fleet.interval_s
    step = lambda n: f"{n * I}s"  # noqa: E731 (eval times in steps of serving-check's interval)
    cyan, peacock = fleet.nodes[0], fleet.nodes[1]
    url = lambda alert: f"{fleet.runbook}#{alert.lower()}"  # noqa: E731
    last_run = "flatshare_serving_check_last_run_timestamp_seconds"
    fresh = lambda node, n=40: {"series": f'{last_run}{{node="{node}"}}', "values": f"0+{I}x{n}"}  # noqa: E731
    tests = []

    # serving-check CRITICAL / UNKNOWN for more than two runs.
    for status, word, name, severity in ((2, "CRITICAL", "FlatshareServingCheckCritical", "critical"),
                                         (3, "UNKNOWN", "FlatshareServingCheckUnknown", "warning")):
        fired = _alert({"severity": severity, "node": cyan, "check": "flags"},
                       f"serving-check on {cyan}: flags is {word}",
                       f"serving-check on {cyan} has found its flags check {word} (status {status}) for more than "
                       f"{2 * I} s, two of its runs; 'flatshare check --node {cyan}' says what it found.", url(name))
        tests.append({"interval": f"{I}s", "input_series": [
            {"series": f'flatshare_serving_check_status{{node="{cyan}",check="flags"}}', "values": f"{status}x10"},
            {"series": f'flatshare_serving_check_status{{node="{cyan}",check="drop_ins"}}', "values": f"{status - 1}x10"},
            {"series": f'flatshare_serving_check_status{{node="{peacock}",check="flags"}}', "values": f"0 {status} {status} 0x10"},
            {"series": f'flatshare_serving_check_status{{node="{peacock}",check="systemd"}}', "values": f"{5 - status}x10"},
        ], "alert_rule_test": [
            _check(name, step(1), []), _check(name, step(3), [fired]), _check(name, step(4), [fired]),
        ]})

    # serving-check not run: its last run older than 3 intervals, for one interval.
    name = "FlatshareServingCheckNotRun"
    tests.append({"interval": f"{I}s", "input_series": [
        {"series": f'{last_run}{{node="{cyan}"}}', "values": f"0+{I}x5 {5 * I}x20"},
        {"series": f'{last_run}{{node="{peacock}"}}', "values": f"0+{I}x5 {5 * I}x3 {10 * I}+{I}x10"},
    ], "alert_rule_test": [
        _check(name, step(8), []),   # 3 intervals old: at the threshold
        _check(name, step(9), []),   # older, but not yet for an interval (peacock's run comes back at step 10)
        _check(name, step(10), [_alert(
            {"severity": "warning", "node": cyan},
            f"serving-check has not run on {cyan} for {5 * I} s",
            f"serving-check's last run on {cyan} was {5 * I} s ago, more than 3 of its {I} s intervals: its timer "
            "or cron job does not run it, or it cannot write its textfile.", url(name))]),
    ]})

    # serving-check absent: an inventory node without its textfile, for 3 intervals.
    name = "FlatshareServingCheckAbsent"
    absent = _alert({"severity": "warning", "node": cyan}, f"No serving-check textfile from {cyan}",
                    f"Prometheus has had no {last_run} from the inventory's node {cyan} for {3 * I} s: its textfile "
                    "is missing, node_exporter does not read its directory, or serving-check names the node otherwise.",
                    url(name))
    tests.append({"interval": f"{I}s", "input_series": [fresh(peacock)], "alert_rule_test": [
        _check(name, f"{3 * I - tick(I)}s", []), _check(name, step(4), [absent])]})
    tests.append({"interval": f"{I}s", "input_series": [
        fresh(peacock), {"series": f'{last_run}{{node="{cyan}"}}', "values": f"_ _ {2 * I}+{I}x10"}],
        "alert_rule_test": [_check(name, step(4), [])]})

    # serving-check's textfile as node_exporter sees it: its modification time older than 3 intervals, for one.
    name = "FlatshareServingCheckTextfileStale"
    mtime = "node_textfile_mtime_seconds"
    ours = "/var/lib/prometheus/node-exporter/serving_check.prom"
    tests.append({"interval": f"{I}s", "input_series": [
        {"series": f'{mtime}{{file="{ours}",instance="{cyan}:9100",job="node"}}', "values": f"0+{I}x5 {5 * I}x20"},
        # An older node_exporter names the file alone; this one's file comes back before an interval passed.
        {"series": f'{mtime}{{file="serving_check.prom",instance="{peacock}:9100",job="node"}}',
         "values": f"0+{I}x5 {5 * I}x3 {10 * I}+{I}x10"},
        # Another file of the directory, as old: not serving-check's.
        {"series": f'{mtime}{{file="/var/lib/prometheus/node-exporter/other.prom",instance="{cyan}:9100",job="node"}}',
         "values": "0x25"},
    ], "alert_rule_test": [
        _check(name, step(8), []),   # 3 intervals old: at the threshold
        _check(name, step(9), []),   # older, not yet for an interval
        _check(name, step(10), [_alert(
            {"severity": "warning", "instance": f"{cyan}:9100", "job": "node", "file": ours},
            f"serving-check's textfile on {cyan}:9100 is {5 * I} s old",
            f"node_exporter on {cyan}:9100 serves {ours}, last written {5 * I} s ago, more than 3 of serving-check's "
            f"{I} s intervals: serving-check no longer replaces it (its timer does not run it, or it cannot write "
            "there).", url(name))]),
    ]})

    # node_exporter's textfile collector failing.
    name = "FlatshareTextfileCollectorError"
    tests.append({"interval": f"{I}s", "input_series": [
        {"series": f'node_textfile_scrape_error{{instance="{cyan}:9100",job="node"}}', "values": "1x10"},
        {"series": f'node_textfile_scrape_error{{instance="{peacock}:9100",job="node"}}', "values": "0 1 0x10"},
    ], "alert_rule_test": [
        _check(name, step(1), []),
        _check(name, step(3), [_alert(
            {"severity": "warning", "instance": f"{cyan}:9100", "job": "node"},
            f"node_exporter on {cyan}:9100 cannot read a textfile",
            f"node_textfile_scrape_error has been 1 on {cyan}:9100 for {2 * I} s: node_exporter's textfile "
            "collector failed to read a file, serving-check's among them perhaps.", url(name))]),
    ]})

    # An unfinished switch older than its start budget plus its stop and drain timeouts.
    name = "FlatshareSwitchUnfinished"
    budget = fleet.switch_budget_s
    t0 = math.ceil(budget / I) + 5
    started = t0 * I - budget  # at step t0 the switch is exactly the budget old
    switch = "flatshare_serving_check_switch_started_timestamp_seconds"
    tests.append({"interval": f"{I}s", "input_series": [
        {"series": f'{switch}{{node="{cyan}"}}', "values": f"{started!r}x{t0 + 10}"},
        {"series": f'{switch}{{node="{peacock}"}}', "values": f"{started!r}x{t0} stale"},  # ends while pending
    ], "alert_rule_test": [
        _check(name, step(t0), []),
        _check(name, step(t0 + 1), []),
        _check(name, step(t0 + 2), [_alert(
            {"severity": "warning", "node": cyan},
            f"A switch on {cyan} started {budget + 2 * I:.0f} s ago and has not finished",
            f"The switch in releases/switching.json on {cyan} started {budget + 2 * I:.0f} s ago, longer than its "
            f"engine start budget plus its stop and drain timeouts ({budget:g} s): it is stuck, or a killed run "
            "left it.", url(name))]),
    ]})

    # Fewer nodes taking calls than min_serving.
    name = "FlatshareTooFewNodesTakeCalls"
    m = fleet.min_serving
    takes = lambda node, values: {"series": f'flatshare_serving_check_takes_calls{{node="{node}"}}', "values": values}  # noqa: E731

    def too_few(count: int) -> dict:
        return _alert({"severity": "critical"}, f"{count} node(s) take calls, fewer than min_serving ({m})",
                      f"{count} of the fleet's nodes ({', '.join(fleet.nodes)}) have taken calls, as serving-check saw "
                      f"them in the last {3 * I} s, for {2 * I} s; the fleet needs at least {m} (min_serving in "
                      "profiles/fleet.toml).", url(name))

    if m > 0:
        serving = fleet.nodes[:m]

        def calls(blip: str | None = None) -> list[dict]:
            """min_serving - 1 nodes take calls; the last of ``serving`` takes them as ``blip`` says (or not)."""
            return [takes(n, blip if n == serving[-1] and blip else "1x20" if n in serving[:-1] else "0x20")
                    for n in fleet.nodes]

        everyone_fresh = [fresh(n) for n in fleet.nodes]
        tests.append({"interval": f"{I}s", "input_series": [*everyone_fresh, *calls()],
                      "alert_rule_test": [_check(name, step(1), []), _check(name, step(3), [too_few(m - 1)])]})
        tests.append({"interval": f"{I}s", "input_series": [*everyone_fresh, *calls("1x20")],  # at the threshold
                      "alert_rule_test": [_check(name, step(5), [])]})
        tests.append({"interval": f"{I}s", "input_series": [*everyone_fresh, *calls("1 0 0 1x20")],  # a blip
                      "alert_rule_test": [_check(name, step(3), []), _check(name, step(4), [])]})
        tests.append({"interval": f"{I}s",  # a node that says it takes calls, but whose serving-check stopped
                      "input_series": [*(fresh(n) for n in fleet.nodes if n != serving[-1]), *calls("1x20"),
                                       {"series": f'{last_run}{{node="{serving[-1]}"}}', "values": "0x20"}],
                      "alert_rule_test": [_check(name, step(5), []), _check(name, step(6), [too_few(m - 1)])]})

    # Time to first token p95 over the profile's threshold, from vLLM's histogram (the whole chain).
    name = "FlatshareTimeToFirstTokenHigh"
    limit = fleet.ttft_p95_max_s
    fast = max([b for b in TTFT_BUCKETS if b <= limit] or TTFT_BUCKETS[:1])
    above = [b for b in TTFT_BUCKETS if b > limit]
    slow_lo, slow_hi = above[0], above[1]
    p95 = slow_lo + (slow_hi - slow_lo) * 0.5  # 90 of 100 at or below `fast`, 10 in (slow_lo, slow_hi]
    steps = 20 * 60 // I
    per_step = lambda b: 0 if b < fast else 90 if b < slow_hi else 100  # noqa: E731
    ttft = _bucket_series("vllm:time_to_first_token_seconds", cyan, TTFT_BUCKETS, per_step, steps)
    e2e = _bucket_series("vllm:e2e_request_latency_seconds", cyan, REQUEST_BUCKETS,
                         lambda b: 0 if b < 1.5 else 100, steps)
    tests.append({"interval": f"{I}s", "input_series": [
        *ttft, *e2e,
        {"series": f'{TTFT_P}{{node="{peacock}",quantile="0.95"}}', "values": f"{limit!r}x{steps}"},
    ], "alert_rule_test": [
        _check(name, "5m", []),  # above since its first rate at one step: not yet for 5m
        _check(name, "10m", [_alert(
            {"severity": "warning", "node": cyan, "quantile": "0.95"},
            f"Time to first token p95 on {cyan} is {p95:.3f} s, above {limit:g} s",
            f"The p95 of vllm:time_to_first_token_seconds over 5m on {cyan} has been above {limit:g} s "
            f"(release.analysis.ttft_p95_max_s, the canary analysis' threshold) for 5m: {p95:.3f} s. It counts "
            "every request on the engine: vLLM's histogram does not tell voice calls from agents' requests.",
            url(name))]),
    ], "promql_expr_test": [
        {"expr": f'count by (node, quantile) ({TTFT_P}{{quantile="0.5"}} > {_prev(TTFT_BUCKETS, fast)!r} <= {fast!r})',
         "eval_time": "10m", "exp_samples": [{"labels": f'{{node="{cyan}",quantile="0.5"}}', "value": 1}]},
        {"expr": f'count by (node, quantile) ({TTFT_P}{{quantile=~"0.95|0.99"}} > {slow_lo!r} <= {slow_hi!r})',
         "eval_time": "10m", "exp_samples": [{"labels": f'{{node="{cyan}",quantile="0.95"}}', "value": 1},
                                             {"labels": f'{{node="{cyan}",quantile="0.99"}}', "value": 1}]},
        {"expr": f"count by (node, quantile) ({E2E_P} > 1 <= 1.5)", "eval_time": "10m",
         "exp_samples": [{"labels": f'{{node="{cyan}",quantile="{q}"}}', "value": 1} for q in ("0.5", "0.95", "0.99")]},
    ]})
    tests.append({"interval": f"{I}s", "input_series": [  # above the threshold for less than the alert's 5m
        {"series": f'{TTFT_P}{{node="{cyan}",quantile="0.95"}}', "values": f"{slow_hi!r}x{4 * 60 // I - 1} {limit!r}x{steps}"},
    ], "alert_rule_test": [_check(name, "5m", []), _check(name, "6m", [])]})

    # Requests ending in error or abort over the profile's share, from vLLM's counter (the whole chain).
    name = "FlatshareRequestErrorShareHigh"
    share = fleet.error_share_max
    total = 1000
    failing = min(total, math.floor(share * total) + 40)
    counter = "vllm:request_success_total"
    percent = f"{failing / total * 100:.4g}%"
    tests.append({"interval": f"{I}s", "input_series": [
        {"series": f'{counter}{{node="{cyan}",finished_reason="stop"}}', "values": f"0+{total - failing}x{steps}"},
        {"series": f'{counter}{{node="{cyan}",finished_reason="error"}}', "values": f"0+{failing // 2}x{steps}"},
        {"series": f'{counter}{{node="{cyan}",finished_reason="abort"}}', "values": f"0+{failing - failing // 2}x{steps}"},
        {"series": f'{SHARE}{{node="{peacock}"}}', "values": f"{share!r}x{steps}"},
    ], "alert_rule_test": [
        _check(name, "5m", []),
        _check(name, "10m", [_alert(
            {"severity": "warning", "node": cyan},
            f"{percent} of requests on {cyan} end in error or abort",
            f"{percent} of the requests that finished on {cyan} over 5m ended in error or abort "
            f"(vllm:request_success_total's finished_reason), above {share:g} (release.analysis.error_share_max, "
            "the canary analysis' threshold), for 5m.", url(name))]),
    ], "promql_expr_test": [
        {"expr": f"count by (node) ({SHARE} > {failing / total - 1e-9!r} < {failing / total + 1e-9!r})",
         "eval_time": "10m", "exp_samples": [{"labels": f'{{node="{cyan}"}}', "value": 1}]},
    ]})
    tests.append({"interval": f"{I}s", "input_series": [  # a blip; and an engine with no requests at all (no share)
        {"series": f'{SHARE}{{node="{cyan}"}}', "values": f"1x{4 * 60 // I - 1} {share!r}x{steps}"},
        {"series": f'{counter}{{node="{peacock}",finished_reason="error"}}', "values": f"0x{steps}"},
        {"series": f'{counter}{{node="{peacock}",finished_reason="stop"}}', "values": f"0x{steps}"},
    ], "alert_rule_test": [_check(name, "5m", []), _check(name, "6m", []), _check(name, "12m", [])]})

    return {"rule_files": [str(rules_file)], "evaluation_interval": f"{tick(I)}s", "tests": tests}


def tick(interval_s: int) -> int:
    """How often the suite evaluates the rules: at least four times per input step (so that a `for` a
    little too short or too long shows), on a divisor of the step (so every step is an evaluation)."""
    return next(d for d in range(max(1, interval_s // 4), 0, -1) if interval_s % d == 0)


def _prev(bounds: list[float], bound: float) -> float:
    i = bounds.index(bound)
    return bounds[i - 1] if i else 0.0


def run_promtool(root: Path, scratch: Path) -> subprocess.CompletedProcess:
    """``promtool test rules`` of the suite for ``root``'s rendered rules (written to ``scratch``)."""
    test_file = scratch / "flatshare-rules.test.yml"
    test_file.write_text(json.dumps(suite(Fleet.of(root), (root / "monitoring/flatshare-rules.yml").resolve()), indent=1))
    return subprocess.run(["promtool", "test", "rules", str(test_file)], capture_output=True, text=True, timeout=120)
