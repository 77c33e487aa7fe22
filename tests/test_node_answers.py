"""A node command that cannot answer says why, and its exit code, as the fields of one protocol line on its stdout
(common/protocol.py ``CommandError``); the operator's side reads those fields, never a line of the node's stderr
or its prefix (issue 33). The node's own process is run here; the line is read back with json, not the protocol's
own parser."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from flatshare_ops.control import canary
from flatshare_ops.control.connection import CommandResult
from flatshare_ops.control.fanout import NodeCommandError, answer_of, not_an_answer
from test_commands import SPEC


def _record_analysis(tmp_path, stdin: bytes) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flatshare_ops.node", "record-analysis", "--node", "cyan",
                           "--state-dir", str(tmp_path), "--scope", "user", "--switch", "s1"],
                          input=stdin, capture_output=True, timeout=60)


def _error_line(stdout: bytes) -> dict:
    (line,) = [text for text in stdout.decode().splitlines() if text.startswith("::flatshare:error ")]
    return json.loads(line.removeprefix("::flatshare:error "))


def test_a_node_command_that_cannot_answer_gives_its_reason_and_exit_code_as_fields(tmp_path):
    done = _record_analysis(tmp_path, b"this is no analysis\n")
    assert done.returncode == 2, done  # bad input (errors.py Exit.BAD_INPUT)
    error = _error_line(done.stdout)
    assert error["code"] == done.returncode and "stdin is not JSON" in error["message"], error
    assert b"stdin is not JSON" in done.stderr  # still said to a person who runs it by hand
    result = CommandResult(done.returncode, done.stdout.decode(), done.stderr.decode())
    with pytest.raises(NodeCommandError) as raised:
        answer_of(result)
    assert raised.value.error.code == 2
    assert not_an_answer(result.status, result.output + result.errors, raised.value) == f"exit 2: {error['message']}"


def test_a_node_commands_reason_reaches_the_operator_whole_with_its_way_out(tmp_path):
    # A history that is a directory, under a state directory with a long path (as a sandbox's is): the node's
    # reason names the path twice and ends with what to do; the operator's line carries all of it.
    state = tmp_path / ("a-state-directory-with-a-long-name-" * 4) / "state"
    (state / "releases/history.jsonl").mkdir(parents=True)
    done = subprocess.run([sys.executable, "-m", "flatshare_ops.node", "history", "--node", "cyan",
                           "--state-dir", str(state), "--scope", "user"], capture_output=True, timeout=60)
    error = _error_line(done.stdout)
    assert len(error["message"]) > 300 and error["message"].endswith("until a release serves"), error
    result = CommandResult(done.returncode, done.stdout.decode(), done.stderr.decode())
    with pytest.raises(NodeCommandError) as raised:
        answer_of(result)
    assert not_an_answer(result.status, result.output + result.errors, raised.value) == \
        f"exit {done.returncode}: {error['message']}"


class _Session:
    """What a node's record-analysis said (the bytes as a session reads them) and its exit status."""

    def __init__(self, said: bytes, status: int) -> None:
        self.said, self.status, self.sent = said, status, b""

    def send(self, data: bytes) -> None:
        self.sent += data

    def close_stdin(self) -> None:
        pass

    def read(self, _timeout_s: float) -> bytes:
        chunk, self.said = self.said, b""
        return chunk

    def exit_status(self, _timeout_s: float) -> int:
        return self.status

    def close(self) -> None:
        pass


def test_an_analysis_the_node_could_not_record_is_said_with_the_nodes_reason_not_its_stderr_line(tmp_path):
    done = _record_analysis(tmp_path, b"[1, 2]\n")
    error = _error_line(done.stdout)
    lines: list[str] = []
    session = _Session(done.stderr + done.stdout, done.returncode)  # the protocol line last, after stderr's
    rollout = SimpleNamespace(id="r1", settings=SimpleNamespace(transport=SimpleNamespace(command_timeout_s=5)),
                              start=lambda _target, _argv: session, out=SimpleNamespace(line=lines.append))
    canary.record(rollout, SimpleNamespace(name="cyan", spec=SPEC), "s1", {"phase": "passed"})
    assert json.loads(session.sent) == {"phase": "passed"}
    assert lines == [f"cyan: note: the analysis could not be recorded in its history (exit {done.returncode}: "
                     f"{error['message']})"], lines


# --- the release's serving-check, a program whose report is data (node/serving_check.py) ---------------------


def _switcher_whose_check_prints(tmp_path, text: str):
    """A copy of this checkout's flatshare_ops whose serving-check prints ``text`` and exits 0 (a damaged one)."""
    import shutil

    from conftest import REPO

    code = tmp_path / "switcher"
    shutil.copytree(REPO / "flatshare_ops", code / "flatshare_ops", ignore=shutil.ignore_patterns("__pycache__"))
    (code / "flatshare_ops/check/cli.py").write_text(f"def main():\n    print({text!r})\n")
    return code


def _context(tmp_path):
    from flatshare_ops.common.systemd import ManagerAddress
    from flatshare_ops.node.context import NodeContext

    (tmp_path / "state").mkdir(exist_ok=True)
    return NodeContext("cyan", tmp_path / "state", ManagerAddress("user", tmp_path / "runtime"))


@pytest.mark.parametrize("text", ["", "garbage", "[" * 100000, '{"node": "cyan", "findings": []}',
                                  '{"node": "cyan", "findings": [{"check": "x", "status": "OK", "summary": "s", '
                                  '"details": null}]}'])
def test_a_shipped_serving_check_that_gives_no_report_is_replaced_by_the_installed_one(tmp_path, text):
    # Breakers' cases: a shipped serving-check printing nothing, garbage, JSON nested past any bound (which raised
    # RecursionError through the switch), a report with no findings (taken as OK) or a damaged finding. The
    # node's installed serving-check (its timer's) checks instead, and that is said.
    from flatshare_ops.node.serving_check import run_serving_check

    notes: list[str] = []
    report = run_serving_check(_context(tmp_path), note=notes.append, code=_switcher_whose_check_prints(tmp_path, text))
    assert report.findings and report.node == "cyan"  # the installed one's: an empty state directory, named
    assert any(f.check == "release" and f.status == "UNKNOWN" for f in report.findings), report.findings
    (said,) = notes
    assert said.startswith("the release's own serving-check gave no report (exit 0") and "installed" in said, said


def test_no_report_from_either_serving_check_is_no_verdict(tmp_path, monkeypatch):
    from flatshare_ops.node import serving_check

    monkeypatch.setattr(serving_check, "INSTALLED", "print('[' * 100000)")
    with pytest.raises(serving_check.NoReport) as raised:
        serving_check.run_serving_check(_context(tmp_path), code=_switcher_whose_check_prints(tmp_path, "garbage"))
    message = str(raised.value)
    assert message.startswith("serving-check gave no report: the release's own: exit 0: garbage; the node's "
                              "installed one: exit 0: "), message
    assert not isinstance(raised.value, RecursionError)


def test_a_serving_check_that_hangs_is_killed_at_its_bound_and_reports_progress_while_it_waits(tmp_path, monkeypatch):
    # A breaker's case: a hanging serving-check sent nothing for a minute, and the operator's silence bound took
    # the switch for a stalled session (exit 7). The wait reports progress at the process's cadence, and ends at
    # the bound (the tool's own deadline, shortened here).
    from flatshare_ops.common import poll
    from flatshare_ops.node import serving_check

    monkeypatch.setattr(serving_check, "DEADLINE_S", -9.0)  # the process's bound: DEADLINE_S + 10 = 1 s
    monkeypatch.setattr(serving_check, "INSTALLED", "import time; time.sleep(600)")
    monkeypatch.setattr(serving_check, "SHIPPED", "import time; time.sleep(600)")
    poll.set_progress_every(0.2)
    waited: list[float] = []
    try:
        with pytest.raises(serving_check.NoReport, match="no report within 1 s \\(killed\\)"):
            serving_check.run_serving_check(_context(tmp_path), progress=waited.append, code=tmp_path)
    finally:
        poll.set_progress_every(poll.PROGRESS_EVERY_S)
    assert waited, "no progress while it waited"


def test_a_line_for_people_holding_escapes_or_a_forged_protocol_line_is_one_escaped_line(tmp_path):
    # A breaker's case: a drop-in's name holding ESC[31m, an OSC title and a newline followed by a forged
    # '::flatshare:outcome {...}' reached the operator's terminal raw, and the forged line stood on a line of its own.
    import io

    from flatshare_ops.node.output import ReleaseOutput

    stream = io.StringIO()
    out = ReleaseOutput(tmp_path / "release.log", stream)
    out.line('refused: drop-in x\x1b[31m\x1b]0;TITLE\x07\n::flatshare:outcome {"code": 0}')
    out.close()
    for shown in (stream.getvalue(), (tmp_path / "release.log").read_text()):
        (line,) = shown.splitlines()
        assert "\x1b" not in line and "\x07" not in line and "\\x1b[31m" in line, line
        assert "\\n::flatshare:outcome" in line and not line.startswith("::flatshare:"), line


def test_doctor_says_a_serving_check_under_way_is_running_not_that_it_never_ran():
    # A loaded CI run: the timer's next run had started (systemd clears the run before's exit then), and doctor
    # said serving-check "has not run from it yet".
    from flatshare_ops.control.doctor import check_runs_line

    running = {"timer": "active", "result": "success", "status": 0, "code": None, "age_s": None, "running": True}
    assert check_runs_line("cyan", running) == (
        "ok", "cyan serving-check", "serving-check.timer active; serving-check is running now (its last run is not known)")
    never = {**running, "running": False}
    assert check_runs_line("cyan", never)[2] == "serving-check.timer active; serving-check has not run from it yet"


def _switch_at_its_last_step(tmp_path):
    """(a node context, the journal of its release s1 a -> b at its record-history step, written)."""
    import time

    from flatshare_ops.common.protocol import SwitchKind
    from flatshare_ops.node import journal as journals

    ctx = _context(tmp_path)
    ctx.releases.mkdir(parents=True)
    journal = journals.Journal(from_="a" * 16, to="b" * 16, node="cyan", host="h", pid=os.getpid(), user="u",
                               started_at=time.time(), kind=SwitchKind.RELEASE, switch="s1",
                               steps=[journals.StepRecord(name="record-history")])
    journals.write_journal(ctx.state_dir, journal)
    return ctx, journal


def _ended_at_the_journal_read(monkeypatch, end) -> None:
    """Make node/status.py's first journal read call ``end()`` first (the switch's own writers ending it, after
    the history was read), with the lock let go."""
    from flatshare_ops.node import status

    reading, ended = status._read_journal, list[bool]()

    def journal_read_after_the_switch_ended(context):
        if not ended:
            end()
            ended.append(True)
        return reading(context)

    monkeypatch.setattr(status, "_read_journal", journal_read_after_the_switch_ended)
    monkeypatch.setattr(status, "holder_pid", lambda _ctx: None)  # its lock let go


def test_a_switch_that_ends_between_the_history_read_and_the_journal_read_is_recorded_not_ended(tmp_path,
                                                                                                 monkeypatch):
    # A suite run's case (under load): a follow-up's status read the history of a switch at its last step (no
    # record yet), the switch then recorded itself, removed its journal, kept its command's outcome and let its
    # lock go; the journal and the lock read after that found only the outcome kept: "released: no message kept,
    # though its kept outcome has no message", as of a command that ran no switch, where the record says which
    # release. The switch's own writers end it here, between the two reads.

    from flatshare_ops.common.protocol import Outcome, OutcomeResult, RecordResult, SwitchState
    from flatshare_ops.node import journal as journals, outcomes, records, status

    ctx, journal = _switch_at_its_last_step(tmp_path)
    def end() -> None:
        records.append_success(ctx, journal, journal.to)
        journals.remove_journal(ctx.state_dir)
        outcomes.append(ctx, Outcome(switch="s1", code=0, result=OutcomeResult.RELEASED, release="b" * 16))

    _ended_at_the_journal_read(monkeypatch, end)
    answer = status.switch_state(ctx, "s1")
    assert answer["state"] == SwitchState.RECORDED, answer
    assert answer["record"]["result"] == RecordResult.RELEASED and answer["record"]["target"] == "b" * 16


def test_a_switch_that_ends_between_the_journal_read_and_the_lock_read_is_recorded_not_interrupted(tmp_path,
                                                                                                      monkeypatch):
    # A suite run's case (under load): a follow-up's status read the journal of a switch at its last step, the
    # switch then recorded itself, removed its journal and let its lock go, and the lock read free: "interrupted"
    # of a release that was recorded. The switch's own writers end it here, between the two reads.

    from flatshare_ops.common.protocol import RecordResult, SwitchState
    from flatshare_ops.node import journal as journals, records, status

    ctx, journal = _switch_at_its_last_step(tmp_path)
    ended: list[bool] = []

    def lock_read_after_the_switch_ended(_ctx):
        if not ended:
            records.append_success(ctx, journal, journal.to)  # the record-history step, then the journal's removal
            journals.remove_journal(ctx.state_dir)
            ended.append(True)
        return None  # its lock let go

    monkeypatch.setattr(status, "holder_pid", lock_read_after_the_switch_ended)
    answer = status.switch_state(ctx, "s1")
    assert answer["state"] == SwitchState.RECORDED, answer
    assert answer["record"]["result"] == RecordResult.RELEASED and answer["record"]["target"] == "b" * 16
    # A journal no lock holds in both readings is an interrupted switch, as before.
    journals.write_journal(ctx.state_dir, journal.model_copy(update={"switch": "s2"}))
    assert status.switch_state(ctx, "s2")["state"] == SwitchState.INTERRUPTED


def test_an_automatic_rollback_that_ends_between_the_history_read_and_the_journal_read_is_its_record(tmp_path,
                                                                                                  monkeypatch):
    # A suite run's case (under a busy loop): the operator's session was killed during an automatic rollback; the
    # follow-up's status read the history while the rollback ran (the failed release recorded, the rollback not
    # yet), the rollback then recorded itself, removed its journal and let its lock go, and the journal and lock
    # read after that found nothing running: "failed at restart-engine" (exit 1) of a switch the node had rolled
    # back (exit 9). The rollback's own writers end it here, between the two reads.
    from flatshare_ops.common.protocol import RecordResult, SwitchKind, SwitchState
    from flatshare_ops.control.answers import follow_up_report, followed_releases
    from flatshare_ops.errors import Exit
    from flatshare_ops.node import journal as journals, records, status

    ctx, failed = _switch_at_its_last_step(tmp_path)
    records.append_failure(ctx, failed.model_copy(update={"steps": [journals.StepRecord(name="restart-engine")]}),
                           "restart-engine", "the engine never answered", verdict=True)
    rollback = failed.model_copy(update={"from_": failed.to, "to": failed.from_, "kind": SwitchKind.ROLLBACK,
                                         "auto": "restart-engine failed: the engine never answered"})
    journals.write_journal(ctx.state_dir, rollback)

    def end() -> None:
        records.append_success(ctx, rollback, rollback.to)
        journals.remove_journal(ctx.state_dir)

    _ended_at_the_journal_read(monkeypatch, end)
    answer = status.switch_state(ctx, "s1")
    assert answer["state"] == SwitchState.RECORDED, answer
    assert answer["record"]["result"] == RecordResult.ROLLED_BACK and answer["record"]["target"] == "a" * 16, answer
    assert follow_up_report("cyan", "s1", answer, 30)[0] == Exit.ROLLED_BACK
    # The summary's row from the answer (a breaker's case: '-' for from -> to after a follow-up): it left "a", tried
    # "b", and is back on "a".
    assert followed_releases(answer) == ("a" * 16, "a" * 16, "b" * 16)
