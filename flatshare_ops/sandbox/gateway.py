"""Stand-in for Flatshare's gateway, for the sandbox only (standard library only).

It listens where ``FLATSHARE_GATEWAY_URL`` says (``--listen HOST:PORT`` overrides) and forwards
calls to its engine (``FLATSHARE_ENGINE_URL``):

- ``POST /v1/completions``: passed to the engine as it came (body and ``X-Request-Id``); a
  streamed answer is sent back event by event as the engine produces it (a call's turn is a
  streamed completion, docs/reference/stand-ins.md#traffic); an engine that does not answer is
  ``502``;
- ``POST /v1/chat?hold=S``: a request that takes S seconds and reaches no engine (the drain
  tests' request of a known length);
- ``GET /stats``: the counts (``in_flight``, ``completed``, ``refused``, ``failed``, ``cut``,
  ``draining``); ``GET /health``: 200 while serving, 503 while draining.

It speaks the drain interface a release relies on: on SIGTERM it answers new requests ``503``
with ``Retry-After: 1``, lets requests in flight finish (a stream to its ``[DONE]``), and exits
at the latest after ``FLATSHARE_DRAIN_TIMEOUT_S`` seconds; requests cut at the timeout are
counted "drained", not "completed" (docs/reference/release-protocol.md#gateway-drain). At the
drain's end it answers the connections already queued (503) and closes its listening socket, so a
later connection is refused rather than reset, then writes its counts to
``FLATSHARE_RUN_DIR/gateway.drain.json`` (atomically;
``{"schema": 1, "completed", "refused", "failed", "cut", "drained", "began_at", "ended_at"}``,
Unix seconds), the record of what the drain let finish.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import cast
from urllib.parse import urlsplit

from ..common.durable import write_atomic
from ..common.completions import COMPLETIONS_PATH
from .completions import error_document
from .http import Request, Streamed, json_body, serve

#: How long the gateway waits for the engine to say anything (connect, answer, next event), seconds.
UPSTREAM_SILENCE_S = 30.0
DRAIN_RECORD = "gateway.drain.json"
#: How long, once drained, the gateway waits for its answers to the connections still open (seconds).
CLOSE_S = 2.0


class GatewayState:
    """Counts of the stand-in gateway's requests.

    ``completed``: answered to their end (a stream to its ``[DONE]``); ``refused``: 503 while
    draining; ``failed``: the engine did not answer (502); ``cut``: a stream that ended before its
    ``[DONE]`` (the engine's stream broke, or the caller went away).
    """

    def __init__(self) -> None:
        self.lock = threading.Condition()
        self.in_flight = 0
        self.completed = 0
        self.refused = 0
        self.failed = 0
        self.cut = 0
        self.draining = False

    def stats(self) -> dict:
        """The counts as a JSON-ready dict."""
        return {"in_flight": self.in_flight, "completed": self.completed, "refused": self.refused,
                "failed": self.failed, "cut": self.cut, "draining": self.draining}

    def admit(self) -> bool:
        """Take a new request in flight, unless draining (then it is counted refused)."""
        with self.lock:
            if self.draining:
                self.refused += 1
                return False
            self.in_flight += 1
            return True

    def end(self, outcome: str) -> None:
        """A request in flight ended: ``completed``, ``failed`` or ``cut``."""
        with self.lock:
            self.in_flight -= 1
            setattr(self, outcome, getattr(self, outcome) + 1)
            self.lock.notify_all()


def _draining():
    return json_body(503, error_document("the gateway is draining; call the other number", "ServiceUnavailableError",
                                         503), {"Retry-After": "1"})


def forward_completion(state: GatewayState, engine_url: str, request: Request):
    """``POST /v1/completions``: forward to the engine; stream its events back as they come."""
    if not state.admit():
        return _draining()
    url = urlsplit(engine_url)
    # engine_url is the engine's http://HOST:PORT (the sandbox writes it): it has a host.
    upstream = http.client.HTTPConnection(cast(str, url.hostname), url.port or 80, timeout=UPSTREAM_SILENCE_S)
    headers = {"Content-Type": "application/json"}
    if request.headers.get("X-Request-Id"):
        headers["X-Request-Id"] = request.headers["X-Request-Id"]
    try:
        upstream.request("POST", COMPLETIONS_PATH, request.body, headers)
        response = upstream.getresponse()
        content_type = response.getheader("Content-Type") or "application/json"
        if response.status != 200 or not content_type.startswith("text/event-stream"):
            body = response.read()
            upstream.close()
            state.end("completed")
            return response.status, {"Content-Type": content_type}, body
    except (OSError, http.client.HTTPException) as err:
        upstream.close()
        state.end("failed")
        return json_body(502, error_document(f"the engine at {engine_url} did not answer: {err or type(err).__name__}",
                                             "BadGatewayError", 502))
    seen = {"done": False}

    def events():
        """Each event as one chunk, as soon as its blank line arrives."""
        event = b""
        while True:
            line = response.readline()
            if not line:
                break
            event += line
            if line in (b"\n", b"\r\n"):
                seen["done"] = seen["done"] or event.strip() == b"data: [DONE]"
                yield event
                event = b""
        if event:
            yield event

    def close(complete: bool) -> None:
        upstream.close()
        state.end("completed" if complete and seen["done"] else "cut")

    return 200, {"Content-Type": content_type}, Streamed(events(), on_close=close)


def write_drain_record(run_dir: Path, state: GatewayState, began_at: float) -> None:
    """Write ``gateway.drain.json`` (atomically) with the counts at the drain's end."""
    record = {"schema": 1, **{k: v for k, v in state.stats().items() if k not in ("in_flight", "draining")},
              "drained": state.in_flight, "began_at": began_at, "ended_at": time.time()}
    run_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(run_dir / DRAIN_RECORD, (json.dumps(record) + "\n").encode())


def main(argv: list[str] | None = None) -> None:
    """``gateway [--listen HOST:PORT]`` (default: ``FLATSHARE_GATEWAY_URL``'s); runs until drained after SIGTERM."""
    parser = argparse.ArgumentParser(prog="flatshare-gateway")
    default = os.environ.get("FLATSHARE_GATEWAY_URL", "http://127.0.0.1:8080").removeprefix("http://").rstrip("/")
    parser.add_argument("--listen", default=default)
    args = parser.parse_args(argv)
    host, port = args.listen.rsplit(":", 1)
    host = host.strip("[]")
    drain_timeout_s = float(os.environ.get("FLATSHARE_DRAIN_TIMEOUT_S", "20"))
    engine_url = os.environ.get("FLATSHARE_ENGINE_URL", "http://127.0.0.1:8000")
    run_dir = os.environ.get("FLATSHARE_RUN_DIR")
    state = GatewayState()

    def chat(request: Request):
        if not state.admit():
            return _draining()
        time.sleep(float(request.query.get("hold", ["0"])[0]))
        state.end("completed")
        return json_body(200, {"ok": True})

    def health(_request: Request):
        return json_body(503 if state.draining else 200, {"draining": state.draining})

    # SIGTERM is taken with sigwait in the main thread: blocked before any
    # thread starts, so no thread can swallow it and nothing runs in a handler.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    server = serve(host, int(port), {
        ("POST", COMPLETIONS_PATH): lambda request: forward_completion(state, engine_url, request),
        ("POST", "/v1/chat"): chat,
        ("GET", "/health"): health,
        ("GET", "/stats"): lambda _r: json_body(200, state.stats()),
    })
    # poll_interval: shutdown() waits up to one interval for the loop to notice (0.5 s by default).
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    print(f"gateway: serving on {host}:{port}, engine {engine_url}", flush=True)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})

    began_at = time.time()
    with state.lock:
        state.draining = True
        print(f"gateway: draining, {state.in_flight} in flight, timeout {drain_timeout_s:g} s", flush=True)
        deadline = time.monotonic() + drain_timeout_s
        while state.in_flight and time.monotonic() < deadline:
            state.lock.wait(timeout=max(0.0, deadline - time.monotonic()))
    # A connection made as the drain ended is answered (503), never reset; one after is refused.
    server.close_gracefully(CLOSE_S)
    with state.lock:
        print(f"gateway: drained: completed {state.completed}, drained {state.in_flight}", flush=True)
        if run_dir:
            write_drain_record(Path(run_dir), state, began_at)
    sys.exit(0)


if __name__ == "__main__":
    main()
