"""What the nodes' answers say, in words: ``status``, ``releases``, ``lock``, a probe, a follow-up's report.

Pure functions of the JSON documents nodes answer with (``flatshare-node
status``, ``history``, ``hold``, ``probe``). A node may be older or newer than
this checkout, and its files may lack fields, so every field may be missing:
each line says what the answer does say, and names what it does not
(common/wording.py); never ``None``, ``null`` or ``?``.
"""

from __future__ import annotations

from ..common.clock import is_duration

from ..common.protocol import SUCCESS, JournalState, OutcomeResult, RecordResult, SwitchKind, SwitchState
from ..common.text import one_line
from ..common.wording import hold_phrase, int_field, not_recorded, text_field, time_field, who_phrase
from ..errors import Exit


def owed_rollback_words(name: str) -> str:
    """What to do about a canary that still runs the release its failed analysis decided to roll back."""
    return (f"its rollback is owed ('flatshare rollback --node {name}', or the next 'flatshare release --all' with "
            "canaries, which carries it out first)")


def journal_state(report: dict) -> JournalState:
    """Whether a node's ``status`` answer says a switch is in its journal (its ``journal_state``). An answer
    without that field (a node older than it) is read by its ``switching`` summary: present when there is one."""
    said = report.get("journal_state")
    if isinstance(said, str) and said in set(JournalState):
        return JournalState(said)
    return JournalState.PRESENT if text_field(report, "switching") else JournalState.NONE


def status_lines(name: str, report: dict) -> list[str]:
    """``flatshare status``'s lines for one node's answer (``flatshare-node status``, or ``{"error"}``).

    One sentence for the node's release, a switch in progress or unfinished, and its units; the lock's
    holder is said once (by the journal when it names the same pid as the kernel).
    """
    if "error" in report:
        return [f"{name}: UNKNOWN: {one_line(report['error'])}"]
    if "release" in report and report["release"] is None:
        release = "no active release"
    else:
        release = f"release {text_field(report, 'release') or 'unknown (the answer does not name it)'}"
    parts = [f"{name}: {release}"]
    switch = _switch_words(report)
    if switch:
        parts.append(switch)
    units = report.get("units")
    if isinstance(units, dict) and units:
        parts.append(", ".join(f"{one_line(u)} {one_line(s)}" for u, s in units.items()))
    else:
        why = text_field(report, "systemd") or "the answer does not say why"
        parts.append(f"units unknown ({why})")
    lines = ["; ".join(parts)]
    last = report.get("last")
    if isinstance(last, dict) and (last.get("result") == RecordResult.FAILED or last.get("auto")):
        # What became of the node's last switch, when it did not simply end well: how it failed and
        # whether calls were given back (the early end), or that the node rolled itself back, and why.
        lines.append(f"  last switch: {history_line(last)}")
    if report.get("drain_left"):
        lines.append(f"  not taking calls: {one_line(report['drain_left'])}")
    hold = text_field(report, "hold")
    if hold:
        lines.append(f"  held by {hold}: releases and rollbacks to it are refused until 'flatshare hold lift --node "
                     f"{one_line(name)}'")
    for damage in report.get("damaged") or []:
        lines.append(f"  damaged: {one_line(damage)}")
    return lines


def _switch_words(report: dict) -> str | None:
    holder = text_field(report, "in_progress")
    state = journal_state(report)
    switching = None if state is JournalState.NONE else text_field(report, "switching") or (
        "switch of unknown releases (its journal cannot be read: see 'damaged')" if state is JournalState.UNREADABLE
        else "switch (the answer does not summarise its journal)")
    if switching and holder:
        same = int_field(report, "in_progress_pid") is not None and \
            int_field(report, "in_progress_pid") == int_field(report, "switching_pid")
        if same:
            return f"IN PROGRESS: {switching}"
        return f"IN PROGRESS: the release lock is held by {holder}; the journal says {switching}"
    if switching:
        return f"UNFINISHED {switching}"
    if holder:
        return f"IN PROGRESS: the release lock is held by {holder}"
    return None


def history_line(record: dict) -> str:
    """One ``flatshare releases`` line for a history record (releases/README.md, history.jsonl)."""
    when = time_field(record, "started_at")
    before = "(none)" if "before" in record and record["before"] is None else text_field(record, "before")
    target = text_field(record, "target")
    result = text_field(record, "result")
    if result == RecordResult.ANALYSED:  # a canary analysis of the node's release, not a switch (releases/README.md)
        summary = text_field(record, "reason") or "a canary analysis, its summary not recorded"
        rollout = text_field(record, "rollout")
        return (f"{when or 'at an unrecorded time'} {target or 'an unrecorded release'}: {summary}"
                + (f" (rollout {rollout})" if rollout else ""))
    if result == RecordResult.FAILED:
        step, reason = text_field(record, "step"), text_field(record, "reason")
        what = f"failed at {step or 'a step it does not name'}: {reason or 'no reason recorded'}"
        calls = text_field(record, "calls")
        if calls:
            what += f"; calls: {calls}"
    elif text_field(record, "auto"):
        what = f"{result} automatically: {text_field(record, 'auto')}"
    else:
        what = result or "its result not recorded"
    duration = record.get("duration_s")
    duration = f"{duration:g} s" if is_duration(duration) else None  # never "inf s" or "-3 s"
    who = who_phrase(text_field(record, "user"), text_field(record, "host"))
    details = [d for d in (duration, f"by {who}" if who else None) if d]
    if text_field(record, "rollout"):
        details.append(f"rollout {text_field(record, 'rollout')}")
    if record.get("forced") is True:
        details.append("forced")
    missing = [k for k, v in (("started_at", when), ("before", before), ("target", target), ("result", result),
                              ("duration_s", duration), ("user", text_field(record, "user")),
                              ("host", text_field(record, "host"))) if v is None]
    return (f"{when or 'at an unrecorded time'} {before or 'an unrecorded release'} -> "
            f"{target or 'an unrecorded release'}: {what}" + (f" ({', '.join(details)})" if details else "")
            + not_recorded("the history record", missing))


def hold_line(name: str, answer: dict) -> str:
    """``flatshare hold status``'s line for one node's hold answer (``flatshare-node hold``)."""
    if "error" in answer:
        return f"{name}: UNKNOWN: {one_line(answer['error'])}"
    if answer.get("held") is True:
        hold = answer.get("hold")
        return f"{name}: held by {hold_phrase(hold if isinstance(hold, dict) else {})}"
    if answer.get("held") is False:
        return f"{name}: not held"
    return f"{name}: UNKNOWN: its answer does not say whether it is held"


def probe_words(answer: dict) -> str:
    """What a node's probe answer (``flatshare-node probe``) says: takes calls or not and why, and whether a
    release holds it."""
    takes = answer.get("takes_calls")
    problems = [one_line(p) for p in answer.get("problems") or [] if isinstance(p, str)]
    if takes is True:
        words = "takes calls"
    elif takes is False:
        words = f"does not take calls ({'; '.join(problems) or 'the probe gives no reason'})"
    else:
        words = "does not say whether it takes calls (takes_calls missing): counted as not taking calls"
    locked = answer.get("locked")
    if locked is True:
        words += f"; being released by {text_field(answer, 'holder') or 'a release the probe does not name'}"
    elif locked is not False:
        words += "; does not say whether a release holds it (locked missing): counted as being released"
    return words


def admission_line(other: str, target: str, answer: dict) -> tuple[bool, str]:
    """(whether ``other`` counts as serving while ``target`` drains, the line saying why) from ``other``'s
    probe answer; what the answer does not establish counts against ``other`` (adr/0007)."""
    if answer.get("locked") is not False:
        if answer.get("locked") is True:
            holder = text_field(answer, "holder") or "a release the probe does not name"
            return False, f"{other}: being released by {holder}; it may be drained"
        return False, f"{other}: its probe does not say whether a release holds it (locked missing): not counted"
    if answer.get("takes_calls") is not True:
        return False, f"{other}: {probe_words({**answer, 'locked': False})}"
    return True, f"{other}: takes calls, no release holds it (must stay so while {target} drains)"


def operator_code(code: int, result: str | None) -> int:
    """The exit code this side gives for a node command that ended with ``code`` and outcome ``result``: the
    node's own, except for a node's side interrupted before its switch began (130 or 143, ``interrupted``:
    nothing changed there), which is a refusal here: 130 and 143 are this side's own Ctrl-C and SIGTERM."""
    if result == OutcomeResult.INTERRUPTED and code in (Exit.INTERRUPTED, Exit.TERMINATED):
        return Exit.REFUSED
    return code


def followed_releases(answer: dict) -> tuple[str | None, str | None, str | None]:
    """(from, to, tried) of a switch as a follow-up's answer records it (``status --switch``: node/status.py
    ``switch_state``), as a node's outcome would give them to the summary: ``from`` the release before the switch,
    ``to`` the release the node is on after it, ``tried`` the release an automatic rollback came back from; None
    where the answer does not say (no record, a failed switch's release after it, a field missing)."""
    record = found if answer.get("state") == SwitchState.RECORDED and isinstance(found := answer.get("record"), dict) \
        else {}
    before, after, result = text_field(record, "before"), text_field(record, "after"), text_field(record, "result")
    if result in SUCCESS and text_field(record, "auto") and text_field(record, "kind") == SwitchKind.ROLLBACK:
        return after, after, before  # the rollback's "before" is the release that did not serve
    if result in SUCCESS:
        return before, after, None
    return before, None, None


def follow_up_report(name: str, switch_id: str, answer: dict, bound: float) -> tuple[int, str]:
    """(exit code, the line to print) from what a node says of one switch after a lost connection
    (``flatshare-node status --switch ID``: node/status.py ``switch_state``)."""
    state = answer.get("state")
    if state == SwitchState.RECORDED:
        record = found if isinstance(found := answer.get("record"), dict) else {}
        result, target = text_field(record, "result"), text_field(record, "target")
        to = target or "a release the record does not name"
        if result in SUCCESS and text_field(record, "auto"):
            return Exit.ROLLED_BACK, (f"{name}: the node says: {OutcomeResult.AUTO_ROLLED_BACK} to {to}: "
                                      f"{text_field(record, 'auto')} (switch {switch_id})")
        if result in SUCCESS:
            return Exit.OK, f"{name}: the node says: {result} {to} (switch {switch_id})"
        what = f"{result} at" if result else "a switch whose result is not recorded, at"
        if text_field(record, "auto") and text_field(record, "kind") == SwitchKind.ROLLBACK:
            what = f"the automatic rollback ({text_field(record, 'auto')}) {what}"
        return Exit.FAILED, (f"{name}: the node says: {what} {text_field(record, 'step') or 'a step it does not name'}"
                             f": {text_field(record, 'reason') or 'no reason recorded'} (switch {switch_id}); the "
                             "next 'flatshare release' finishes it")
    if state == SwitchState.ENDED:  # no switch ran: the node kept what its command ended with (node/outcomes.py)
        kept = found if isinstance(found := answer.get("outcome"), dict) else {}
        code = int_field(kept, "code")
        result, message = text_field(kept, "result"), text_field(kept, "message")
        missing = [k for k, v in (("code", code), ("result", result), ("message", message)) if v is None]
        return (operator_code(code, result) if code is not None else Exit.UNREACHABLE,
                f"{name}: the node says: {result or 'ended'}: {message or 'no message kept'} (switch {switch_id})"
                + not_recorded("its kept outcome", missing))
    journal = text_field(answer, "journal")
    if state == SwitchState.SWITCHING:
        return Exit.STILL_SWITCHING, (
            f"{name}: the node is still switching after {bound:g} s (the reconnect bound)"
            + (f": {journal}" if journal else " (it holds its release lock)")
            + f"; follow it with 'flatshare status --node {name}' (or the node's releases/release.log)")
    if state == SwitchState.INTERRUPTED:
        return Exit.FAILED, (f"{name}: the node says the switch was interrupted: "
                             f"{journal or 'its journal is there, though the answer does not summarise it'}; "
                             "the next 'flatshare release' finishes it")
    # The node answered: it is reachable. No journal, record or kept outcome of the switch: nothing was changed.
    return Exit.REFUSED, (f"{name}: the node has no record of switch {switch_id}: it was refused or never began, "
                          "and changed nothing (its releases/release.log says which)")
