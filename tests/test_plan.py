"""The plan restarts exactly what changed, compared by meaning (node/plan.py, common/unit_file.py).

Pure: two releases rendered from the production profile, one of them edited as a change would edit it.
The sandbox tests (test_release_changes.py) check the same rules against systemd's InvocationIDs.
"""

from __future__ import annotations

import copy
import json

import pytest

from conftest import REPO
from flatshare_ops.common import unit_file
from flatshare_ops.config.profile import load_profile
from flatshare_ops.node.plan import ReleaseView, plan
from flatshare_ops.node.store import release_id
from flatshare_ops.render import render_profile

DRAINS = {"drain-voice", "stop-gateway"}


@pytest.fixture(scope="module")
def release() -> ReleaseView:
    rendered = render_profile(load_profile(REPO / "profiles/rtx-5060-ti-serve.toml"))
    return ReleaseView("old", dict(rendered.units), json.loads(rendered.serving))


def changed(release: ReleaseView, unit: str | None = None, old: str = "", new: str = "", serving=None) -> ReleaseView:
    units = dict(release.units)
    if unit:
        assert old in units[unit], (unit, old)
        units[unit] = units[unit].replace(old, new, 1)
    return ReleaseView("new", units, serving or copy.deepcopy(release.serving))


def test_the_same_render_is_the_same_release_id(release):
    files = {f"units/{k}": v for k, v in release.units.items()}
    assert release_id(files) == release_id(dict(files))
    assert release_id(files) != release_id({**files, "units/flatshare.target": files["units/flatshare.target"] + "#"})


def test_a_description_or_comment_change_restarts_nothing(release):
    new = changed(release, "flatshare-engine.service", "Description=Flatshare vLLM engine", "Description=The engine")
    new.units["flatshare-voice.service"] += "# a comment\n"
    p = plan("cyan", release, new)
    assert not p.drains and "restart-engine" not in p.steps
    assert p.units["flatshare-engine.service"] == "update" and p.units["flatshare-voice.service"] == "update"
    assert p.steps == ["install-units", "apply-units", "switch-current", "serving-check", "record-history"]


def test_an_exec_start_quoted_differently_but_running_the_same_argv_restarts_nothing(release):
    text = release.units["flatshare-gateway.service"]
    line = next(row for row in text.splitlines() if row.startswith("ExecStart="))
    argv = unit_file.exec_commands(line.removeprefix("ExecStart="))[0][1]
    requoted = "ExecStart=" + " ".join(a.replace(" ", "\\x20") if " " in a else a for a in argv)
    new = changed(release, "flatshare-gateway.service", line, requoted)
    assert new.units["flatshare-gateway.service"] != text
    p = plan("cyan", release, new)
    assert not p.drains and p.units["flatshare-gateway.service"] == "update"


def test_a_time_span_spelled_differently_is_the_same(release):
    new = changed(release, "flatshare-voice.service", "TimeoutStopSec=30s", "TimeoutStopSec=0.5min")
    assert plan("cyan", release, new).units["flatshare-voice.service"] == "update"


def test_a_gateway_change_costs_only_the_gateways_own_drain(release):
    new = changed(release, "flatshare-gateway.service", "RestartSec=2s", "RestartSec=3s")
    p = plan("cyan", release, new)
    assert {"stop-gateway", "start-gateway"} <= set(p.steps)
    assert not {"drain-voice", "restart-engine", "restart-voice", "end-voice-drain"} & set(p.steps)
    assert p.units["flatshare-engine.service"] == "unchanged"


def test_a_voice_change_costs_a_voice_drain_and_the_workers_restart_only(release):
    new = changed(release, "flatshare-voice.service", "RestartSec=2s", "RestartSec=3s")
    p = plan("cyan", release, new)
    assert {"drain-voice", "restart-voice", "end-voice-drain"} <= set(p.steps)
    assert not {"stop-gateway", "restart-engine", "start-gateway"} & set(p.steps)


def test_a_timer_change_restarts_the_timer_without_a_drain(release):
    new = changed(release, "serving-check.timer", "AccuracySec=1s", "AccuracySec=2s")
    p = plan("cyan", release, new)
    assert not p.drains and p.units["serving-check.timer"] == "restart"


@pytest.mark.parametrize("path, value", [(("module", "sha256"), "f" * 64), (("vllm_release",), "0.33.0")])
def test_an_engine_change_outside_the_units_is_the_whole_switch(release, path, value):
    serving = copy.deepcopy(release.serving)
    target = serving
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    p = plan("cyan", release, changed(release, serving=serving))
    assert DRAINS <= set(p.steps) and "restart-engine" in p.steps


def test_an_engine_unit_change_is_the_whole_switch(release):
    new = changed(release, "flatshare-engine.service", "RestartSec=5s", "RestartSec=6s")
    p = plan("cyan", release, new)
    assert DRAINS <= set(p.steps) and "restart-engine" in p.steps and "start-gateway" in p.steps


def test_finishing_an_interrupted_switch_restarts_every_managed_service(release):
    p = plan("cyan", release, release, resume=True)
    assert {"drain-voice", "stop-gateway", "restart-engine", "restart-voice", "start-gateway"} <= set(p.steps)


def test_a_change_on_a_node_with_a_service_down_is_the_whole_switch(release):
    # A timer change alone restarts no service; with the voice worker stopped, a plan of changes only would
    # leave it down: the whole switch starts it (and every step that waits for it has it running).
    new = changed(release, "serving-check.timer", "AccuracySec=1s", "AccuracySec=2s")
    p = plan("cyan", release, new, not_running=("flatshare-voice.service is inactive",))
    assert {"drain-voice", "stop-gateway", "restart-engine", "restart-voice", "start-gateway"} <= set(p.steps)
    assert p.units["flatshare-voice.service"] == "restart"
    assert any("flatshare-voice.service is inactive" in r for r in p.reasons), p.reasons


def test_the_policy_is_read_from_the_unit_itself(release):
    text = release.units["flatshare.target"]
    assert unit_file.change_class(text) == "start"
    new = changed(release, "flatshare.target", "X-Flatshare-Change=start", "X-Flatshare-Change=switch")
    new.units["flatshare.target"] = new.units["flatshare.target"].replace("Wants=", "Wants=extra.service ")
    assert "restart-engine" in plan("cyan", release, new).steps


def test_the_why_of_a_text_only_unit_matches_its_action(release):
    """A gateway with a new Description= restarts all the same when the engine switches (the drain stops it);
    the plan's 'why' must not say 'nothing restarts' for it then."""
    new = changed(release, "flatshare-gateway.service", "Description=", "Description=New words for ")
    serving = copy.deepcopy(release.serving)
    serving["engine"]["argv"] = serving["engine"]["argv"] + ["--max-num-seqs", "31"]
    new = ReleaseView("new", new.units, serving)
    p = plan("cyan", release, new)
    assert p.units["flatshare-gateway.service"] == "restart"
    why = [r for r in p.reasons if r.startswith("flatshare-gateway.service:")]
    assert why == ["flatshare-gateway.service: text only (comments or ignored keys); it restarts with the engine's "
                   "switch all the same"], p.reasons
    alone = plan("cyan", release, changed(release, "flatshare-gateway.service", "Description=", "Description=New "))
    assert alone.units["flatshare-gateway.service"] == "update"
    assert [r for r in alone.reasons if "gateway" in r][0].endswith("nothing restarts")


def _hist(*records: dict):
    from flatshare_ops.node.history import History

    return History([{"kind": "release", "node": "cyan", **r} for r in records], [])


def test_a_first_release_whose_rollout_was_killed_before_its_skip_was_recorded_is_never_analysed():
    # A breaker's case: `release --all` killed after the canary's first release, before the skip record; every
    # later rollout analysed that first release (minutes of "baseline not measured", then a pause or a refused
    # rollback to nothing).
    from flatshare_ops.node.switch import unjudged_switch

    first = _hist({"switch": "s1", "result": "released", "before": None, "after": "A"})
    assert unjudged_switch(first, "A") is None
    later = _hist({"switch": "s1", "result": "released", "before": None, "after": "A"},
                  {"switch": "s2", "result": "released", "before": "A", "after": "B"})
    assert unjudged_switch(later, "B") == "s2"


def test_a_failed_analysis_owes_its_rollback_and_a_dry_run_owes_none():
    from flatshare_ops.node.switch import failed_analysis

    released = {"switch": "s2", "result": "released", "before": "A", "after": "B"}
    failed = {"switch": "s2", "kind": "analysis", "result": "analysed", "rollout": "r1",
              "analysis": {"phase": "failed", "dry_run": False}}
    dry = {**failed, "rollout": "r2", "analysis": {"phase": "failed", "dry_run": True}}
    assert failed_analysis(_hist(released, failed), "s2") == "r1"
    assert failed_analysis(_hist(released, dry), "s2") is None
    assert failed_analysis(_hist(released, failed), "s3") is None


def test_only_a_failure_that_is_a_verdict_disqualifies_a_release_that_served():
    # releases/README.md: a rollback never goes to a release whose latest failure since it served is a verdict
    # (its engine did not start, serving-check CRITICAL); a signal, a write or an abandoned switch is none, and a
    # record written before `verdict` existed counts as one.
    from flatshare_ops.node.history import served_releases

    def history(last: dict):
        return _hist({"switch": "s1", "result": "released", "after": "A", "served": True, "target": "A",
                      "started_at": 1.0, "finished_at": 2.0},
                     {"switch": "s2", "result": "released", "after": "B", "served": True, "target": "B",
                      "started_at": 3.0, "finished_at": 4.0},
                     {"switch": "s3", "result": "failed", "target": "A", "started_at": 5.0, "finished_at": 6.0,
                      **last})
    assert served_releases(history({"verdict": True})) == ["B"]
    assert served_releases(history({})) == ["B"]  # an older record: a verdict
    assert served_releases(history({"verdict": False})) == ["B", "A"]
    assert served_releases(history({"verdict": False, "result": "abandoned"})) == ["B", "A"]


def test_a_record_whose_kind_is_no_text_is_skipped_as_the_wrong_types_not_raised(tmp_path):
    # mypy's finding (in the schema-1 reader since removed): a kind that is a list raised TypeError (unhashable)
    # out of the history reader instead of skipping the line. A schema-2 record of that kind is skipped, named.
    from flatshare_ops.node.history import problem, read_history

    good = {"schema": 2, "node": "cyan", "switch": "s1", "kind": "rollback", "result": "rolled back", "before": "B",
            "after": "A", "target": "A", "served": True, "started_at": 1000.0, "finished_at": 1001.0}
    damaged = {**good, "kind": ["rollback"]}
    assert problem(damaged, "cyan") == "a record of the wrong types (kind is list)"
    path = tmp_path / "history.jsonl"
    path.write_text(json.dumps(damaged) + "\n" + json.dumps(good) + "\n")
    history = read_history(path, "cyan")
    assert [r["result"] for r in history.records] == ["rolled back"]
    assert history.skipped == ["history.jsonl:1: a record of the wrong types (kind is list); skipped"]