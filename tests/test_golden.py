"""Golden answers' pure core (control/golden.py): differences found at the first differing token, the analysis
failed by them unless the release changes answers, the reference read from history; and the node's request."""

from __future__ import annotations

import json
import subprocess

import pytest

from flatshare_ops.common.completions import golden_body
from flatshare_ops.common.protocol import AnalysisPhase
from flatshare_ops.config.profile import Golden
from flatshare_ops.control.analysis import Action, assess
from flatshare_ops.control.golden import GoldenCheck, answers_of, reference_of
from flatshare_ops.sandbox.completions import answer_token_ids

PROMPTS = ("a", "b", "c")


def check(mine, theirs, against="peacock", changes=False):
    return GoldenCheck("cyan", against, PROMPTS, 4, tuple(mine), tuple(theirs), (), changes)


def test_a_difference_is_named_by_its_prompt_and_first_differing_position():
    c = check([(1, 2, 3, 4), (5, 6), (7, 8, 9, 9)], [(1, 2, 3, 4), (5, 6, 7), (7, 8, 0, 9)])
    # prompt 2: (5, 6) is a prefix of (5, 6, 7): they differ at position 2, where cyan's answer ended.
    assert [(d.number, d.position, d.canary_token, d.other_token) for d in c.differences] == [(2, 2, None, 7),
                                                                                             (3, 2, 9, 0)]
    assert c.failed and c.compared == 3
    assert "prompt 2 ('b') first differs at token 2: cyan its end, peacock token id 7" in c.reason()
    # Nothing compared is never said as agreeing.
    none = check([None, None, None], [(1,), (2,), (3,)])
    assert "none of the 3 prompt(s) could be compared" in none.line() and "agree" not in none.line()
    assert "1 more prompt(s) differ" in c.reason()


def test_equal_answers_and_unanswered_prompts_decide_nothing():
    c = check([(1, 2), None, (3,)], [(1, 2), (4,), None])
    assert c.differences == () and not c.failed and c.compared == 1


def test_a_release_that_changes_answers_says_the_difference_and_does_not_fail():
    c = check([(1,), (2,), (3,)], [(1,), (2,), (4,)], changes=True)
    assert len(c.differences) == 1 and not c.failed
    assert c.document()["differences"][0]["position"] == 0


def test_nothing_to_compare_with_records_the_answers_as_the_reference():
    c = check([(1,), (2,), (3,)], [], against=None)
    assert c.differences == () and not c.failed
    assert c.document()["canary_answers"] == [[1], [2], [3]]


@pytest.mark.parametrize("changes, phase, action", [(False, AnalysisPhase.FAILED, Action.ROLLBACK),
                                                    (True, AnalysisPhase.RUNNING, Action.MEASURE)])
def test_golden_answers_that_differ_fail_the_analysis_before_any_measurement(changes, phase, action):
    from flatshare_ops.config.profile import load_profile
    from conftest import REPO

    settings = load_profile(REPO / "profiles/rtx-5060-ti-serve.toml").profile.release.analysis
    result = assess([], settings, canary="cyan", baseline="peacock",
                    golden=check([(1,), (2,), (3,)], [(1,), (2,), (4,)], changes=changes))
    assert (result.phase, result.action, result.done) == (phase, action, phase == AnalysisPhase.FAILED)
    assert result.document()["golden"]["changes_answers"] is changes


def test_a_nodes_answer_is_read_per_prompt_and_what_it_could_not_answer_is_said():
    ids, errors = answers_of("cyan", {"answers": [{"token_ids": [1, 2]}, {"error": "HTTP 500: boom"},
                                                  {"token_ids": [True]}]}, 3, 4)
    assert ids == ((1, 2), None, None)
    assert errors == ["cyan, prompt 2: HTTP 500: boom", "cyan, prompt 3: no token ids of at most 4 tokens"]
    # What no answer of max_tokens 4 can be (a breaker's cases): too many ids, a negative one, one past 2**31.
    for bad in ([1] * 5, [-1], [2**31], [1.0]):
        ids, _ = answers_of("cyan", {"answers": [{"token_ids": bad}]}, 1, 4)
        assert ids == (None,), bad
    ids, errors = answers_of("cyan", {"error": "no readable active release"}, 3, 4)
    assert ids == (None, None, None) and errors == ["cyan: no readable active release"]


def _analysed(prompts, answers, phase="passed", max_tokens=4):
    return {"result": "analysed", "analysis": {"phase": phase, "golden": {
        "prompts": list(prompts), "max_tokens": max_tokens, "failed": False, "canary_answers": answers}}}


def test_the_reference_is_the_newest_passed_analysis_for_the_same_prompts():
    records = [_analysed(PROMPTS, [[1], [2], [3]]),
               _analysed(PROMPTS, [[4], [5], [6]]),
               _analysed(PROMPTS, [[7], [8], [9]], phase="failed"),  # a failed analysis is no reference
               _analysed(("other",), [[0]]),  # other prompts
               _analysed(PROMPTS, [[0], [0], [0]], max_tokens=8),  # another length
               {"result": "released"}, "not a record"]
    assert reference_of(records, list(PROMPTS), 4) == ((4,), (5,), (6,))
    assert reference_of(records[3:], list(PROMPTS), 4) is None
    # Damaged or empty references are no reference (a breaker's cases): booleans as ids, max_tokens 4.0 or true,
    # every answer null (an older good one is used instead).
    damaged = [_analysed(PROMPTS, [[True], [False], [True]]), _analysed(PROMPTS, [[9], [9], [9]], max_tokens=4.0),
               _analysed(PROMPTS, [None, None, None])]
    assert reference_of(records[:2] + damaged, list(PROMPTS), 4) == ((4,), (5,), (6,))


def test_the_request_is_greedy_and_asks_for_token_ids_as_vllm_reads_them():
    # vLLM 0.32.0's own request model reads the body (tests/vllm_parser/completion_request.py).
    from conftest import REPO

    read = subprocess.run([str(REPO / ".venv-vllm/bin/python"), str(REPO / "tests/vllm_parser/completion_request.py")],
                          input=json.dumps(golden_body("hello", 16)), capture_output=True, text=True, timeout=300)
    assert read.returncode == 0, read.stderr
    assert json.loads(read.stdout) == {"temperature": 0, "max_tokens": 16, "return_token_ids": True, "stream": False,
                                       "greedy": True}


def test_the_profile_bounds_golden_prompts():
    with pytest.raises(ValueError, match="prompt 2 must be 1 to 2000 characters"):
        Golden(prompts=["ok", "x" * 2001])
    with pytest.raises(ValueError):
        Golden(prompts=["p"] * 17)
    assert Golden().prompts == []


def test_the_stand_ins_answers_are_the_same_for_a_prompt_and_shifted_where_told():
    a, b = answer_token_ids("p", 6), answer_token_ids("p", 6)
    assert a == b and a != answer_token_ids("q", 6)
    shifted = answer_token_ids("p", 6, shift_from=2)
    assert shifted[:2] == a[:2] and [s - 1 for s in shifted[2:]] == a[2:]


def test_a_call_whose_one_token_has_empty_text_is_a_call_served():
    # vLLM streams a special token (skipped by its detokenizer) as a chunk with text "", and counts it in the
    # usage chunk; the admission's probe call once took that for "streamed no token" and refused a drain.
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from flatshare_ops.node.calls import call_problem

    events = [{"choices": [{"index": 0, "text": "", "finish_reason": "length"}]},
              {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}]

    class Engine(BaseHTTPRequestHandler):
        usage = True

        def do_POST(self):  # noqa: N802 (http.server's name)
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for event in events if Engine.usage else events[:1]:
                self.wfile.write(b"data: " + json.dumps(event).encode() + b"\n\n")
            self.wfile.write(b"data: [DONE]\n\n")

        def log_message(self, *_args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Engine)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert call_problem(url, 10) is None
        Engine.usage = False  # no usage and no text: nothing says a token came
        assert "streamed no token" in call_problem(url, 10)
    finally:
        server.shutdown()
        server.server_close()


def _engine(answer):
    """A local HTTP server answering every POST with ``answer(handler)``; returns (server, base URL)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Engine(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            self.rfile.read(int(self.headers["Content-Length"]))
            answer(self)

        def log_message(self, *_args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Engine)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def _send(handler, status: int, body: bytes, drip_s: float = 0.0) -> None:
    import time

    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    try:
        for i in range(len(body)) if drip_s else [0]:
            handler.wfile.write(body[i:i + 1] if drip_s else body)
            handler.wfile.flush()
            time.sleep(drip_s)
    except OSError:
        pass  # the reader gave up: what the test wants


@pytest.mark.parametrize("case", ["a choice that is a string", "an error of 100,000 characters",
                                  "an answer sent a byte every 0.2 s"])
def test_an_engines_strange_golden_answer_is_said_in_one_short_line_within_the_bound(case):
    # Breakers' cases: a traceback (AttributeError) from a choice that is no object, an error message carried
    # whole onto the operator's line, and a slow answer that held the reader for 50 s against a 3 s bound.
    import time

    from flatshare_ops.common.completions import post_completion

    body = {"a choice that is a string": (200, json.dumps({"choices": ["x"], "usage": {"completion_tokens": 1}})),
            "an error of 100,000 characters": (500, json.dumps({"error": {"message": "A" * 100_000}})),
            "an answer sent a byte every 0.2 s": (200, json.dumps({"choices": [{"text": "x" * 100, "token_ids": [1]}],
                                                                   "usage": {"completion_tokens": 1}}))}[case]
    drip = 0.2 if "byte" in case else 0.0
    server, url = _engine(lambda h: _send(h, body[0], body[1].encode(), drip))
    try:
        started = time.monotonic()
        outcome = post_completion(url, golden_body("a", 4), "t", 2.0)
        took = time.monotonic() - started
    finally:
        server.shutdown()
        server.server_close()
    assert outcome.error is not None and outcome.token_ids is None, outcome
    assert len(outcome.error) < 400 and "\n" not in outcome.error, outcome.error
    if drip:  # the whole answer would take len(body) x 0.2 s (over 20 s): the reader gave up at its own bound
        assert len(body[1]) * drip > 20 and took < 10, took
        assert "within 2 s" in outcome.error, outcome.error
