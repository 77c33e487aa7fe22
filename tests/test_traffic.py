"""Real traffic through the sandbox's stand-ins: calls stream through the gateways to the engines, a release's
drain waits for real streams, the voice worker's turn hints reach the engine first, and the stand-in engine's
/metrics are vLLM's own series (read with prometheus_client's parser) and serve chosen behaviour on request.

The independent truth: what a real HTTP client received (the caller's reports), the gateways' own counts
(``/stats`` and the drain record a gateway writes when its drain ends), the voice worker's status file, the
engine's own record of the requests it saw, and a real Prometheus text parser.
"""

from __future__ import annotations

import ast
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from conftest import BIN, REPO, loopback_pair
from release_fleet import sandbox_fleet
from flatshare_ops.sandbox.caller import Gateway, place_call, run_calls
from flatshare_ops.common.completions import post_completion, request_body
from flatshare_ops.node.calls import PROBE_REQUEST_ID
from flatshare_ops.sandbox.engine_behaviour import Behaviour

ADDRESSES = loopback_pair(73)
SPARE = ADDRESSES["cyan"].rsplit(".", 1)[0] + ".4"  # for a stand-in started by hand, outside the fleet
DEFAULTS = Behaviour().as_dict()
VLLM_SITE = next((REPO / ".venv-vllm").glob("lib/python*/site-packages"), None)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    with sandbox_fleet(tmp_path_factory, ADDRESSES) as f:
        yield f


def _engine(name: str) -> str:
    return f"http://{ADDRESSES[name]}:8000"


def _gateway(name: str) -> Gateway:
    return Gateway(name, f"http://{ADDRESSES[name]}:8080")


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def _json(url: str) -> dict:
    status, body = _get(url)
    assert status == 200, (url, status, body)
    return json.loads(body)


def _post(url: str, document: object | None = None) -> tuple[int, dict]:
    data = b"" if document is None else json.dumps(document).encode()
    request = urllib.request.Request(url, method="POST", data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _behave(name: str, **fields) -> None:
    status, answer = _post(f"{_engine(name)}/flatshare-standin/behaviour", fields)
    assert status == 200, answer


@pytest.fixture
def peacock(fleet):
    """peacock's engine for one test: counters at zero, default behaviour before and after."""
    _behave("peacock", **DEFAULTS)
    assert _post(f"{_engine('peacock')}/flatshare-standin/reset")[0] == 200
    yield _engine("peacock")
    _behave("peacock", **DEFAULTS)


def _wait_for(predicate, timeout_s: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"{what}: not met within {timeout_s:g} s")


def _families(url: str) -> dict:
    """``/metrics`` read by prometheus_client's own text parser: family name -> family."""
    status, body = _get(url + "/metrics")
    assert status == 200
    return {family.name: family for family in text_string_to_metric_families(body.decode())}


def _value(families: dict, family: str, sample: str, **labels) -> float:
    (value,) = [s.value for s in families[family].samples
                if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())]
    return value


def _buckets(families: dict, family: str) -> dict[str, float]:
    return {s.labels["le"]: s.value for s in families[family].samples if s.name == f"{family}_bucket"}


def _requests(url: str, prefix: str) -> list[dict]:
    return [r for r in _json(f"{url}/flatshare-standin/requests")["requests"] if r["request_id"].startswith(prefix)]


# --- a release drains real streams; the caller fails over -----------------------------------------------


def test_a_stream_through_cyan_when_its_release_starts_finishes_and_calls_during_the_drain_go_to_peacock(fleet):
    cyan, peacock = _gateway("cyan"), _gateway("peacock")
    cyan_node = fleet.node("cyan")
    fleet.set_hold(48 if fleet.hold("cyan") == "0" else 0)  # a change of the engine's flags: the whole switch
    peacock_before = _json(f"{peacock.url}/stats")
    # What cyan's gateway (the process the release drains) completed before: its drain record counts from its start
    # (the switch that started it placed its own call through it, node/steps.py's serving-check step).
    cyan_before = _json(f"{cyan.url}/stats")
    probes_before = len(_requests(_engine("peacock"), PROBE_REQUEST_ID))
    # 0.1 s a token (read at every token) until the test speeds cyan's engine up.
    _behave("cyan", token_s=0.1)
    try:
        long_call: dict = {}
        caller = threading.Thread(target=lambda: long_call.setdefault(
            "report", place_call([cyan, peacock], 1, 400, timeout_s=120)))
        caller.start()
        _wait_for(lambda: [r for r in _requests(_engine("cyan"), "caller-1") if r["tokens"]], 10, "the long call streams")
        log = cyan_node.state_dir / "releases/release.log"
        offset = log.stat().st_size if log.exists() else 0
        released_from = time.time()
        release = subprocess.Popen([str(BIN / "flatshare"), "release", "--inventory", str(fleet.inventory),
                                    "--root", str(fleet.checkout), "--node", "cyan"],
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            # A voice call on cyan (one turn, its reply 80 tokens: 8 s) holds the release in its voice drain:
            # placed when cyan asks for admission to drain (the drain is next), so that the call is still in
            # progress when the drain begins however long the release took to get there.
            _wait_for(lambda: log.exists() and b"asking the operator's side for admission to drain"
                      in log.read_bytes()[offset:], 60, "cyan's release asks for admission")
            status, started = _post(f"http://{cyan_node.address}:8090/calls/start?seconds=0&turns=1&tokens=80")
            assert status == 200, started
            _drain_cyan_while_calls_come(fleet, cyan, peacock, started["call"])
            caller.join(60)
            out = release.communicate(timeout=120)[0]
        finally:
            if release.poll() is None:
                release.kill()
                release.wait()
    finally:
        if _get_quietly(_engine("cyan") + "/health") == 200:
            _behave("cyan", **DEFAULTS)
    assert release.returncode == 0, out
    long_report = long_call["report"]
    assert (long_report.gateway, long_report.tokens, long_report.done, long_report.error) == ("cyan", 400, True, None)
    assert long_report.completion_tokens == 400
    # cyan's gateway's own record of its drain: the long stream and the voice call's reply completed, none cut.
    record = json.loads((cyan_node.run_dir / "gateway.drain.json").read_text())
    assert record["began_at"] >= released_from
    assert (record["completed"] - cyan_before["completed"], record["refused"] - cyan_before["refused"],
            record["cut"] - cyan_before["cut"], record["drained"]) == (2, 3, 0, 0)
    peacock_after = _json(f"{peacock.url}/stats")
    # peacock completed the three calls cyan refused, and the admission's calls through it (node/calls.py: one
    # each time cyan's drain was decided, its request id telling it from callers' at peacock's engine).
    probes = len(_requests(_engine("peacock"), PROBE_REQUEST_ID)) - probes_before
    assert probes >= 1, "the admission placed no call through peacock's gateway"
    assert peacock_after["completed"] - peacock_before["completed"] == 3 + probes and peacock_after["refused"] == 0
    fleet.settled("cyan")


def _drain_cyan_while_calls_come(fleet, cyan: Gateway, peacock: Gateway, voice_call: int) -> None:
    """Follow cyan's release through its voice drain (the voice call's reply streams to its end) and its
    gateway's drain, where three new calls are refused by cyan and answered by peacock."""
    node = fleet.node("cyan")
    status_file = node.run_dir / "voice.status"
    draining = _wait_for(lambda: (s := json.loads(status_file.read_text()))["state"] == "draining" and s,
                         30, "the voice drain, the call in progress")
    assert draining["calls_in_progress"] == 1
    drained = _wait_for(lambda: (s := json.loads(status_file.read_text()))["state"] == "drained" and s,
                        30, "the voice drain's end")
    assert drained["drain_id"] == draining["drain_id"] and drained["calls_in_progress"] == 0
    (call,) = [c for c in _json(f"http://{node.address}:8090/calls")["calls"] if c["call"] == voice_call]
    assert [(t["hint"]["status"], t["reply"]["tokens"], t["reply"]["done"]) for t in call["turns"]] == [(200, 80, True)]
    # cyan's gateway drains (SIGTERM): it answers 503 while the long stream goes on.
    _wait_for(lambda: _get(f"{cyan.url}/health")[0] == 503, 30, "cyan's gateway drains")
    reports: list = []
    during = threading.Thread(target=lambda: reports.extend(
        run_calls([cyan, peacock], concurrency=3, calls=3, tokens=8, timeout_s=30)))
    during.start()
    _wait_for(lambda: _json(f"{cyan.url}/stats")["refused"] == 3, 5, "cyan refuses the three new calls")
    _behave("cyan", token_s=0.001)  # the long call may now finish, well inside the gateway's drain timeout
    during.join(60)
    assert [(r.gateway, r.attempts, r.tokens, r.done, r.error) for r in reports] == \
        [("peacock", [{"gateway": "cyan", "refusal": "HTTP 503"}], 8, True, None)] * 3


# --- turn hints ----------------------------------------------------------------------------------------


def test_the_voice_workers_turn_hint_reaches_the_engine_before_each_turns_completion(fleet, peacock):
    voice = f"http://{ADDRESSES['peacock']}:8090"
    status, started = _post(f"{voice}/calls/start?seconds=0.3&turns=3&tokens=2")
    assert status == 200
    call = started["call"]
    _wait_for(lambda: next(c for c in _json(f"{voice}/calls")["calls"] if c["call"] == call)["ended_at"], 30,
              "the call ends")
    seen = _requests(peacock, f"voice-{call}-")
    assert [r["request_id"] for r in sorted(seen, key=lambda r: r["seq"])] == [
        f"voice-{call}-{turn}-{kind}" for turn in (1, 2, 3) for kind in ("hint", "reply")]
    hints = [r for r in seen if r["request_id"].endswith("-hint")]
    replies = [r for r in seen if r["request_id"].endswith("-reply")]
    assert all((r["turn_hint"], r["stream"], r["max_tokens"], r["finished_reason"]) == (True, False, 1, "length")
               for r in hints)
    assert all((r["turn_hint"], r["stream"], r["tokens"], r["finished_reason"]) == (False, True, 2, "length")
               for r in replies)
    families = _families(peacock)
    assert _value(families, "flatshare:make_room_turns_announced", "flatshare:make_room_turns_announced_total") == 3


# --- /metrics: vLLM's series, read by a real parser ----------------------------------------------------


def test_metrics_parse_and_the_histograms_count_the_requests_made(fleet, peacock):
    _behave("peacock", ttft_s=0.3, token_s=0.001)  # every time to first token in vLLM's (0.25, 0.5] bucket
    reports = run_calls([_gateway("peacock")], concurrency=3, calls=6, tokens=4, timeout_s=30)
    assert [(r.tokens, r.done, r.error) for r in reports] == [(4, True, None)] * 6
    assert all(r.ttft_s >= 0.3 for r in reports)  # what the client lived: the engine waited before the first token
    families = _families(peacock)
    labels = {"engine": "0", "model_name": "flatshare-chat"}
    ttft = "vllm:time_to_first_token_seconds"
    assert _value(families, ttft, f"{ttft}_count", **labels) == 6
    assert _buckets(families, ttft)["0.25"] == 0 and _buckets(families, ttft)["0.5"] == 6
    assert _buckets(families, ttft)["+Inf"] == 6
    e2e = "vllm:e2e_request_latency_seconds"
    assert _value(families, e2e, f"{e2e}_count", **labels) == 6 and _buckets(families, e2e)["0.3"] == 0
    success = "vllm:request_success"
    counts = {s.labels["finished_reason"]: s.value for s in families[success].samples if s.name == f"{success}_total"}
    assert counts == {"stop": 0, "length": 6, "abort": 0, "error": 0, "repetition": 0}
    assert _value(families, "vllm:generation_tokens", "vllm:generation_tokens_total", **labels) == 24
    assert _value(families, "vllm:num_requests_running", "vllm:num_requests_running", **labels) == 0
    assert _value(families, "vllm:num_requests_waiting", "vllm:num_requests_waiting", **labels) == 0


def test_metrics_text_is_what_prometheus_client_writes_for_the_same_families(fleet):
    """The bytes vLLM's exporter (prometheus_client) would write for these series: parsed and written back, equal."""
    status, body = _get(_engine("cyan") + "/metrics")
    families = list(text_string_to_metric_families(body.decode()))

    class Parsed:
        def collect(self):
            return families

    registry = CollectorRegistry()
    registry.register(Parsed())
    assert generate_latest(registry).decode() == body.decode()


def _vllm_source(relative: str) -> ast.Module:
    if VLLM_SITE is None:
        if os.environ.get("FLATSHARE_SKIP_VLLM_PARSER") == "1":
            pytest.skip(".venv-vllm is missing (FLATSHARE_SKIP_VLLM_PARSER=1)")
        pytest.fail(".venv-vllm is missing: run scripts/vllm-venvs.sh (make test does)")
    return ast.parse((VLLM_SITE / "vllm" / relative).read_text())


def test_metric_names_help_texts_and_buckets_are_vllm_0_32_0s_own(fleet):
    """Read from vLLM 0.32.0's own source in .venv-vllm (v1/metrics/buckets.py, loggers.py), not imported."""
    buckets = {}
    for node in _vllm_source("v1/metrics/buckets.py").body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if isinstance(target, ast.Name) and target.id.endswith("_BUCKETS") and node.value is not None:
            buckets[target.id] = ast.literal_eval(node.value)
    documentation = {}
    for call in ast.walk(_vllm_source("v1/metrics/loggers.py")):
        if isinstance(call, ast.Call):
            keywords = {k.arg: k.value for k in call.keywords}
            if isinstance(keywords.get("name"), ast.Constant) and "documentation" in keywords:
                try:
                    documentation[keywords["name"].value] = ast.literal_eval(keywords["documentation"])
                except ValueError:
                    pass
    families = _families(_engine("cyan"))
    ttft, e2e = "vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds"
    assert [float(le) for le in _buckets(families, ttft) if le != "+Inf"] == list(buckets["TIME_TO_FIRST_TOKEN_BUCKETS"])
    assert [float(le) for le in _buckets(families, e2e) if le != "+Inf"] == list(buckets["REQUEST_LATENCY_BUCKETS"])
    for name in (ttft, e2e, "vllm:request_success", "vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:prompt_tokens", "vllm:generation_tokens"):
        assert families[name].documentation == documentation[name], name
    assert {s.labels["finished_reason"] for s in families["vllm:request_success"].samples} == \
        {"stop", "length", "abort", "error", "repetition"}


# --- behaviour on request ------------------------------------------------------------------------------


def test_observations_on_request_put_p95_in_the_chosen_bucket_at_once(fleet, peacock):
    status, answer = _post(f"{peacock}/flatshare-standin/observe",
                           {"requests": 95, "ttft_s": 0.03, "e2e_s": 0.4, "generation_tokens": 8})
    assert (status, answer) == (200, {"recorded": 95})
    assert _post(f"{peacock}/flatshare-standin/observe", {"requests": 5, "ttft_s": 0.6, "e2e_s": 2.2,
                                                          "finished_reason": "error"})[0] == 200
    families = _families(peacock)
    ttft = _buckets(families, "vllm:time_to_first_token_seconds")
    assert (ttft["0.02"], ttft["0.04"], ttft["0.5"], ttft["0.75"], ttft["+Inf"]) == (0, 95, 95, 100, 100)
    e2e = _buckets(families, "vllm:e2e_request_latency_seconds")
    assert (e2e["0.3"], e2e["0.5"], e2e["2.0"], e2e["2.5"]) == (0, 95, 95, 100)
    assert _value(families, "vllm:request_success", "vllm:request_success_total", finished_reason="error") == 5
    assert _value(families, "vllm:generation_tokens", "vllm:generation_tokens_total") == 95 * 8 + 5 * 16


def test_shares_of_errors_and_aborts_end_exactly_that_many_requests_and_callers_see_them(fleet, peacock):
    _behave("peacock", error_share=0.25, abort_share=0.25)
    reports = run_calls([_gateway("peacock")], concurrency=4, calls=8, tokens=6, timeout_s=30)
    errors = [r for r in reports if r.error]
    aborts = [r for r in reports if r.finish_reason == "abort"]
    whole = [r for r in reports if r.finish_reason == "length"]
    assert len(errors) == 2 and all(r.done and r.tokens == 3 and "Internal server error" in r.error for r in errors)
    assert len(aborts) == 2 and all(r.done and r.tokens == 3 and r.error is None for r in aborts)
    assert len(whole) == 4 and all(r.tokens == 6 for r in whole)
    families = _families(peacock)
    counts = {s.labels["finished_reason"]: s.value for s in families["vllm:request_success"].samples
              if s.name == "vllm:request_success_total"}
    assert counts == {"stop": 0, "length": 4, "abort": 2, "error": 2, "repetition": 0}
    # Without streaming, a request that ends in error is vLLM's 500.
    _behave("peacock", error_share=1, abort_share=0)
    outcome = post_completion(peacock, request_body("x", 2, stream=False), "plain-error", 10)
    assert (outcome.status, outcome.error) == (500, "HTTP 500: Internal server error")


def test_a_client_that_goes_away_mid_stream_ends_its_request_in_abort(fleet, peacock):
    _behave("peacock", token_s=0.2)
    connection = http.client.HTTPConnection(ADDRESSES["peacock"], 8000, timeout=10)
    connection.request("POST", "/v1/completions", json.dumps(request_body("x", 50)),
                       {"Content-Type": "application/json", "X-Request-Id": "goes-away"})
    response = connection.getresponse()
    assert response.readline().startswith(b"data: ")
    connection.close()
    (seen,) = _wait_for(lambda: [r for r in _requests(peacock, "goes-away") if r["finished_reason"]], 10,
                        "the engine ends the request")
    assert seen["finished_reason"] == "abort" and seen["tokens"] < 50
    assert _value(_families(peacock), "vllm:request_success", "vllm:request_success_total", finished_reason="abort") == 1


def test_empty_and_malformed_metrics_on_request(fleet, peacock):
    _behave("peacock", metrics="empty")
    status, body = _get(peacock + "/metrics")
    assert (status, body) == (200, b"") and list(text_string_to_metric_families(body.decode())) == []
    _behave("peacock", metrics="malformed")
    status, body = _get(peacock + "/metrics")
    assert status == 200
    with pytest.raises(ValueError):
        list(text_string_to_metric_families(body.decode()))


def test_a_reset_makes_the_counters_go_backwards_as_after_an_engine_restart(fleet, peacock):
    assert run_calls([_gateway("peacock")], calls=2, tokens=2)[1].done
    before = _families(peacock)
    assert _value(before, "vllm:request_success", "vllm:request_success_total", finished_reason="length") == 2
    assert _post(f"{peacock}/flatshare-standin/reset")[0] == 200
    after = _families(peacock)
    assert _value(after, "vllm:request_success", "vllm:request_success_total", finished_reason="length") == 0
    assert _value(after, "vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_count") == 0
    created = "vllm:request_success_created"
    assert _value(after, created, created, finished_reason="length") > _value(before, created, created,
                                                                               finished_reason="length")


@pytest.mark.parametrize("change, message", [
    ({"ttft_s": -1}, "ttft_s: must be a number of seconds from 0 to 600, got -1"),
    ({"error_share": 0.7, "abort_share": 0.5}, "error_share + abort_share: must be at most 1, got 0.7 + 0.5"),
    ({"metrics": "json"}, "metrics: must be one of vllm, empty, malformed, got 'json'"),
    ({"ttft": 1}, "ttft: not a behaviour field; fields: ttft_s, token_s, error_share, abort_share, metrics, "
                  "answer_shift"),
])
def test_a_bad_behaviour_is_refused_in_one_line_and_changes_nothing(fleet, peacock, change, message):
    status, answer = _post(f"{peacock}/flatshare-standin/behaviour", change)
    assert (status, answer) == (400, {"error": message})
    assert _json(f"{peacock}/flatshare-standin/behaviour") == DEFAULTS


# --- stand-ins started by hand: the environment at start, the queue, the gateway's own failures --------------


def _start(argv: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen(argv, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _stop(process: subprocess.Popen) -> tuple[str, str]:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    return process.communicate(timeout=30)


def test_the_engine_takes_its_behaviour_from_its_environment_and_queues_beyond_max_num_seqs(fleet):
    vllm = str(fleet.node("cyan").venv / "bin/vllm")
    url = f"http://{SPARE}:8000"
    engine = _start([vllm, "serve", "/m", "--served-model-name", "spare", "--host", SPARE, "--port", "8000",
                     "--max-num-seqs", "1"],
                    {"FLATSHARE_STANDIN_LOAD_S": "0", "FLATSHARE_STANDIN_TTFT_S": "0.05", "FLATSHARE_STANDIN_TOKEN_S": "0.2",
                     "FLATSHARE_STANDIN_ERROR_SHARE": "0", "FLATSHARE_STANDIN_METRICS": "vllm"})
    try:
        _wait_for(lambda: _get_quietly(url + "/health") == 200, 30, "the spare engine starts")
        assert _json(url + "/flatshare-standin/behaviour") == {**DEFAULTS, "ttft_s": 0.05, "token_s": 0.2}
        outcomes: list = []
        streams = [threading.Thread(target=lambda i=i: outcomes.append(
            post_completion(url, request_body("x", 10), f"queued-{i}", 30))) for i in range(2)]
        for stream in streams:
            stream.start()
        # One runs, the other waits for the one seat (vLLM's --max-num-seqs).
        labels = {"engine": "0", "model_name": "spare"}
        _wait_for(lambda: (f := _families(url)) and _value(f, "vllm:num_requests_running", "vllm:num_requests_running",
                                                            **labels) == 1
                  and _value(f, "vllm:num_requests_waiting", "vllm:num_requests_waiting", **labels) == 1, 10,
                  "one request running and one waiting")
        for stream in streams:
            stream.join(30)
        assert [(o.tokens, o.done) for o in outcomes] == [(10, True)] * 2
    finally:
        _stop(engine)


def _get_quietly(url: str) -> int:
    try:
        return _get(url)[0]
    except OSError:
        return 0


def test_a_bad_behaviour_in_the_engines_environment_ends_its_start_in_one_line(fleet):
    vllm = str(fleet.node("cyan").venv / "bin/vllm")
    result = subprocess.run([vllm, "serve", "/m", "--host", SPARE, "--port", "8000"], capture_output=True, text=True,
                            env={**os.environ, "FLATSHARE_STANDIN_ERROR_SHARE": "half"}, timeout=60)
    assert result.returncode == 2
    assert result.stderr == ("stand-in engine: FLATSHARE_STANDIN_ERROR_SHARE: must be a share from 0 to 1 "
                             "(0.25 is one request in four), got 'half'\n")


def test_a_gateway_whose_engine_does_not_answer_says_502_and_its_drain_records_it(fleet, tmp_path):
    gateway = _start([sys.executable, "-m", "flatshare_ops.sandbox.gateway"],
                     {"FLATSHARE_GATEWAY_URL": f"http://{SPARE}:8080", "FLATSHARE_ENGINE_URL": f"http://{SPARE}:9",
                      "FLATSHARE_RUN_DIR": str(tmp_path), "FLATSHARE_DRAIN_TIMEOUT_S": "5"})
    try:
        _wait_for(lambda: _get_quietly(f"http://{SPARE}:8080/health") == 200, 30, "the gateway starts")
        outcome = post_completion(f"http://{SPARE}:8080", request_body("x", 2), "nowhere", 10)
        assert outcome.status == 502 and f"the engine at http://{SPARE}:9 did not answer" in outcome.error
        # The caller does not move a call on a 502: it is the call's answer.
        report = place_call([Gateway("spare", f"http://{SPARE}:8080"), _gateway("peacock")], 1, 2, 10)
        assert (report.gateway, report.status, report.attempts) == ("spare", 502, [])
    finally:
        out, err = _stop(gateway)
    assert gateway.returncode == 0, err
    record = json.loads((tmp_path / "gateway.drain.json").read_text())
    assert {k: record[k] for k in ("schema", "completed", "refused", "failed", "cut", "drained")} == \
        {"schema": 1, "completed": 0, "refused": 0, "failed": 2, "cut": 0, "drained": 0}


def test_calls_dialled_while_a_gateway_ends_its_drain_all_end_well(fleet, peacock, tmp_path):
    """Calls keep coming as a gateway's drain ends: each is answered there, or refused (503, a refused
    connection, or one closed before any answer, as a listening socket that closes resets its queue) and
    answered by the other number; none is dropped."""
    spare = Gateway("spare", f"http://{SPARE}:8083")
    gateway = _start([sys.executable, "-m", "flatshare_ops.sandbox.gateway", "--listen", f"{SPARE}:8083"],
                     {"FLATSHARE_ENGINE_URL": peacock, "FLATSHARE_RUN_DIR": str(tmp_path)})
    _wait_for(lambda: _get_quietly(f"{spare.url}/health") == 200, 30, "the gateway starts")
    reports: list = []
    numbers = iter(range(1, 100000))

    def dial_until_refused() -> None:
        while True:
            report = place_call([spare, _gateway("peacock")], next(numbers), 2, 30)
            reports.append(report)
            if report.attempts and report.attempts[-1]["refusal"] == "connection refused":
                return

    callers = [threading.Thread(target=dial_until_refused) for _ in range(4)]
    for caller in callers:
        caller.start()
    _wait_for(lambda: sum(r.gateway == "spare" for r in reports) >= 20, 20, "calls answered by the spare gateway")
    _stop(gateway)
    for caller in callers:
        caller.join(60)
    assert gateway.returncode == 0
    assert [r for r in reports if not r.ended_well] == []
    assert {r.gateway for r in reports} == {"spare", "peacock"}
    record = json.loads((tmp_path / "gateway.drain.json").read_text())
    assert (record["drained"], record["cut"]) == (0, 0)
    assert record["completed"] == sum(r.gateway == "spare" for r in reports)


# --- the caller ----------------------------------------------------------------------------------------


def test_a_call_that_every_gateway_refuses_fails_within_its_bound(fleet):
    nowhere = [Gateway("a", f"http://{SPARE}:8081"), Gateway("b", f"http://{SPARE}:8082")]
    report = place_call(nowhere, 1, 4, timeout_s=2.5)
    assert report.gateway is None and not report.done
    assert report.attempts[:2] == [{"gateway": "a", "refusal": "connection refused"},
                                   {"gateway": "b", "refusal": "connection refused"}]
    assert len(report.attempts) >= 4  # it dialled the list again after the wait
    assert report.error.startswith("every gateway refused the call for 2.5 s")


def test_the_callers_command_line_reports_each_call_and_exits_by_what_happened(fleet):
    result = subprocess.run([sys.executable, "-m", "flatshare_ops.sandbox.caller", "--inventory", str(fleet.inventory),
                             "--concurrency", "2", "--calls", "3", "--tokens", "5", "--pause", "0.2", "--json"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    calls = json.loads(result.stdout[result.stdout.index("{"):])["calls"]
    assert [(c["call"], c["gateway"], c["tokens"], c["done"]) for c in calls] == [(n, "cyan", 5, True) for n in (1, 2, 3)]
    refused = subprocess.run([sys.executable, "-m", "flatshare_ops.sandbox.caller", "--gateway", f"http://{SPARE}:8081",
                              "--timeout", "1"], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and "no gateway answered" in refused.stdout
    bad = subprocess.run([sys.executable, "-m", "flatshare_ops.sandbox.caller", "--gateway", f"http://{SPARE}:8081",
                          "--concurrency", "0"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.strip().endswith("--concurrency: must be at least 1, got 0")
    negative = subprocess.run([sys.executable, "-m", "flatshare_ops.sandbox.caller", "--gateway",
                               f"http://{SPARE}:8081", "--pause", "-1"], capture_output=True, text=True, timeout=60)
    assert negative.returncode == 2 and negative.stderr.strip().endswith("--pause: must be at least 0, got -1")
    assert "Traceback" not in bad.stderr + refused.stderr + negative.stderr


def test_a_seats_pause_between_calls_ends_when_the_caller_stops(fleet):
    # One seat, a pause far longer than the test: the stop given as its first call ends ends the pause too,
    # and no second call is placed.
    stop, reports = threading.Event(), []
    seat = threading.Thread(target=lambda: reports.extend(run_calls(
        [Gateway("cyan", f"http://{ADDRESSES['cyan']}:8080")], concurrency=1, duration_s=900, tokens=3,
        timeout_s=30, stop=stop, on_call=lambda _r: stop.set(), pause_s=900)))
    seat.start()
    seat.join(120)
    assert not seat.is_alive(), "the pause did not end when the caller stopped"
    assert [(r.call, r.gateway, r.done) for r in reports] == [(1, "cyan", True)]


def test_spread_seats_start_at_each_gateway_so_both_nodes_take_calls_and_each_fails_over(fleet):
    # A new user's case: make demo's caller dialled cyan first from every seat, peacock (the canary's baseline)
    # had no calls, and the canary analysis could never compare: every later run paused. With --spread, seat k
    # starts at gateway k: both serve, as the gateways' own counts say.
    def completed(name: str) -> int:
        return json.loads(urllib.request.urlopen(f"http://{ADDRESSES[name]}:8080/stats", timeout=5).read())["completed"]

    gateways = [_gateway("cyan"), _gateway("peacock")]
    before = {name: completed(name) for name in ("cyan", "peacock")}
    reports = run_calls(gateways, concurrency=2, calls=8, tokens=2, timeout_s=30, spread=True)
    assert all(r.ended_well for r in reports), [r.line() for r in reports]
    after = {name: completed(name) for name in ("cyan", "peacock")}
    assert after["cyan"] > before["cyan"] and after["peacock"] > before["peacock"], (before, after)
    assert {r.gateway for r in reports} == {"cyan", "peacock"}
    # In order (no spread), every call goes to the first gateway that serves.
    assert {r.gateway for r in run_calls(gateways, concurrency=2, calls=4, tokens=2, timeout_s=30)} == {"cyan"}


def test_the_callers_summary_counts_calls_that_moved_by_their_path():
    """The demo's caller (--brief) says the calls that moved to another gateway as counts in its summary, not a
    line each: counted here from the reports themselves."""
    from flatshare_ops.sandbox.caller import CallReport, summary

    reports = [CallReport(1, 0.0, "peacock", [{"gateway": "cyan", "refusal": "HTTP 503"}], done=True),
               CallReport(2, 0.0, "peacock", [{"gateway": "cyan", "refusal": "connection refused"}], done=True),
               CallReport(3, 0.0, "cyan", [{"gateway": "peacock", "refusal": "HTTP 503"}], done=True),
               CallReport(4, 0.0, "cyan", done=True)]
    line = summary(reports)
    assert "moved to another gateway: 3 (cyan -> peacock 2, peacock -> cyan 1)" in line, line
    assert "moved to another gateway: 0" in summary(reports[3:]), summary(reports[3:])
    # Refused by cyan, then answered by cyan asked again: not a move (a new user read "cyan -> cyan 1").
    back = [CallReport(5, 0.0, "cyan", [{"gateway": "cyan", "refusal": "HTTP 503"}], done=True)]
    line = summary(reports + back)
    assert "moved to another gateway: 3 (cyan -> peacock 2, peacock -> cyan 1); answered by the gateway that " \
           "first refused them: 1" in line, line
