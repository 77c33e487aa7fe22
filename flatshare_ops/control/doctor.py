"""``flatshare doctor``: the operator's side and each node's reachability, one line per item.

Checks, in order: the inventory loads; the checkout's rendered files match its
profiles (and no profile pins a placeholder module); then per node: its
profile loads and renders, its identity file exists, known_hosts lists its
host key, it answers over SSH (``flatshare-node probe``: does it take calls,
does a release hold it), and reading its release lock works on its filesystem
(``flatshare-node lock-check``: a child takes a lock, the node reads it, the
child lets go; adr/0011). ``ok`` / ``WARN`` / ``FAIL`` with the way out.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import FlatshareError, TransportError
from ..common.text import clip_tail


def doctor(root: Path, inventory: Path, echo, items: list | None = None) -> int:
    """Run every check; returns 0 when nothing FAILs, 1 otherwise. ``items``, when given, gets each line as
    ``{"state": "ok"|"WARN"|"FAIL", "item", "detail"}`` (``--json``)."""
    from ..render import render_profile
    from ..render.checkout import drift, expected_outputs, misplaced, placeholder_pins
    from . import commands, known_hosts
    from .answers import probe_words
    from .fanout import answer_of, not_an_answer
    from .targets import targets

    failed = 0

    def line(state: str, item: str, detail: str) -> None:
        nonlocal failed
        failed += state == "FAIL"
        echo(f"{state:5} {item}: {detail}")
        if items is not None:
            items.append({"state": state, "item": item, "detail": detail})

    try:
        nodes = targets(inventory, [], True)
        line("ok", "inventory", f"{inventory}: {len(nodes)} node(s), min_serving {nodes[0].settings.min_serving}")
    except FlatshareError as err:
        line("FAIL", "inventory", str(err))
        return 1
    try:
        diffs = drift(root, expected_outputs(root))
        first = "; ".join(misplaced(root, diffs))
        line("FAIL" if diffs else "ok", "checkout", f"rendered files drifted: {', '.join(map(str, diffs))}; "
             + (f"{first}; then " if first else "") + "run 'make profiles UPDATE=1'" if diffs
             else "rendered files match the profiles")
        for warning in placeholder_pins(root):
            line("WARN", "module pin", warning)
    except FlatshareError as err:
        line("FAIL", "checkout", str(err))
    for target in nodes:
        name = target.name
        try:
            render_profile(target.loaded)
            line("ok", f"{name} profile", f"{target.profile_path} loads and renders")
        except FlatshareError as err:
            line("FAIL", f"{name} profile", str(err))
            continue
        try:
            n = target.ssh_target  # the inventory's entry, the operator's SSH config applied
        except FlatshareError as err:
            line("FAIL", f"{name} ssh config", str(err))
            continue
        identity = n.identity
        if identity is not None:
            from .ssh import identity_problem

            what = identity_problem(identity)
            line("FAIL" if what else "ok", f"{name} key",
                 f"{identity} {what}; fix the inventory's identity" if what else f"{identity}")
        path = n.known_hosts or Path.home() / ".ssh/known_hosts"
        label = known_hosts.host_label(n.host, n.port)
        try:
            listed = [e for e in known_hosts.read(path).entries if not e.marker and known_hosts.matches(e.patterns, label)]
            line("ok" if listed else "FAIL", f"{name} known_hosts",
                 f"{path} lists {label} (line {listed[0].line})" if listed else
                 f"{path} does not list {label}: 'flatshare node bootstrap --node {name}' shows its fingerprint")
        except TransportError as err:
            line("FAIL", f"{name} known_hosts", str(err))
        try:
            argv = commands.probe(target.spec)  # the node's profile and the inventory must agree first
            conn = target.connect()
        except FlatshareError as err:
            line("FAIL", f"{name} reach", str(err))
            continue
        result = None
        try:
            result = conn.run(argv, timeout_s=target.settings.transport.command_timeout_s)
            answer = answer_of(result)
            state = "ok" if answer.get("takes_calls") else "WARN"
            line(state, f"{name} reach", f"answers over SSH; {probe_words(answer)}")
        except TransportError as err:
            line("FAIL", f"{name} reach", f"{err}")
            conn.close()
            continue
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            if result is None:
                said = "no output"
            elif isinstance(err, ValueError):  # no JSON answer, or the node's own reason (exit N: ...)
                said = not_an_answer(result.status, result.output + result.errors, err)
            else:
                said = clip_tail(result.output.strip(), 200)
            line("FAIL", f"{name} reach", f"answers over SSH, but its flatshare-node does not ({said}): "
                 f"'flatshare node bootstrap --node {name}'")
            conn.close()
            continue
        line(*check_runs_line(name, answer.get("check_runs")))
        try:
            line(*_lock_reading(conn, target))
        finally:
            conn.close()
    return 1 if failed else 0


#: serving-check's timer runs it every minute (render/templates/serving-check.timer.j2); a last run older than
#: this many seconds means the timer no longer runs it.
CHECK_RUNS_STALE_S = 300.0
#: serving-check's exit statuses (the monitoring-plugins' guidelines): 3 is the check's own trouble.
VERDICTS = {0: "OK", 1: "WARNING", 2: "CRITICAL", 3: "UNKNOWN"}


def check_runs_line(name: str, runs: object) -> tuple[str, str, str]:
    """doctor's line on serving-check's runs from its timer, from a probe answer's ``check_runs``
    (node/probe.py :func:`check_runs`): WARN where the timer does not run it, its last run ended UNKNOWN (its
    own trouble: a textfile it may not write, a journal it may not read), outside serving-check's statuses (a
    signal, a crash, its time limit), or too long ago; a verdict on the engine (WARNING, CRITICAL) is the
    check's, said as such."""
    item = f"{name} serving-check"
    how = f"'journalctl -u serving-check.service' on {name} says why"
    if not isinstance(runs, dict):
        return "WARN", item, "the node did not say how serving-check's timer runs (systemd did not answer, or an older flatshare-node)"
    timer = runs.get("timer")
    if timer == "not-found":
        return "ok", item, "serving-check.timer is not installed here (cron may run serving-check)"
    if timer != "active":
        return "WARN", item, f"serving-check.timer is {timer}: nothing runs serving-check; 'systemctl enable --now serving-check.timer' on {name}"
    age = runs.get("age_s")
    if not isinstance(age, (int, float)) and runs.get("running") is True:
        return "ok", item, "serving-check.timer active; serving-check is running now (its last run is not known)"
    if not isinstance(age, (int, float)):
        return "ok", item, "serving-check.timer active; serving-check has not run from it yet"
    status, code = runs.get("status"), runs.get("code")
    when = f"{age:.0f} s ago"
    if code in ("killed", "dumped"):
        return "WARN", item, f"serving-check's last run ({when}) was ended by signal {status} ({runs.get('result')}); {how}"
    if runs.get("result") == "timeout":
        return "WARN", item, f"serving-check's last run ({when}) passed its unit's time limit; {how}"
    if status == 3:
        return "WARN", item, (f"serving-check's last run ({when}) ended UNKNOWN: its own trouble (a textfile it may not "
                              f"write, a journal it may not read); {how}")
    if status not in VERDICTS:
        return "WARN", item, f"serving-check's last run ({when}) exited {status}, not one of its statuses; {how}"
    if age > CHECK_RUNS_STALE_S:
        return "WARN", item, f"serving-check last ran {when}, though its timer runs it every minute; {how}"
    return "ok", item, f"serving-check.timer active; last run {when}: {VERDICTS[status]}"


def _lock_reading(conn, target) -> tuple[str, str, str]:
    """(state, item, detail) of the node's lock check (``flatshare-node lock-check``)."""
    from . import commands
    from .fanout import answer_of, not_an_answer

    item = f"{target.name} lock reading"
    try:
        result = conn.run(commands.lock_check(target.spec), timeout_s=target.settings.transport.command_timeout_s)
    except TransportError as err:
        return "FAIL", item, str(err)
    try:
        answer = answer_of(result)
        ok, detail = answer["ok"], answer["detail"]
    except ValueError as err:
        return "FAIL", item, f"no answer ({not_an_answer(result.status, result.output + result.errors, err)})"
    except (KeyError, TypeError):
        return "FAIL", item, f"no answer ({clip_tail(result.output.strip(), 200) or 'no output'})"
    if ok is True:
        return "ok", item, str(detail)
    return "FAIL", item, f"{detail}; releases there cannot be seen by the other nodes' admission (adr/0011)"
