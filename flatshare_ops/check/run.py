"""One serving-check run: gather the node's facts, run every check, return the report.

The local path imports only the standard library and pystemd (for systemd's
view of the units): it runs every minute on every node, so no SSH,
templates, pydantic or CLI framework is loaded here (adr/0006-serving-check-cost.md).
"""

from __future__ import annotations

import time
from pathlib import Path

from ..common.files import Damaged, read_json_object
from ..common.http import http_get
from ..common.node_files import CURRENT, JOURNAL, RELEASES
from ..common.proc import read_cmdline
from . import checks
from .facts import installed_vllm, parse_metrics, release_holder, systemd_facts
from .report import CRITICAL, OK, UNKNOWN, WARNING, Finding, Report

#: The serving.json keys a check reads (releases/README.md).
SERVING_KEYS = ("engine", "vllm_release", "module", "units", "services", "layout", "voice")
#: A release lock older than this (seconds) is no longer "a release in progress" but a warning.
STALE_LOCK_S = 3600.0


def release_state(releases: Path) -> tuple[Finding | None, Finding | None]:
    """(a finding that ends the run because a release holds the lock, a finding about an unfinished switch)."""
    in_progress = None
    holder = release_holder(releases)
    if holder:
        age = time.time() - float(holder.get("started_at", time.time()))
        who = f"{holder.get('user')}@{holder.get('host')} pid {holder.get('pid')}, release {holder.get('release')}"
        if age > STALE_LOCK_S:
            in_progress = Finding("release", WARNING, f"a release has held the lock for {age:.0f} s ({who})")
        else:
            in_progress = Finding("release", OK, f"release in progress ({who}, {age:.0f} s); checks skipped")
    unfinished = None
    journal = releases / JOURNAL
    if in_progress is None and (journal.exists() or journal.is_symlink()):
        try:
            record = read_json_object(journal) or {}
            if not isinstance(record.get("to"), str):
                raise Damaged(journal, "no target release")
            what = f"from {record.get('from')} to {record.get('to')}, started by pid {record.get('pid')}"
        except Damaged:
            unfinished = Finding("release", WARNING, f"unfinished switch (journal unreadable): check the node "
                                 f"('flatshare status'), then move {journal} aside (releases/README.md)")
            return in_progress, unfinished
        unfinished = Finding("release", WARNING, f"unfinished switch ({what}); run 'flatshare release' to finish "
                             "it, or 'flatshare rollback' to abandon it")
    return in_progress, unfinished


def run_checks(state_dir: Path, node: str, runtime_dir: Path | None = None, inside_release: bool = False) -> Report:
    """Check this node's running engine against its active release.

    Args:
        state_dir: the node's state directory (``/var/lib/flatshare``).
        node: the node's name, for messages.
        runtime_dir: a user-scope manager's ``XDG_RUNTIME_DIR`` (default: the environment's).
        inside_release: run by the release holding the lock (its last step): skip the release-state check.

    Returns:
        A :class:`Report`. UNKNOWN findings are the check's own trouble (no
        serving.json, no D-Bus); a drifted engine is WARNING or CRITICAL.
    """
    from ..errors import FlatshareError

    started = time.monotonic()
    releases = Path(state_dir) / RELEASES
    in_progress, unfinished = (None, None) if inside_release else release_state(releases)
    if in_progress:
        # release_in_progress lets a rolling release's gate tell "checks skipped" from "serving".
        return Report(node, [in_progress], {"release_in_progress": 1,
                                            "check_seconds": round(time.monotonic() - started, 4)})
    findings = [unfinished] if unfinished else []
    serving_path = releases / CURRENT / "serving.json"
    try:
        serving = read_json_object(serving_path, allow_symlink=True)
        if serving is None:
            return Report(node, [*findings, Finding("release", UNKNOWN, f"{serving_path} not found: no active release on {node}")])
        missing = [k for k in SERVING_KEYS if k not in serving]
        if missing:
            raise Damaged(serving_path, f"not a release's serving.json (no {', '.join(missing)})")
    except Damaged as err:
        return Report(node, [*findings, Finding("release", UNKNOWN, f"{err}; reinstall the release (flatshare release)")])

    try:
        facts, drop_ins, need_reload, service_states = systemd_facts(serving, runtime_dir)
    except FlatshareError as err:
        return Report(node, [*findings, Finding("systemd", UNKNOWN, str(err))])

    engine = serving["engine"]
    unit_finding = checks.check_engine_unit(facts, engine["unit"])
    findings.append(unit_finding)
    perf: dict[str, float] = {}
    if unit_finding.status == OK:
        try:
            running_argv = read_cmdline(facts.main_pid)
        except OSError:
            running_argv = []
        flags = checks.check_flags(running_argv, engine["argv"], str(serving["vllm_release"]))
        findings.append(flags)
        perf["flags_differing"] = len(flags.details) if flags.status == CRITICAL else 0
        health_status, _ = http_get(engine["url"] + "/health")
        if health_status != 200:
            findings.append(Finding("health", CRITICAL, f"GET {engine['url']}/health answered {health_status or 'nothing'}"))
        else:
            findings.append(Finding("health", OK, "engine /health 200"))
        version = http_get(engine["url"] + "/version")
        findings.append(checks.check_vllm_release(*version, installed_vllm(Path(engine["venv"])), serving["vllm_release"]))
        metrics_status, metrics_body = http_get(engine["url"] + "/metrics")
        if metrics_status == 200:
            metrics = parse_metrics(metrics_body.decode(errors="replace"))
            findings.append(checks.check_turn_hints(metrics))
            perf["requests_running"] = metrics.get("vllm:num_requests_running", 0.0)
            perf["turns_announced"] = metrics.get("flatshare:make_room_turns_announced_total", 0.0)
        else:
            findings.append(Finding("turn_hints", WARNING, f"GET /metrics answered {metrics_status or 'nothing'}"))
    findings.append(checks.check_services(service_states, Path(serving["voice"]["drain_file"]), inside_release))
    module = serving["module"]
    findings.append(checks.check_module(Path(module["path"]), module["sha256"], facts.started_at))
    units = checks.check_units(Path(serving["layout"]["unit_dir"]), serving["units"])
    findings.append(units)
    perf["units_differing"] = len(units.details)
    findings.append(checks.check_drop_ins(checks._with_unloaded_links(drop_ins, Path(serving["layout"]["unit_dir"])),
                                          need_reload, node))
    perf["check_seconds"] = round(time.monotonic() - started, 4)
    return Report(node, findings, perf)
