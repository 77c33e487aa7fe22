"""One serving-check run: gather the node's facts, run every check, return the report, within a deadline.

The local path imports only the standard library and pystemd (for systemd's
view of the units): it runs every minute on every node, so no SSH,
templates, pydantic or CLI framework is loaded here (adr/0006-serving-check-cost.md).

Every part is bounded: systemd answers within 5 s (in a child the run kills),
each HTTP probe within 2 s, and the whole run within its deadline (10 s by
default). When the deadline fires, the findings made so far are kept and an
UNKNOWN finding names the bound and what was being checked, so ``--json``
still prints JSON and ``--textfile`` still writes the file.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

from ..common import serving_shape
from ..common.clock import is_time
from ..common.files import Damaged, parse_json_object, read_json_object
from ..common.release_files import read_release
from ..common.http import http_get
from ..common.locks import LockTableError, release_holder
from ..common.current_link import CurrentLinkError, read_current
from ..common.node_files import CURRENT, JOURNAL, JOURNAL_SCHEMA, RELEASES
from ..common.units import TURN_HINTS_VARIABLE, VOICE_UNIT
from ..common.text import one_line
from ..common.vllm_release import installed_vllm
from ..common.wording import holder_phrase, int_field, not_recorded, text_field, who_phrase
from ..common.proc import read_cmdline, read_environ
from .module_origin import imported_from
from . import checks
from ..common.unit_output import last_lines, last_marked
from .calls import takes_calls
from .facts import (MODULE_LINE_TAG, active_release, lock_holder_record, parse_metrics,
                    switch_started_at, systemd_facts, turns_announced, unit_environment)
from .report import CRITICAL, OK, UNKNOWN, WARNING, Finding, NodeState, Report

#: serving.json schemas this serving-check knows (a newer one is UNKNOWN, not CRITICAL).
SERVING_SCHEMAS = (1,)
#: A release holding the lock longer than this (seconds) no longer explains what it drains.
STALE_LOCK_S = 3600.0
#: serving-check's own deadline (seconds), and the bound of its systemd exchange.
DEADLINE_S = 10.0
SYSTEMD_S = 5.0
#: The stand-in engine's make-room counter in /metrics (vLLM's own has none).
TURNS_METRIC = "flatshare:make_room_turns_announced_total"
#: How many of the engine's last output lines serving-check reads (the turn count, a stopped engine's why).
OUTPUT_LINES = 400


class _Deadline(BaseException):
    """The run's deadline fired."""


def release_state(releases: Path) -> tuple[Finding | None, Finding | None]:
    """(a release in progress, an unfinished switch): each a finding, or None.

    Whether a release holds the node is read from the kernel's lock table
    (common.locks: the state directory's lock, adr/0011), never from the pid in
    ``lock.json``; ``lock.json`` only names who holds it. A lock table that cannot
    be read is an UNKNOWN finding in the first place (nothing is explained by it).
    """
    try:
        pid = release_holder(releases.parent)
    except LockTableError as err:
        return Finding("release", UNKNOWN, f"whether a release holds the node cannot be read: {err}"), None
    in_progress = None
    if pid is not None:
        holder, damage = lock_holder_record(releases)
        started = holder.get("started_at") if not damage else None
        held_for = f" for {max(0.0, time.time() - started):.0f} s" if is_time(started) else ""
        in_progress = Finding("release", WARNING, f"release in progress by {holder_phrase(holder, pid, damage)}"
                              f"{held_for}: the node may be drained until it ends")
    unfinished = None
    journal = releases / JOURNAL
    if pid is None and (journal.exists() or journal.is_symlink()):
        try:
            record = read_json_object(journal) or {}
            if record.get("schema", JOURNAL_SCHEMA) != JOURNAL_SCHEMA:  # as the switch reads it (node/journal.py)
                raise Damaged(journal, f"of schema {one_line(record.get('schema'))}, not the {JOURNAL_SCHEMA} "
                                       "flatshare-ops reads")
            if not isinstance(record.get("to"), str):
                raise Damaged(journal, "no target release: its to is missing or not text")
            what = _journal_words(record)
        except Damaged as err:
            unfinished = Finding("release", WARNING, f"unfinished switch (journal unreadable: {err.form}): check the node "
                                 f"('flatshare status'), then move {journal} aside (releases/README.md)")
            return in_progress, unfinished
        unfinished = Finding("release", WARNING, f"unfinished switch {what}; run 'flatshare release' to finish "
                             "it, or 'flatshare rollback' to abandon it")
    return in_progress, unfinished


def _journal_words(record: dict) -> str:
    """``from A to B, started by root@vm pid 12`` from a raw journal; what it lacks is named."""
    if "from" in record and record["from"] is None:
        start: str | None = "no release"  # a node's first release (releases/README.md)
    else:
        start = text_field(record, "from")
    pid = int_field(record, "pid")
    user, host = text_field(record, "user"), text_field(record, "host")
    who = who_phrase(user, host)
    by = f"{who} pid {pid}" if who and pid is not None else f"pid {pid}" if pid is not None else who
    missing = [k for k, v in (("from", start), ("user", user), ("host", host), ("pid", pid)) if v is None]
    return (f"from {start or 'an unrecorded release'} to {one_line(record['to'])}" + (f", started by {by}" if by else "")
            + not_recorded("switching.json", missing))


def _read_serving(path: Path, node: str) -> tuple[dict | None, Finding | None]:
    """The active release's serving.json, read with the rest of the release and checked against its id
    (common/release_files.py): a serving.json edited since it was stored is named, never checked against.
    Links are followed (``current`` is one; a link to the right bytes makes the same id)."""
    link = path.parent
    if not (link.is_symlink() or link.exists()):
        return None, Finding("release", UNKNOWN, f"{path} not found: no active release on {node}")
    if not link.is_symlink():
        kind = "a directory" if link.is_dir() else "a regular file" if link.is_file() else "not a symlink"
        return None, Finding("release", UNKNOWN, f"{link}: is {kind}, not a link to a release; move it aside "
                             "and run 'flatshare release' to point it at the checkout's release")
    directory = Path(os.path.realpath(link))
    if not directory.exists():
        return None, Finding("release", UNKNOWN, f"{link}: points at release {os.readlink(link)}, which is not "
                             f"stored on {node}; run 'flatshare release' to switch it to a stored release")
    rid = directory.name
    try:
        serving = parse_json_object(path, read_release(directory, rid, follow_links=True)["serving.json"].encode())
    except Damaged as err:
        newer = _newer_schema(path)
        if newer:  # made by a newer flatshare-ops, which may make its releases otherwise: that is what to say
            return None, newer
        inside = _what_is_wrong(path) if err.path == directory else None
        return None, Finding("release", UNKNOWN, f"{err}" + (f" ({inside})" if inside else "") + f": the active "
                             f"release {rid} is damaged on {node}, so serving-check has nothing true to check "
                             "against; release it again (flatshare release)")
    newer = _newer_schema(path, serving)
    if newer:
        return None, newer
    wrong = serving_shape.problem(serving)
    if wrong:
        return None, Finding("release", UNKNOWN, f"{path}: not a release's serving.json ({wrong}); "
                             "reinstall the release (flatshare release)")
    return serving, None


def _what_is_wrong(path: Path) -> str | None:
    """What is wrong with a damaged release's serving.json itself, when something is (said beside the digest)."""
    try:
        serving = read_json_object(path, allow_symlink=True)
    except Damaged as err:
        return str(err)
    wrong = serving_shape.problem(serving) if serving is not None else "missing"
    return f"{path}: not a release's serving.json ({wrong})" if wrong else None


def _newer_schema(path: Path, serving: dict | None = None) -> Finding | None:
    """UNKNOWN when serving.json (read here, bounded, when not given) says a schema newer than this check knows."""
    if serving is None:
        try:
            serving = read_json_object(path, allow_symlink=True) or {}
        except Damaged:
            return None
    schema = serving.get("schema")
    if isinstance(schema, int) and not isinstance(schema, bool) and schema > max(SERVING_SCHEMAS):
        return Finding("release", UNKNOWN, f"{path}: serving.json schema {schema} is newer than this "
                       f"serving-check knows ({max(SERVING_SCHEMAS)}); update flatshare-ops on the node")
    return None


def run_checks(state_dir: Path, node: str, runtime_dir: Path | None = None, inside_release: bool = False,
               deadline_s: float | None = None) -> Report:
    """Check this node's running engine against its active release.

    Args:
        state_dir: the node's state directory (``/var/lib/flatshare``).
        node: the node's name, for messages.
        runtime_dir: a user-scope manager's ``XDG_RUNTIME_DIR`` (default: the environment's).
        inside_release: run by the release holding the lock (its serving-check step).
        deadline_s: the whole run's bound in seconds (only in the main thread; None: no overall bound).

    Returns:
        A :class:`Report`, with the node's state (``NodeState``: takes calls, active release, switch
        start) unless ``inside_release`` (only a timer's or cron's run writes it, to the textfile).
        UNKNOWN findings are the check's own trouble (no serving.json, no answer from systemd, the
        deadline); a drifted engine is CRITICAL; while a release holds the lock, what it explains (a
        drained node) is a WARNING, never OK.
    """
    started = time.monotonic()
    findings: list[Finding] = []
    perf: dict[str, float] = {}
    state = NodeState()
    stage = ["reading the release state"]
    timer = deadline_s is not None and threading.current_thread() is threading.main_thread()
    if timer:
        def fire(_signum, _frame):
            raise _Deadline()

        previous = signal.signal(signal.SIGALRM, fire)
        assert deadline_s is not None  # timer says so
        signal.setitimer(signal.ITIMER_REAL, deadline_s)
    try:
        _run(Path(state_dir), node, runtime_dir, inside_release, findings, perf, stage, state)
    except _Deadline:
        findings.append(Finding("deadline", UNKNOWN, f"serving-check did not finish within its deadline of "
                                f"{deadline_s:g} s (while {stage[0]}); the findings above are what it checked"))
    finally:
        if timer:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    perf["check_seconds"] = round(time.monotonic() - started, 4)
    return Report(node, findings, perf, state)


def _run(state_dir: Path, node: str, runtime_dir, inside_release: bool, findings: list, perf: dict, stage: list,
         state: NodeState) -> None:
    from ..errors import FlatshareError

    releases = state_dir / RELEASES
    in_progress, unfinished = (None, None) if inside_release else release_state(releases)
    for finding in (in_progress, unfinished):
        if finding:
            findings.append(finding)
    if in_progress and in_progress.status == WARNING:
        perf["release_in_progress"] = 1
    if not inside_release:
        state.switch_started_at = switch_started_at(releases)
    stage[0] = "reading serving.json"
    try:
        read_current(releases)
    except CurrentLinkError as err:  # the node refuses to switch from it: the same rule, the same words
        findings.append(Finding("release", UNKNOWN, str(err)))
        return
    serving, trouble = _read_serving(releases / CURRENT / "serving.json", node)
    if trouble:
        findings.append(trouble)
        return
    assert serving is not None  # _read_serving gives a serving.json or the trouble with it
    if not inside_release:
        _note_release(state, releases, serving)
    stage[0] = "asking systemd"
    try:
        facts = systemd_facts(serving, runtime_dir, SYSTEMD_S)
    except FlatshareError as err:
        findings.append(Finding("systemd", UNKNOWN, str(err)))
        return
    first = len(findings)
    engine = serving["engine"]
    unit_finding = checks.check_engine_unit(facts.engine, engine["unit"])
    findings.append(unit_finding)
    health_status = 0  # not asked: the engine is not running
    if unit_finding.status == OK:
        stage[0] = "reading the engine's command line"
        try:
            running_argv = read_cmdline(facts.engine.main_pid)
        except OSError:
            running_argv = []
        flags = checks.check_flags(running_argv, engine["argv"], str(serving["vllm_release"]))
        findings.append(flags)
        perf["flags_differing"] = len(flags.details) if flags.status == CRITICAL else 0
        stage[0] = f"probing {engine['url']}"
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
            running = metrics.get("vllm:num_requests_running", 0.0)
            turns, source = metrics.get(TURNS_METRIC), "the engine's metrics"
            if turns is None:  # vLLM's own /metrics has no make-room counter: the module prints its count
                stage[0] = "reading the engine's output"
                tail = last_marked(serving["layout"], engine["unit"], MODULE_LINE_TAG)
                turns, source = turns_announced(tail.lines, facts.engine.main_pid), tail.source
            findings.append(checks.check_turn_hints(running, turns, source, _turn_hints(releases, facts.voice_pid)))
            perf["requests_running"] = running
            perf["turns_announced"] = turns or 0.0
        else:
            findings.append(Finding("turn_hints", WARNING, f"GET /metrics answered {metrics_status or 'nothing'}"))
    else:
        tail = last_lines(serving["layout"], engine["unit"], OUTPUT_LINES)
        unit_finding.details.append(f"{engine['unit']}: {tail.quote()}")
    stage[0] = "checking the services, the module and the units"
    in_release = inside_release or "release_in_progress" in perf
    findings.append(checks.check_services(facts.states, Path(serving["voice"]["drain_file"]), in_release))
    if not inside_release:
        _note_calls(state, serving, facts.states, health_status, stage)
    module = serving["module"]
    other = imported_from(facts.engine.main_pid, Path(module["path"])) if facts.engine.main_pid else (None, [])
    findings.append(checks.check_module(Path(module["path"]), module["sha256"], facts.engine.started_at, other))
    units = checks.check_units(Path(serving["layout"]["unit_dir"]), serving["units"])
    findings.append(units)
    perf["units_differing"] = len(units.details)
    findings.append(checks.check_drop_ins(facts.drop_ins, facts.need_reload, node))
    if "release_in_progress" in perf:
        _explained_by_release(findings, first, releases)


def _explained_by_release(findings: list[Finding], first: int, releases: Path) -> None:
    """While a release holds the lock, a drained or half-switched node is what it does: CRITICAL findings
    become WARNINGs (never OK) that say so, unless the release has held the lock for over an hour."""
    holder, _damage = lock_holder_record(releases)
    started = holder.get("started_at")
    if is_time(started) and time.time() - started > STALE_LOCK_S:
        return
    for finding in findings[first:]:
        if finding.status == CRITICAL:
            finding.status = WARNING
            finding.summary += " (a release in progress explains this)"


def _turn_hints(releases: Path, voice_pid: int) -> tuple[str | None, str | None] | None:
    """(the active release's voice unit's FLATSHARE_TURN_HINTS, the running voice worker's), or None when
    either cannot be read (no worker running, or no such unit in the release: other findings say so)."""
    if voice_pid <= 0:
        return None
    try:
        running = read_environ(voice_pid).get(TURN_HINTS_VARIABLE)
        text = (releases / CURRENT / "units" / VOICE_UNIT).read_text(errors="replace")
    except OSError:
        return None
    return unit_environment(text, TURN_HINTS_VARIABLE), running


def _note_release(state: NodeState, releases: Path, serving: dict) -> None:
    """The active release's id, profile and vLLM release, from the link and the serving.json just read."""
    state.release = active_release(releases)
    profile = serving.get("profile")
    name = profile.get("name") if isinstance(profile, dict) else None
    state.profile = name if isinstance(name, str) else None
    state.vllm_release = serving["vllm_release"]


def _note_calls(state: NodeState, serving: dict, states: dict, engine_health: int, stage: list) -> None:
    """Whether the node takes calls (check/calls.py): one more bounded probe, the gateway's ``/health`` at
    the release's ``gateway.url``. A release made before ``gateway.url`` leaves it unknown (None)."""
    gateway = serving["gateway"].get("url")
    if not isinstance(gateway, str):
        return
    stage[0] = f"probing {gateway}"
    gateway_health, _ = http_get(gateway + "/health")
    state.takes_calls = takes_calls(states, engine_health, gateway_health, Path(serving["voice"]["drain_file"]).exists())
