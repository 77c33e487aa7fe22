"""Stand-in for Flatshare's gateway, for the sandbox only.

Speaks the drain interface a release relies on: on SIGTERM it answers new
requests ``503`` with ``Retry-After: 1``, lets requests in flight finish, and
exits at the latest after ``FLATSHARE_DRAIN_TIMEOUT_S`` seconds; requests cut
at the timeout are counted "drained", not "completed" (docs/reference/release-protocol.md#gateway-drain).

``POST /v1/chat?hold=S`` is a request that takes S seconds; ``GET /stats``
reports the counts; ``GET /health`` answers 200 while serving.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

from .http import json_body, serve


class GatewayState:
    """Counts of the stand-in gateway's requests."""

    def __init__(self) -> None:
        self.lock = threading.Condition()
        self.in_flight = 0
        self.completed = 0
        self.refused = 0
        self.draining = False

    def stats(self) -> dict:
        """The counts as a JSON-ready dict."""
        return {"in_flight": self.in_flight, "completed": self.completed, "refused": self.refused,
                "draining": self.draining}


def main(argv: list[str] | None = None) -> None:
    """``gateway [--listen HOST:PORT]`` (default: ``FLATSHARE_GATEWAY_URL``'s); runs until drained after SIGTERM."""
    parser = argparse.ArgumentParser(prog="flatshare-gateway")
    default = os.environ.get("FLATSHARE_GATEWAY_URL", "http://127.0.0.1:8080").removeprefix("http://")
    parser.add_argument("--listen", default=default)
    args = parser.parse_args(argv)
    host, port = args.listen.rsplit(":", 1)
    host = host.strip("[]")
    drain_timeout_s = float(os.environ.get("FLATSHARE_DRAIN_TIMEOUT_S", "20"))
    state = GatewayState()

    def chat(query):
        with state.lock:
            if state.draining:
                state.refused += 1
                return json_body(503, {"error": "draining"}, {"Retry-After": "1"})
            state.in_flight += 1
        time.sleep(float(query.get("hold", ["0"])[0]))
        with state.lock:
            state.in_flight -= 1
            state.completed += 1
            state.lock.notify_all()
        return json_body(200, {"ok": True})

    def health(_q):
        return json_body(503 if state.draining else 200, {"draining": state.draining})

    # SIGTERM is taken with sigwait in the main thread: blocked before any
    # thread starts, so no thread can swallow it and nothing runs in a handler.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    server = serve(host, int(port), {
        ("POST", "/v1/chat"): chat,
        ("GET", "/health"): health,
        ("GET", "/stats"): lambda _q: json_body(200, state.stats()),
    })
    # poll_interval: shutdown() waits up to one interval for the loop to notice (0.5 s by default).
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    print(f"gateway: serving on {host}:{port}", flush=True)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})

    with state.lock:
        state.draining = True
        print(f"gateway: draining, {state.in_flight} in flight, timeout {drain_timeout_s:g} s", flush=True)
        deadline = time.monotonic() + drain_timeout_s
        while state.in_flight and time.monotonic() < deadline:
            state.lock.wait(timeout=max(0.0, deadline - time.monotonic()))
        print(f"gateway: drained: completed {state.completed}, drained {state.in_flight}", flush=True)
    server.shutdown()
    sys.exit(0)


if __name__ == "__main__":
    main()
