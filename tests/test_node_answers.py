"""A node command that cannot answer says why, and its exit code, as the fields of one protocol line on its stdout
(common/protocol.py ``CommandError``); the operator's side reads those fields, never a line of the node's stderr
or its prefix (issue 33). The node's own process is run here; the line is read back with json, not the protocol's
own parser."""

from __future__ import annotations

import json
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
