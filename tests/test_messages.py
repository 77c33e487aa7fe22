"""Every message built from a record says what is known, in words, and names what is missing.

Each record a message is built from (``lock.json``, ``hold.json``, ``switching.json``, a history record, an
``outcomes.jsonl`` record, a probe's answer) is written whole, then once with each of its fields removed,
and each message built from it is produced by the real code: the refusals (node/lock.py, node/hold.py),
the node's status and the operator's ``status``, ``releases`` and ``lock status`` lines
(control/answers.py), serving-check's release state, the rollout's follow-up and admission lines.

The rule: no message ever holds Python's ``None``, JSON's ``null`` or a lone ``?``; and when a field's value
showed in the whole record's message and is gone from the message without it, that message names the field
or says that it is unknown, not recorded or missing.

The lock's holder is a real child process holding the node's lock (the kernel's lock table says so).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from conftest import REPO

from flatshare_ops.check.run import release_state
from flatshare_ops.common.clock import utc_stamp
from flatshare_ops.control.answers import (admission_line, follow_up_report, history_line, hold_line, probe_words,
                                           status_lines)
from flatshare_ops.errors import Refused
from flatshare_ops.node import hold as holds
from flatshare_ops.node.context import NodeContext
from flatshare_ops.node.journal import JournalError, journal_summary, read_journal
from flatshare_ops.node.lock import node_lock
from flatshare_ops.node.probe import probe
from flatshare_ops.node.status import node_status, switch_state
from flatshare_ops.common.systemd import ManagerAddress

STARTED = 1_795_000_000.5  # a time whose stamp is distinctive: 2026-11-17T...
PLACEHOLDERS = re.compile(r"\bNone\b|\bnull\b|(?:^|[^\w])\?(?:[^\w]|$)")
SAYS_MISSING = re.compile(r"unknown|not record|has no |no record|missing|does not (say|name|summarise)|unrecorded|"
                          r"no reason|no message|not kept|someone|gives no reason")

HOLDER = r"""
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from flatshare_ops.node.context import NodeContext
from flatshare_ops.node.lock import node_lock
from flatshare_ops.common.systemd import ManagerAddress
with node_lock(NodeContext("cyan", Path(sys.argv[2]), ManagerAddress("user", Path(sys.argv[3]))), "feedfacecafe0001"):
    print("locked", flush=True)
    sys.stdin.read()
"""


def trace(key: str, value) -> str:
    """How a field's value shows in a message when it is there."""
    if key in ("started_at", "since"):
        return utc_stamp(value)
    return str(value)


def check_rule(name: str, full: list[str], produce, record: dict, failures: list[str],
               optional: tuple[str, ...] = ()) -> None:
    """Produce the messages of ``record`` without each field in turn and apply the module's rule.

    ``optional``: fields whose absence is itself a value the record may hold (releases/README.md: a history
    record's ``rollout`` is null when the switch belongs to none), which a message then leaves out.
    """
    for message in full:
        if PLACEHOLDERS.search(message):
            failures.append(f"{name}, whole record: a placeholder in: {message}")
    for key, value in record.items():
        lacking = {k: v for k, v in record.items() if k != key}
        for whole, message in zip(full, produce(lacking)):
            if PLACEHOLDERS.search(message):
                failures.append(f"{name} without {key}: a placeholder in: {message}")
            shown = trace(key, value)
            if key in optional:
                continue
            if shown in whole and shown not in message and key not in message and not SAYS_MISSING.search(message):
                failures.append(f"{name} without {key}: says neither what is missing nor that it is unknown: "
                                f"{message}")


def no_nested_parentheses(text: str) -> bool:
    depth = 0
    for c in text:
        depth += c == "("
        if depth > 1:
            return False
        depth -= c == ")"
    return True


@pytest.fixture
def node(tmp_path):
    state = tmp_path / "state"
    (state / "releases").mkdir(parents=True)
    return NodeContext("cyan", state, ManagerAddress("user", tmp_path / "run"))  # no manager listens there


@pytest.fixture
def holder(node):
    """A child holding the node's lock (the real node_lock); yields its pid."""
    child = subprocess.Popen([sys.executable, "-c", HOLDER, str(REPO), str(node.state_dir),
                              str(node.address.runtime_dir)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "locked"
        yield child.pid
    finally:
        child.stdin.close()
        child.wait(10)


def lock_messages(node: NodeContext) -> list[str]:
    """Every message built from lock.json while a release holds the node."""
    with pytest.raises(Refused) as refused:
        with node_lock(node, "second"):
            pass
    answer = probe(node)
    status = node_status(node)
    hold = holds.acquire(node, "E2 benchmark", who="operator7@laptop")
    holds.release(node)
    in_progress, _ = release_state(node.releases)
    assert in_progress is not None  # a release holds the node
    return [str(refused.value), answer["holder"], status["in_progress"], " / ".join(status_lines("cyan", status)),
            hold["during_release"], in_progress.summary]


def test_messages_built_from_lock_json_name_what_it_lacks(node, holder):
    record = {"host": "hostvm7", "pid": holder, "user": "operator7", "release": "feedfacecafe0001",
              "started_at": STARTED}

    def produce(fields: dict) -> list[str]:
        node.holder_path.write_text(json.dumps(fields))
        return lock_messages(node)

    failures: list[str] = []
    full = produce(record)
    assert all(f"pid {holder}" in m for m in full), full  # the kernel's pid, in every message
    check_rule("lock.json", full, produce, record, failures)
    node.holder_path.unlink()  # no record at all: a release whose lock.json is gone
    for message in lock_messages(node):
        if PLACEHOLDERS.search(message) or f"pid {holder}" not in message or "lock.json is missing" not in message:
            failures.append(f"lock.json missing: {message}")
    node.holder_path.write_text("{torn")
    for message in lock_messages(node):
        if PLACEHOLDERS.search(message) or "damaged" not in message or "lock.json" not in message:
            failures.append(f"lock.json damaged: {message}")
    node.holder_path.write_text(json.dumps({**record, "pid": 1}))  # another process's record (restored from a backup)
    for message in lock_messages(node):
        if "another process's" not in message or "operator7" in message:
            failures.append(f"lock.json of another process: {message}")
    assert not failures, "\n".join(failures)


UNDOING_HOLDER = r"""
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from flatshare_ops.node.context import NodeContext
from flatshare_ops.node.lock import node_lock
from flatshare_ops.common.systemd import ManagerAddress
ctx = NodeContext("cyan", Path(sys.argv[2]), ManagerAddress("user", Path(sys.argv[3])))
with node_lock(ctx, None, action="rollback", mode=sys.argv[4]) as decided:
    print("locked", flush=True)
    sys.stdin.readline()
    decided("feedfacecafe0002")
    print("decided", flush=True)
    sys.stdin.read()
"""


@pytest.mark.parametrize("mode, words", [("rollback", "a rollback"), ("undo-rollout", "a rollout's undo")])
def test_messages_about_a_rollback_holding_the_lock_name_it_and_its_target_once_decided(node, mode, words):
    # A breaker's case: "cyan is being released by root@vm pid 22485, release rollback, since ...": a rollback's
    # target is decided under the lock, and lock.json held the word "rollback" where a release id belongs.
    child = subprocess.Popen([sys.executable, "-c", UNDOING_HOLDER, str(REPO), str(node.state_dir),
                              str(node.address.runtime_dir), mode], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout.readline().strip() == "locked"
        before = lock_messages(node)
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "decided"
        after = lock_messages(node)
    finally:
        child.stdin.close()
        child.wait(10)
    failures = [m for m in before if f"pid {child.pid}" not in m or f"{words}, its target not yet decided" not in m]
    failures += [m for m in after if f"pid {child.pid}" not in m or f"{words} to release feedfacecafe0002" not in m]
    failures += [m for m in before + after if re.search(r"release (rollback|undo-rollout)\b", m) or
                 PLACEHOLDERS.search(m) or "lock.json has no" in m]
    assert not failures, "\n".join(failures)


def test_the_status_of_a_switch_in_progress_says_its_holder_once_in_one_plain_sentence(node, holder):
    """Issue 21: ``IN PROGRESS (root@vm pid 32766 (release effc0f..., since ...)): switch ... by root@vm pid 32766``."""
    journal = {"schema": 2, "switch": "s1", "from": "a" * 16, "to": "b" * 16, "node": "cyan", "host": "hostvm7",
               "pid": holder, "user": "operator7", "started_at": STARTED, "kind": "release",
               "steps": [{"name": "drain-voice", "state": "done", "at": STARTED}, {"name": "stop-gateway"}]}
    (node.releases / "switching.json").write_text(json.dumps(journal))
    line = status_lines("cyan", node_status(node))[0]
    assert line.count(f"pid {holder}") == 1 and no_nested_parentheses(line), line
    assert f"IN PROGRESS: switch {'a' * 16} -> {'b' * 16} by operator7@hostvm7 pid {holder}" in line


def test_messages_built_from_hold_json_name_what_it_lacks(node):
    record = {"schema": 1, "who": "operator7@laptop", "since": STARTED, "message": "E2 benchmark"}

    def produce(fields: dict) -> list[str]:
        (node.releases / "hold.json").write_text(json.dumps(fields))
        with pytest.raises(Refused) as refused:
            holds.refuse_if_held(node, "release")
        with pytest.raises(Refused) as again:
            holds.acquire(node, "another reason")
        return [str(refused.value), str(again.value), hold_line("cyan", {"held": True, "hold": fields})]

    failures: list[str] = []
    check_rule("hold.json", produce(record), produce, record, failures)
    assert not failures, "\n".join(failures)


def _journal() -> dict:
    return {"schema": 2, "switch": "s1", "rollout": "r1", "commit": "c1", "from": "a" * 16, "to": "b" * 16,
            "node": "cyan", "host": "hostvm7", "pid": 424242, "user": "operator7", "started_at": STARTED,
            "forced": False, "resumed": 0, "auto": None, "kind": "release",
            "steps": [{"name": "drain-voice", "state": "done", "at": STARTED, "error": None}]}


def test_messages_built_from_switching_json_name_what_it_lacks(node):
    """An unfinished switch (nobody holds the lock): the node's own reading, its status and serving-check."""

    def produce(fields: dict) -> list[str]:
        (node.releases / "switching.json").write_text(json.dumps(fields))
        try:
            journal = read_journal(node.state_dir, "cyan")
            assert journal is not None  # switching.json was just written
            summary = journal_summary(journal)
        except JournalError as err:
            summary = str(err)
        _, unfinished = release_state(node.releases)
        assert unfinished is not None  # switching.json is there, and nobody holds the lock
        return [summary, " / ".join(status_lines("cyan", node_status(node))), unfinished.summary]

    failures: list[str] = []
    record = _journal()
    check_rule("switching.json", produce(record), produce, record, failures)
    first = {**record, "from": None}  # a node's first release: no release before it, which is known
    for message in produce(first):
        if PLACEHOLDERS.search(message) or "no release" not in message:
            failures.append(f"switching.json of a first release: {message}")
    assert not failures, "\n".join(failures)


def _history_record(result: str = "released") -> dict:
    return {"schema": 2, "switch": "s1", "rollout": "r1", "node": "cyan", "kind": "release", "result": result,
            "step": "restart-engine" if result == "failed" else None,
            "reason": "engine did not answer" if result == "failed" else None, "before": "a" * 16,
            "after": "b" * 16, "target": "b" * 16, "served": result == "released", "commit": "c1",
            "user": "operator7", "host": "hostvm7", "started_at": STARTED, "finished_at": STARTED + 12,
            "duration_s": 12.3, "forced": False, "resumed": 0, "auto": None}


@pytest.mark.parametrize("result", ["released", "failed"])
def test_messages_built_from_history_records_name_what_they_lack(result):
    def produce(fields: dict) -> list[str]:
        return [history_line(fields), follow_up_report("cyan", "s1", {"state": "recorded", "record": fields}, 30)[1]]

    failures: list[str] = []
    record = {k: v for k, v in _history_record(result).items() if v is not None}
    check_rule(f"a {result} history record", produce(record), produce, record, failures, optional=("rollout",))
    first = {**record, "before": None}
    if "(none) ->" not in history_line(first):
        failures.append(f"a first release's record: {history_line(first)}")
    assert not failures, "\n".join(failures)


def test_messages_built_from_outcomes_jsonl_records_name_what_they_lack(node):
    """The node's kept outcome of a refused switch, found by the follow-up after a lost connection."""
    record = {"switch": "s1", "code": 3, "result": "refused", "release": "a" * 16, "node": "cyan", "at": STARTED,
              "message": "release refused: cyan is held by operator7@laptop: E2 benchmark", "detail": {}}

    def produce(fields: dict) -> list[str]:
        (node.releases / "outcomes.jsonl").write_text(json.dumps(fields) + "\n")
        code, line = follow_up_report("cyan", "s1", switch_state(node, "s1"), 30)
        return [line]

    failures: list[str] = []
    check_rule("outcomes.jsonl", produce(record), produce, record, failures)
    assert not failures, "\n".join(failures)


def test_a_node_that_answers_it_has_no_record_of_a_switch_is_not_called_unreachable(node):
    # Two breakers' case: a switch killed before its journal was written; the follow-up asked, the node answered
    # that it knows nothing of it, and the operator read "cyan: unreachable" (exit 6). Nothing was changed.
    from flatshare_ops.errors import Exit

    code, line = follow_up_report("cyan", "s1", switch_state(node, "never-heard-of"), 30)
    assert code == Exit.REFUSED, (code, line)
    assert "no record of switch s1" in line and "changed nothing" in line, line


@pytest.mark.parametrize("answer", [
    {"node": "peacock", "takes_calls": True, "problems": [], "locked": False, "holder": None},
    {"node": "peacock", "takes_calls": False, "problems": ["flatshare-gateway.service is inactive"], "locked": False,
     "holder": None},
    {"node": "peacock", "takes_calls": True, "problems": [], "locked": True,
     "holder": "operator7@hostvm7 pid 4242, release feedfacecafe0001"},
])
def test_messages_built_from_a_probe_answer_name_what_it_lacks(answer):
    def produce(fields: dict) -> list[str]:
        return [admission_line("peacock", "cyan", fields)[1], probe_words(fields)]

    failures: list[str] = []
    record = {k: v for k, v in answer.items() if v is not None}
    check_rule("a probe answer", produce(record), produce, record, failures)
    # what a probe answer does not establish counts against the node probed (adr/0007)
    for key in ("takes_calls", "locked"):
        counts, line = admission_line("peacock", "cyan", {k: v for k, v in record.items() if k != key})
        if counts:
            failures.append(f"a probe answer without {key} counted as serving: {line}")
    assert not failures, "\n".join(failures)


def test_the_operator_decides_from_the_status_answers_journal_state_never_from_its_summary():
    """Whether a node has a switch in its journal is a field of its status answer (``journal_state``); the summary
    beside it is for people. A node older than the field is read by its summary."""
    from flatshare_ops.common.protocol import JournalState
    from flatshare_ops.control.answers import journal_state

    base = {"node": "cyan", "release": "a" * 16, "units": {"flatshare-engine.service": "active"}, "in_progress": None}
    cases = [({"journal_state": "no-journal", "switching": "text for people"}, JournalState.NONE),
             ({"journal_state": "journal-unreadable", "switching": None}, JournalState.UNREADABLE),
             ({"journal_state": "journal-present", "switching": "release a -> b"}, JournalState.PRESENT),
             ({"switching": "unreadable journal"}, JournalState.PRESENT),  # an older node: its summary is all it says
             ({"switching": None}, JournalState.NONE),
             ({"journal_state": "sideways", "switching": None}, JournalState.NONE)]
    for fields, expected in cases:
        assert journal_state({**base, **fields}) is expected, fields
    line = " / ".join(status_lines("cyan", {**base, "journal_state": "journal-unreadable", "switching": None}))
    assert "UNFINISHED" in line and "journal cannot be read" in line and "None" not in line, line
    assert "UNFINISHED" not in " / ".join(status_lines("cyan", {**base, "journal_state": "no-journal", "switching": "x"}))


def test_fleet_answers_without_their_fields_say_so():
    """``flatshare status`` and ``lock status`` from answers lacking fields (an older or damaged node)."""
    status = {"node": "cyan", "release": "a" * 16, "units": {"flatshare-engine.service": "active"},
              "switching": None, "in_progress": None, "damaged": [], "drain_left": None}
    failures: list[str] = []

    def produce(fields: dict) -> list[str]:
        return [" / ".join(status_lines("cyan", fields))]

    record = {k: v for k, v in status.items() if v is not None and v != []}
    check_rule("a status answer", produce(record), produce, record, failures)
    for answer in ({"held": True}, {"held": True, "hold": {}}, {}, {"held": False}, {"error": "cyan: no answer"}):
        line = hold_line("cyan", answer)
        if PLACEHOLDERS.search(line):
            failures.append(f"lock status for {answer}: {line}")
    first = status_lines("cyan", {**record, "release": None})[0]
    if "no active release" not in first:
        failures.append(f"a node with no release yet: {first}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("text, limit, expected", [
    ("2 of the stopped engine's processes remain (pid 12345 python3 -m vllm)", 52,
     "2 of the stopped engine's processes remain (pid…"),
    ("held by pid 4321", 14, "held by pid…"),
    ("fits", 4, "fits"),
    ("x" * 30, 10, "x" * 9 + "…"),
])
def test_a_clipped_message_is_never_cut_inside_a_word_or_a_number(text, limit, expected):
    # A breaker's case: an automatic rollback's reason cut at 200 characters ended "pid 1" (of pid 12345):
    # a message that named init. A cut falls at a space and says it was cut.
    from flatshare_ops.common.text import clip, clip_tail

    assert clip(text, limit) == expected and len(clip(text, limit)) <= limit
    tail = clip_tail("the build failed: pid 12345 exited 1", 20)
    assert tail == "…pid 12345 exited 1" and len(tail) <= 20
    assert clip_tail("the build failed: pid 12345 exited 1", 14) == "…exited 1"  # never "…345 exited 1"
