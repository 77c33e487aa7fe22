"""Stand-in for the vLLM engine (``vllm serve``), for the sandbox only (standard library only).

Installed as ``bin/vllm`` in a sandbox node's engine venv, beside a
``vllm-0.32.0.dist-info`` metadata directory, and started by the rendered
engine unit exactly as production starts vLLM: ``vllm serve MODEL FLAGS...``.
It speaks the interfaces flatshare-ops and the sandbox's traffic use of the real engine:

- its command line (``/proc/PID/cmdline``), read with the option table of the
  venv's vLLM release (dumped from vLLM's own parser); whatever vLLM rejects is
  refused here too (exit 2, vLLM's message), so a release with a flag vLLM
  rejects crash-loops in the sandbox as it would in production;
- ``GET /health`` (503 while loading, 200 when ready), ``GET /version``
  (``{"version": ...}`` from the venv's installed metadata, or
  ``FLATSHARE_STANDIN_VERSION``), ``GET /v1/models``;
- ``POST /v1/completions`` as vLLM 0.32.0 answers it (:mod:`.completions`): streamed
  (server-sent events, ``data: [DONE]``) or not, ``max_tokens`` tokens, a time to first token
  and a time per token; at most ``--max-num-seqs`` requests run at once, the others wait
  (``vllm:num_requests_waiting``), and the wait counts in their time to first token. A request
  whose ``vllm_xargs`` carries ``flatshare_turn_hint`` is a voice turn hint: counted in
  make-room's ``flatshare:make_room_turns_announced_total`` when it arrives;
- ``GET /metrics``: vLLM's own series, names, labels and buckets (:mod:`.engine_metrics`).

**Behaviour on request** (docs/reference/stand-ins.md#engine-behaviour), for tests that need
chosen metric series exactly and fast. At start, from the unit's environment (a profile's
``[engine.environment]``, so a release can carry it): ``FLATSHARE_STANDIN_TTFT_S``,
``FLATSHARE_STANDIN_TOKEN_S``, ``FLATSHARE_STANDIN_ERROR_SHARE``,
``FLATSHARE_STANDIN_ABORT_SHARE``, ``FLATSHARE_STANDIN_METRICS`` (``vllm``, ``empty``,
``malformed``) and ``FLATSHARE_STANDIN_LOAD_S`` (seconds to get ready, default 1); a bad value
ends the start with exit 2 and one line. While it runs, under ``/flatshare-standin/`` (a path
no vLLM route uses):

- ``GET|POST /flatshare-standin/behaviour``: the behaviour; a POST of a JSON object changes the
  fields it names, all or none (400 and one line otherwise); shares restart their count;
- ``POST /flatshare-standin/observe``: ``{"requests": N, "finished_reason", "ttft_s", "e2e_s",
  "prompt_tokens", "generation_tokens"}`` records N finished requests at once, with exactly those
  values (no request runs): a histogram filled in a millisecond;
- ``POST /flatshare-standin/reset``: every counter and histogram back to zero, as after an
  engine restart (a counter that goes backwards); the gauges and the behaviour stay;
- ``GET /flatshare-standin/requests``: the completion requests seen, in arrival order (``seq``),
  each with its ``request_id``, ``turn_hint``, ``stream``, ``max_tokens``, ``finished_reason``
  (None while it runs) and ``tokens`` produced.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Generator, Iterator

from ..common.completions import COMPLETIONS_PATH
from . import completions as c
from .engine_behaviour import Behaviour, BehaviourError, Outcomes, changed, from_environment
from .engine_metrics import MALFORMED, EngineMetrics
from .http import Request, Streamed, json_body, serve

CONTROL = "/flatshare-standin"
#: How long a request may wait for a seat before it ends in ``error`` (seconds).
MAX_WAIT_S = 600.0
#: How many requests ``/flatshare-standin/requests`` remembers.
REQUEST_LOG = 10000
#: vLLM 0.32.0's ``--max-num-seqs`` default.
DEFAULT_MAX_NUM_SEQS = 256


def parse_serve_args(argv: list[str]) -> dict:
    """Read ``serve MODEL FLAGS...`` as this venv's vLLM release reads it (its option table, dumped
    from the real parser: :mod:`flatshare_ops.common.vllm_argv`); returns the effective values
    (``model`` added).

    Raises:
        SystemExit(2): what vLLM rejects, with vLLM's message on stderr (as ``vllm serve`` does).
    """
    from flatshare_ops.common import vllm_argv

    reading = vllm_argv.read_argv(["serve", *argv[1:]] if argv[:1] == ["serve"] else argv, installed_release())
    if reading.errors:
        print(f"vllm serve: error: {reading.errors[0]}", file=sys.stderr, flush=True)
        sys.exit(2)
    return {**reading.values, "model": reading.model}


def installed_release() -> str:
    """The vLLM release this venv has installed, read from its dist-info METADATA."""
    override = os.environ.get("FLATSHARE_STANDIN_VERSION")
    if override:
        return override
    return _metadata_release()


def _metadata_release() -> str:
    venv = Path(sys.argv[0]).resolve().parent.parent
    for metadata in venv.glob("lib/python*/site-packages/vllm-*.dist-info/METADATA"):
        for line in metadata.read_text().splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
    return "unknown"


class Engine:
    """The stand-in engine while it runs: its behaviour, its seats, its metrics, the requests it saw."""

    def __init__(self, args: dict, behaviour: Behaviour) -> None:
        self.args = args
        self.served_names = list(args.get("served_model_name") or [args["model"]])
        self.ready = False
        self.behaviour = behaviour
        self.outcomes = Outcomes(behaviour.error_share, behaviour.abort_share)
        self.seats = threading.BoundedSemaphore(int(args.get("max_num_seqs") or DEFAULT_MAX_NUM_SEQS))
        self.metrics = EngineMetrics(self.served_names[0], {
            "cache_dtype": str(args.get("kv_cache_dtype") or "auto"),
            "enable_prefix_caching": str(bool(args.get("enable_prefix_caching"))),
            "kv_offloading_size": str(args.get("kv_offloading_size") or "None"),
        })
        self.lock = threading.Lock()
        self.seen: collections.deque[dict] = collections.deque(maxlen=REQUEST_LOG)
        self.sequence = 0

    # --- requests ---------------------------------------------------------------------------------

    def arrive(self, request: c.CompletionRequest) -> dict:
        """Note a request's arrival (a turn hint is counted now, as make-room's scheduler sees it on arrival)."""
        if request.turn_hint:
            self.metrics.turn_announced()
        with self.lock:
            self.sequence += 1
            entry = {"seq": self.sequence, "request_id": request.request_id, "turn_hint": request.turn_hint,
                     "stream": request.stream, "max_tokens": request.max_tokens, "arrived_at": time.time(),
                     "finished_reason": None, "tokens": 0}
            self.seen.append(entry)
        return entry

    def generate(self, request: c.CompletionRequest, entry: dict) -> Generator[tuple[str, str], None, None]:
        """Produce a request's tokens as their time comes: yields ``("token", text)`` for each, then
        ``("end", finish_reason)``. Closed before its end (the client went away), the request
        ends in ``abort``, as vLLM aborts a request whose client disconnected."""
        arrival = time.monotonic()
        reason, produced, first = "abort", 0, None
        self.metrics.move(waiting=1)
        seated = self.seats.acquire(timeout=MAX_WAIT_S)
        self.metrics.move(waiting=-1, running=1 if seated else 0)
        try:
            if not seated:
                reason = "error"
                yield "end", reason
                return
            planned = self.outcomes.next()
            count = request.max_tokens if planned == "length" else request.max_tokens // 2
            time.sleep(self.behaviour.ttft_s)
            for index in range(count):
                if index:
                    time.sleep(self.behaviour.token_s)
                if first is None:
                    first = time.monotonic() - arrival
                produced += 1
                entry["tokens"] = produced
                yield "token", f" w{index}"
            reason = planned
            self._finish(request, entry, reason, first, arrival, produced)
            yield "end", reason
        finally:
            if entry["finished_reason"] is None:  # closed early, or never seated
                self._finish(request, entry, reason, first, arrival, produced)
            if seated:
                self.metrics.move(running=-1)
                self.seats.release()

    def _finish(self, request: c.CompletionRequest, entry: dict, reason: str, first: float | None, arrival: float,
                produced: int) -> None:
        entry["finished_reason"] = reason
        self.metrics.finished(reason, first, time.monotonic() - arrival, request.prompt_tokens, produced)

    def stream(self, request: c.CompletionRequest, entry: dict) -> Iterator[bytes]:
        """The server-sent events of a streamed completion, as vLLM 0.32.0 writes them."""
        created = int(time.time())
        events = self.generate(request, entry)
        try:
            for kind, value in events:
                if kind == "token":
                    last = entry["tokens"] == request.max_tokens
                    yield c.chunk_event(request, created, value, "length" if last else None)
                elif value == "error":
                    yield c.error_event()
                else:
                    if value == "abort":  # the last chunk says why the text stopped short
                        yield c.chunk_event(request, created, "", "abort")
                    if request.include_usage:
                        yield c.usage_event(request, created, entry["tokens"])
            yield c.DONE_EVENT
        finally:
            events.close()

    def complete(self, request: c.CompletionRequest, entry: dict):
        """A completion without ``stream``: one document once it has ended (500 when it ends in ``error``)."""
        created = int(time.time())
        texts, reason = [], "length"
        for kind, value in self.generate(request, entry):
            if kind == "token":
                texts.append(value)
            else:
                reason = value
        if reason == "error":
            return json_body(500, c.error_document("Internal server error", "InternalServerError", 500))
        ids = (c.answer_token_ids(request.prompt, len(texts), self.behaviour.answer_shift)
               if request.return_token_ids else None)
        return json_body(200, c.completion_document(request, created, "".join(texts), reason, len(texts), ids))

    # --- control ----------------------------------------------------------------------------------

    def change(self, document: object) -> Behaviour:
        """Change the behaviour (all the fields given, or none); a change of shares restarts their count.

        Raises:
            BehaviourError: see :func:`.engine_behaviour.changed`.
        """
        if not isinstance(document, dict):
            raise BehaviourError("the behaviour must be a JSON object of fields")
        new = changed(self.behaviour, document)
        if "error_share" in document or "abort_share" in document:
            self.outcomes = Outcomes(new.error_share, new.abort_share)
        self.behaviour = new
        return new

    def observe(self, document: object) -> int:
        """Record finished requests without running them (``/flatshare-standin/observe``); returns how many.

        Raises:
            BehaviourError: a field missing, unknown or out of range.
        """
        if not isinstance(document, dict):
            raise BehaviourError("an observation must be a JSON object")
        fields = {"requests", "finished_reason", "ttft_s", "e2e_s", "prompt_tokens", "generation_tokens"}
        unknown = sorted(set(document) - fields)
        if unknown:
            raise BehaviourError(f"{unknown[0]}: not an observation field; fields: {', '.join(sorted(fields))}")
        requests = document.get("requests")
        if not isinstance(requests, int) or isinstance(requests, bool) or not 1 <= requests <= 1_000_000:
            raise BehaviourError(f"requests: must be a whole number from 1 to 1000000, got {requests!r}")
        numbers: dict[str, Any] = {}  # each a number >= 0 once checked below (ttft_s may be None: no token)
        for name, default in (("ttft_s", None), ("e2e_s", None), ("prompt_tokens", 1), ("generation_tokens", 16)):
            value = document.get(name, default)
            if name == "e2e_s" and value is None:
                raise BehaviourError("e2e_s: required (seconds from arrival to the end)")
            # null is no count (only ttft_s, whose default is None, may be left unobserved)
            if (value is not None or default is not None) and (
                    isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
                raise BehaviourError(f"{name}: must be a number >= 0, got {value!r}")
            numbers[name] = value
        try:
            self.metrics.finished(str(document.get("finished_reason", "length")), numbers["ttft_s"], numbers["e2e_s"],
                                  int(numbers["prompt_tokens"]), int(numbers["generation_tokens"]), requests)
        except ValueError as err:
            raise BehaviourError(str(err)) from None
        return requests

    def requests_seen(self) -> list[dict]:
        """The requests remembered, oldest first (copies)."""
        with self.lock:
            return [dict(entry) for entry in self.seen]


def _refused(err: BehaviourError):
    return json_body(400, {"error": str(err)})


def routes(engine: Engine) -> dict:
    """The stand-in engine's routes: vLLM's, then the control endpoint's."""

    def completions(request: Request):
        if not engine.ready:
            return json_body(503, c.error_document("the engine is loading", "ServiceUnavailableError", 503))
        try:
            completion = c.read_request(request.json(), request.headers.get("X-Request-Id"), engine.served_names)
        except ValueError as err:
            return json_body(400, c.error_document(f"the body is not JSON: {err}", "BadRequestError", 400))
        except c.RequestRefused as refused:
            return json_body(refused.status, refused.document)
        entry = engine.arrive(completion)
        if completion.stream:
            return 200, {"Content-Type": c.EVENT_STREAM}, Streamed(engine.stream(completion, entry))
        return engine.complete(completion, entry)

    def metrics(_request: Request):
        mode = engine.behaviour.metrics
        text = "" if mode == "empty" else MALFORMED if mode == "malformed" else engine.metrics.exposition()
        return 200, {"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}, text.encode()

    def behaviour(request: Request):
        if request.method == "POST":
            try:
                engine.change(request.json())
            except (BehaviourError, ValueError) as err:
                return _refused(BehaviourError(str(err)))
        return json_body(200, engine.behaviour.as_dict())

    def observe(request: Request):
        try:
            return json_body(200, {"recorded": engine.observe(request.json())})
        except (BehaviourError, ValueError) as err:
            return _refused(BehaviourError(str(err)))

    def reset(_request: Request):
        engine.metrics.reset()
        return json_body(200, {"reset": True})

    def models(_request: Request):
        return json_body(200, {"object": "list", "data": [
            {"id": name, "object": "model", "owned_by": "vllm", "root": engine.args["model"], "parent": None}
            for name in engine.served_names]})

    return {
        ("GET", "/health"): lambda _r: json_body(200 if engine.ready else 503, {"ready": engine.ready}),
        ("GET", "/version"): lambda _r: json_body(200, {"version": installed_release()}),
        ("GET", "/metrics"): metrics,
        ("GET", "/v1/models"): models,
        ("POST", COMPLETIONS_PATH): completions,
        ("GET", f"{CONTROL}/behaviour"): behaviour,
        ("POST", f"{CONTROL}/behaviour"): behaviour,
        ("POST", f"{CONTROL}/observe"): observe,
        ("POST", f"{CONTROL}/reset"): reset,
        ("GET", f"{CONTROL}/requests"): lambda _r: json_body(200, {"requests": engine.requests_seen()}),
    }


def _load_s(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 3600:
        raise BehaviourError(f"FLATSHARE_STANDIN_LOAD_S: must be a number of seconds from 0 to 3600, got {text!r}")
    return value


def main(argv: list[str] | None = None) -> None:
    """Run the stand-in engine until SIGTERM (whose default action ends it)."""
    args = parse_serve_args(sys.argv[1:] if argv is None else argv)
    try:
        behaviour = from_environment(os.environ)
        load_s = _load_s(os.environ.get("FLATSHARE_STANDIN_LOAD_S", "1"))
    except BehaviourError as err:
        print(f"stand-in engine: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
    engine = Engine(args, behaviour)
    server = serve(args.get("host") or "127.0.0.1", int(args.get("port") or 8000), routes(engine))
    threading.Timer(load_s, lambda: setattr(engine, "ready", True)).start()
    print(f"stand-in engine: serving {args['model']} on {args.get('host')}:{args.get('port')}, ready in {load_s:g} s; "
          f"behaviour {json.dumps(engine.behaviour.as_dict(), sort_keys=True)}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
