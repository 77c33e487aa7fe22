"""Stand-in for Flatshare's voice worker, for the sandbox only.

Speaks the drain protocol a release relies on (docs/reference/release-protocol.md#voice-drain):

- ``FLATSHARE_DRAIN_FILE`` appears (its content is the drain id): the worker
  stops taking calls; while calls remain it writes status ``draining``, and
  once they have ended ``drained``;
- the drain file goes away: it takes calls again and writes status ``serving``.

The status file (``FLATSHARE_DRAIN_STATUS``) is JSON written atomically:
``{"schema": 1, "state", "drain_id", "written_at" (Unix seconds), "calls_in_progress"}``.

``FLATSHARE_TURN_HINTS`` (1/0, true/false) decides whether each user turn is
announced to the engine (``POST FLATSHARE_ENGINE_URL/v1/turns``).
``POST /calls/start?seconds=S&turns=N`` on ``--listen`` starts a call; it is
refused (503) while draining. ``GET /status`` returns the current status.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
import urllib.request
from pathlib import Path

from ..common.durable import write_atomic
from .http import json_body, serve

POLL_S = 0.05


def _truthy(value: str) -> bool:
    return value.strip().lower() in {"1", "true", "yes", "on"}


class Worker:
    """The stand-in worker's calls and drain state."""

    def __init__(self, drain_file: Path, status_file: Path, engine_url: str, hints: bool) -> None:
        self.drain_file = drain_file
        self.status_file = status_file
        self.engine_url = engine_url
        self.hints = hints
        self.lock = threading.Lock()
        self.calls = 0
        self.state = "serving"
        self.drain_id: str | None = None

    def status(self) -> dict:
        """The status document (without writing it)."""
        return {"schema": 1, "state": self.state, "drain_id": self.drain_id, "written_at": time.time(),
                "calls_in_progress": self.calls, "turn_hints": self.hints}

    def write_status(self) -> None:
        """Write the status file atomically."""
        self.status_file.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(self.status_file, (json.dumps(self.status()) + "\n").encode())

    def _post_engine(self, path: str) -> None:
        try:
            urllib.request.urlopen(urllib.request.Request(self.engine_url + path, method="POST", data=b""), timeout=2)
        except OSError:
            pass

    def call(self, seconds: float, turns: int) -> None:
        """One call: ``turns`` user turns over ``seconds`` seconds."""
        self._post_engine("/v1/requests/start")
        for _ in range(turns):
            if self.hints:
                self._post_engine("/v1/turns")
            time.sleep(seconds / max(turns, 1))
        self._post_engine("/v1/requests/end")
        with self.lock:
            self.calls -= 1

    def watch_drain(self) -> None:
        """Follow the drain file forever, writing the status on every change."""
        last: tuple | None = None
        while True:
            try:
                drain_id = self.drain_file.read_text().strip() or "unnamed"
            except FileNotFoundError:
                drain_id = None
            with self.lock:
                if drain_id is None:
                    self.state, self.drain_id = "serving", None
                else:
                    self.drain_id = drain_id
                    self.state = "draining" if self.calls else "drained"
                now = (self.state, self.drain_id, self.calls)
            if now != last:
                self.write_status()
                print(f"voice: {self.state} (drain {self.drain_id}, {self.calls} calls)", flush=True)
                last = now
            time.sleep(POLL_S)


def main(argv: list[str] | None = None) -> None:
    """``voice --listen HOST:PORT``; runs until SIGTERM."""
    parser = argparse.ArgumentParser(prog="flatshare-voice")
    parser.add_argument("--listen", default="127.0.0.1:8090")
    args = parser.parse_args(argv)
    host, port = args.listen.rsplit(":", 1)
    worker = Worker(
        drain_file=Path(os.environ["FLATSHARE_DRAIN_FILE"]),
        status_file=Path(os.environ["FLATSHARE_DRAIN_STATUS"]),
        engine_url=os.environ.get("FLATSHARE_ENGINE_URL", "http://127.0.0.1:8000"),
        hints=_truthy(os.environ.get("FLATSHARE_TURN_HINTS", "1")),
    )

    def start_call(query):
        seconds = float(query.get("seconds", ["1"])[0])
        turns = int(query.get("turns", ["1"])[0])
        with worker.lock:
            if worker.state != "serving":
                return json_body(503, {"error": "draining"}, {"Retry-After": "1"})
            worker.calls += 1
        threading.Thread(target=worker.call, args=(seconds, turns), daemon=True).start()
        return json_body(200, {"calls_in_progress": worker.calls})

    server = serve(host, int(port), {
        ("POST", "/calls/start"): start_call,
        ("GET", "/status"): lambda _q: json_body(200, worker.status()),
    })
    threading.Thread(target=worker.watch_drain, daemon=True).start()
    print(f"voice: taking calls on {host}:{port}, turn hints {'on' if worker.hints else 'off'}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
