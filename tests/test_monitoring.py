"""The fleet's alert rules and dashboard (monitoring/): valid to promtool, each alert firing and not firing
as its rule says, every metric they read existing where it comes from, every runbook link landing on a
heading of PRODUCTION.md as GitHub renders it, and serving-check's new series as a real run writes them."""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest
import yaml
from markdown_it import MarkdownIt

import monitoring_names
import promtool_suite
from conftest import REPO, loopback_pair, run_cli, scratch_sandbox
from flatshare_ops.check.facts import parse_metrics


@pytest.fixture(autouse=True, scope="module")
def promtool_installed():
    """promtool is a real part of these tests, never skipped: scripts/setup.sh installs it."""
    assert shutil.which("promtool"), "promtool missing: run scripts/setup.sh (Debian's prometheus package)"

RULES = REPO / "monitoring/flatshare-rules.yml"
VLLM_METRICS = REPO / "tests/fixtures/vllm-0.32.0-metrics.txt"
#: node_exporter's own textfile-collector series (node_exporter's collector/textfile.go).
NODE_EXPORTER_TEXTFILE = {"node_textfile_scrape_error", "node_textfile_mtime_seconds"}
#: This module's own sandbox addresses.
ADDRESSES = loopback_pair(76)


def test_promtool_accepts_the_rendered_rules():
    import subprocess

    result = subprocess.run(["promtool", "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(monitoring_names.rules())} rules found" in result.stdout


def test_every_alert_fires_on_its_input_and_not_at_its_threshold_or_on_a_blip(tmp_path):
    result = promtool_suite.run_promtool(REPO, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    tested = {t["alertname"] for case in json.loads((tmp_path / "flatshare-rules.test.yml").read_text())["tests"]
              for t in case.get("alert_rule_test", [])}
    assert tested == {r["alert"] for r in monitoring_names.rules() if "alert" in r}


def test_the_rules_follow_the_profiles_values_when_an_operator_changes_them(checkout, tmp_path):
    for key, value in (("release.analysis.ttft_p95_max_s", "0.25"), ("release.analysis.error_share_max", "0.05"),
                       ("check.interval_s", "30"), ("voice.drain_timeout_s", "120")):
        result = run_cli("profiles", "set", key, value, "--root", str(checkout))
        assert result.returncode == 0, result.stderr
    rules = (checkout / "monitoring/flatshare-rules.yml").read_text()
    assert '{quantile=\\"0.95\\"} > 0.25"' in rules and "ratio_rate5m > 0.05" in rules
    result = promtool_suite.run_promtool(checkout, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_node_on_a_variant_with_its_own_threshold_is_judged_by_it(checkout, tmp_path):
    from flatshare_ops.config.profile import load_profile

    # cyan's threshold is production's (whatever the operator set), peacock's variant's 0.25 s above it; both
    # engines' p95 lies between the two.
    limit = load_profile(checkout / "profiles/rtx-5060-ti-serve.toml").profile.release.analysis.ttft_p95_max_s
    p95 = round(limit + 0.1, 3)
    variant = checkout / "profiles/rtx-5060-ti-serve-vllm-0.33.toml"
    variant.write_text(variant.read_text() + f"\n[release.analysis]\nttft_p95_max_s = {limit + 0.25:g}\n")
    fleet = checkout / "profiles/fleet.toml"
    text = fleet.read_text()
    at = text.index("[nodes.peacock]")
    fleet.write_text(text[:at] + text[at:].replace('profile = "rtx-5060-ti-serve.toml"',
                                                   'profile = "rtx-5060-ti-serve-vllm-0.33.toml"', 1))
    assert run_cli("profiles", "render", "--update", "--root", str(checkout)).returncode == 0
    series = "node_quantile:vllm_time_to_first_token_seconds:histogram_quantile5m"
    suite = {"rule_files": [str(checkout / "monitoring/flatshare-rules.yml")], "evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        "input_series": [{"series": f'{series}{{node="cyan",quantile="0.95"}}', "values": f"{p95:g}x20"},
                         {"series": f'{series}{{node="peacock",quantile="0.95"}}', "values": f"{p95:g}x20"}],
        "alert_rule_test": [{"eval_time": "10m", "alertname": "FlatshareTimeToFirstTokenHigh", "exp_alerts": [{
            "exp_labels": {"severity": "warning", "node": "cyan", "quantile": "0.95"},
            "exp_annotations": {
                "summary": f"Time to first token p95 on cyan is {p95:.3f} s, above {limit:g} s",
                "description": f"The p95 of vllm:time_to_first_token_seconds over 5m on cyan has been above {limit:g} s "
                               f"(release.analysis.ttft_p95_max_s, the canary analysis' threshold) for 5m: {p95:.3f} s. "
                               "It counts every request on the engine: vLLM's histogram does not tell voice calls "
                               "from agents' requests.",
                "runbook_url": "https://github.com/flatshare/flatshare-ops/blob/main/PRODUCTION.md"
                               "#flatsharetimetofirsttokenhigh"}}]}]}]}
    (tmp_path / "t.yml").write_text(json.dumps(suite))
    import subprocess

    result = subprocess.run(["promtool", "test", "rules", str(tmp_path / "t.yml")], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_hand_edit_of_the_rendered_rules_is_drift(checkout):
    rules = checkout / "monitoring/flatshare-rules.yml"
    rules.write_text(rules.read_text().replace('for: "5m"', 'for: "1h"'))
    result = run_cli("profiles", "render", "--root", str(checkout))
    assert result.returncode == 1 and "--- a/monitoring/flatshare-rules.yml" in result.stdout
    assert '-        for: "1h"\n+        for: "5m"' in result.stdout


# --- every metric name exists ---------------------------------------------------------------------


def test_every_name_the_rules_and_dashboard_read_comes_from_serving_check_node_exporter_or_vllm():
    names = monitoring_names.used_names()
    unknown = sorted(n for n in names if not n.startswith(("flatshare_serving_check_", "vllm:"))
                     and n not in NODE_EXPORTER_TEXTFILE)
    assert unknown == []


def test_vllm_0_32_0s_metrics_have_every_engine_name_the_rules_and_dashboard_read():
    assert monitoring_names.missing_engine_names(VLLM_METRICS.read_text()) == []


def test_a_name_the_engine_does_not_serve_is_reported_missing():
    text = "".join(line for line in VLLM_METRICS.read_text().splitlines(keepends=True)
                   if not line.startswith("vllm:num_requests_waiting"))
    assert monitoring_names.missing_engine_names(text) == ["vllm:num_requests_waiting"]


def test_the_dashboard_shows_what_operators_watch():
    exprs = " ".join(monitoring_names.dashboard_exprs())
    for name in ("flatshare_serving_check_status", "flatshare_serving_check_takes_calls",
                 "flatshare_serving_check_active_release_info", "flatshare_serving_check_switch_started_timestamp_seconds",
                 "node_quantile:vllm_time_to_first_token_seconds:histogram_quantile5m",
                 "node_quantile:vllm_e2e_request_latency_seconds:histogram_quantile5m",
                 "vllm:num_requests_running", "vllm:num_requests_waiting"):
        assert name in exprs, name
    recorded = {r["record"] for r in monitoring_names.rules() if "record" in r}
    for expr in monitoring_names.dashboard_exprs():
        monitoring_names.promql_names(expr)  # parses (raises otherwise)
    assert {n for e in monitoring_names.dashboard_exprs() for n in monitoring_names.promql_names(e)
            if ":" in n and not n.startswith("vllm:")} <= recorded


# --- runbook links ---------------------------------------------------------------------------------


def github_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a document's headings: the heading's text lowercased, every character
    but letters, digits, ``_``, ``-`` and spaces dropped, spaces made ``-``; a repeat gets ``-1``, ``-2``..."""
    tokens = MarkdownIt().parse(markdown)
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    for i, token in enumerate(tokens):
        if token.type != "heading_open":
            continue
        text = "".join(child.content for child in tokens[i + 1].children or []
                       if child.type in ("text", "code_inline"))
        slug = re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def test_github_anchors_follow_githubs_rules():
    assert github_anchors("# A `b` c!\n## A b c\n```\n# not a heading\n```\n### Run: serving-check\n") == {
        "a-b-c", "a-b-c-1", "run-serving-check"}


def test_every_runbook_url_lands_on_a_section_of_production_md():
    import tomllib

    base = tomllib.loads((REPO / "profiles/fleet.toml").read_text())["monitoring"]["runbook_url"]
    anchors = github_anchors((REPO / "PRODUCTION.md").read_text())
    links = [r["annotations"]["runbook_url"] for r in monitoring_names.rules() if "alert" in r]
    assert links and all(link.startswith(base + "#") for link in links), links
    assert sorted(link.split("#", 1)[1] for link in links if link.split("#", 1)[1] not in anchors) == []


# --- serving-check's series, as a real run writes them ----------------------------------------------


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """A sandbox fleet of this module's own (its own addresses), up for the module's tests."""
    with scratch_sandbox(tmp_path_factory, "monitoring", ADDRESSES) as (_, _checkout, base):
        yield base


def _textfile(fleet: Path, tmp_path: Path, name: str = "cyan") -> str:
    from flatshare_ops.sandbox.fleet import SandboxNode

    node = SandboxNode(name, ADDRESSES[name], fleet)
    run_cli("--state-dir", str(node.state_dir), "--runtime-dir", str(node.manager.runtime_dir), "--node-name", name,
            "--quiet", "--textfile", str(tmp_path), program="serving-check")
    return (tmp_path / "serving_check.prom").read_text()


def _samples(text: str) -> dict[str, str]:
    """Sample line (name and labels) -> value, as the text format writes them."""
    return dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))


def test_serving_checks_textfile_has_every_name_the_rules_and_dashboard_read(fleet, tmp_path):
    from flatshare_ops.sandbox.fleet import SandboxNode

    node = SandboxNode("cyan", ADDRESSES["cyan"], fleet)
    journal = node.state_dir / "releases/switching.json"
    started = time.time() - 100
    journal.write_text(json.dumps({"schema": 2, "from": "a", "to": "b", "pid": 999999, "started_at": started}))
    try:
        text = _textfile(fleet, tmp_path)
    finally:
        journal.unlink()
    ours = {n for n in monitoring_names.used_names() if n.startswith("flatshare_serving_check_")}
    assert monitoring_names.missing_names(text, ours) == []
    samples = _samples(text)
    release = os.readlink(node.state_dir / "releases/current")
    assert samples['flatshare_serving_check_switch_started_timestamp_seconds{node="cyan"}'] == f"{started:.3f}"
    assert samples[f'flatshare_serving_check_active_release_info{{node="cyan",release="{release}",'
                   'profile="rtx-5060-ti-serve",vllm_release="0.32.0"}'] == "1"
    assert samples['flatshare_serving_check_takes_calls{node="cyan"}'] == "1"
    assert set(parse_metrics(text)) == ours  # and nothing the rules do not know


def test_a_stopped_gateway_or_a_drain_file_means_the_node_takes_no_calls(fleet, tmp_path):
    from flatshare_ops.common.http import wait_for_200
    from flatshare_ops.sandbox.fleet import SandboxNode
    from flatshare_ops.common.systemd import ManagerAddress, connect, run_job

    node = SandboxNode("peacock", ADDRESSES["peacock"], fleet)
    serving = json.loads((node.state_dir / "releases/current/serving.json").read_text())
    with connect(ManagerAddress("user", node.manager.runtime_dir)) as bus:
        run_job(bus, "stop", "flatshare-gateway.service", 30)
    try:
        text = _textfile(fleet, tmp_path, "peacock")
        assert _samples(text)['flatshare_serving_check_takes_calls{node="peacock"}'] == "0"
        assert "switch_started" not in text  # no switch: no series, never a guess
    finally:
        with connect(ManagerAddress("user", node.manager.runtime_dir)) as bus:
            run_job(bus, "start", "flatshare-gateway.service", 30)
        assert wait_for_200(serving["gateway"]["url"] + "/health", 30) == 200
    drain = Path(serving["voice"]["drain_file"])
    drain.write_text("left-over\n")
    try:
        assert _samples(_textfile(fleet, tmp_path, "peacock"))['flatshare_serving_check_takes_calls{node="peacock"}'] == "0"
    finally:
        drain.unlink()
    assert _samples(_textfile(fleet, tmp_path, "peacock"))['flatshare_serving_check_takes_calls{node="peacock"}'] == "1"


def test_a_damaged_journal_gives_its_last_change_as_the_switch_start(fleet, tmp_path):
    from flatshare_ops.sandbox.fleet import SandboxNode

    journal = SandboxNode("cyan", ADDRESSES["cyan"], fleet).state_dir / "releases/switching.json"
    journal.write_bytes(b"\xff\xfe torn")
    try:
        changed = journal.stat().st_mtime
        text = _textfile(fleet, tmp_path)
    finally:
        journal.unlink()
    assert _samples(text)['flatshare_serving_check_switch_started_timestamp_seconds{node="cyan"}'] == f"{changed:.3f}"


def test_the_rules_file_is_what_pyyaml_reads():
    document = yaml.safe_load(RULES.read_text())
    assert [g["name"] for g in document["groups"]] == ["flatshare-recordings", "flatshare-alerts"]
    for rule in document["groups"][1]["rules"]:
        assert rule["alert"].startswith("Flatshare") and rule["labels"]["severity"] in ("critical", "warning", "info")
        assert set(rule["annotations"]) == {"summary", "description", "runbook_url"}


def test_the_dashboards_release_annotation_marks_the_minute_a_node_switched_and_no_other(tmp_path):
    # Issue 35: an operator looking at a rise in time to first token could not see which release came before
    # it. The annotation's query, as Grafana sends it with every node chosen ($node as .*), run by promtool on
    # series where cyan switches from release A to B at minute 10 (serving-check's active-release series).
    import json
    import subprocess

    document = json.loads((REPO / "monitoring/flatshare-dashboard.json").read_text())
    (release, switch) = [a["expr"].replace("$node", ".*") for a in document["annotations"]["list"]]
    info = 'flatshare_serving_check_active_release_info{{node="cyan",release="{}",profile="p",vllm_release="0.32.0"}}'
    started = 'flatshare_serving_check_switch_started_timestamp_seconds{node="cyan"}'
    test = {"rule_files": [], "evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        # promtool's notation: "1x9" is ten samples (minutes 0-9), "_x10" ten missing ones.
        "input_series": [{"series": info.format("A"), "values": "1x9 _x20"},
                         {"series": info.format("B"), "values": "_x10 1x19"},
                         {"series": 'flatshare_serving_check_active_release_info{node="peacock",release="C",'
                                    'profile="p",vllm_release="0.32.0"}', "values": "1x30"},
                         {"series": started, "values": "_x8 600x2 _x20"}],  # a switch began at minute 8
        "promql_expr_test": [
            {"expr": release, "eval_time": "5m", "exp_samples": []},
            {"expr": release, "eval_time": "10m", "exp_samples": [{"labels": info.format("B"), "value": 1}]},
            {"expr": release, "eval_time": "11m", "exp_samples": [{"labels": info.format("B"), "value": 1}]},
            {"expr": release, "eval_time": "13m", "exp_samples": []},
            {"expr": switch, "eval_time": "5m", "exp_samples": []},
            {"expr": switch, "eval_time": "9m", "exp_samples": [{"labels": started, "value": 600}]},
            {"expr": switch, "eval_time": "12m", "exp_samples": []},
        ]}]}
    path = tmp_path / "annotations_test.yml"
    path.write_text(json.dumps(test))  # YAML is a superset of JSON
    result = subprocess.run(["promtool", "test", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    variable = next(v for v in document["templating"]["list"] if v["name"] == "node")
    assert variable["query"]["query"] == "label_values(flatshare_serving_check_last_run_timestamp_seconds, node)"
    for panel in document["panels"]:  # every query follows the chosen nodes
        for target in panel["targets"]:
            assert 'node=~"$node"' in target["expr"], target["expr"]
