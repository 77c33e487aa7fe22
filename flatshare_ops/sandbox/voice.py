"""Stand-in for Flatshare's voice worker, for the sandbox only (standard library only).

Speaks the drain protocol a release relies on (docs/reference/release-protocol.md#voice-drain):

- ``FLATSHARE_DRAIN_FILE`` appears (its content is the drain id): the worker
  stops taking calls; while calls remain it writes status ``draining``, and
  once they have ended ``drained``;
- the drain file goes away: it takes calls again and writes status ``serving``.

The status file (``FLATSHARE_DRAIN_STATUS``) is JSON written atomically:
``{"schema": 1, "state", "drain_id", "written_at" (Unix seconds), "calls_in_progress"}``.

A call sends real requests (docs/reference/stand-ins.md#traffic). Each user turn first sends the
**turn hint** straight to the engine (``FLATSHARE_ENGINE_URL``): a one-token ``POST
/v1/completions`` with ``"vllm_xargs": {"flatshare_turn_hint": 1}``, unless
``FLATSHARE_TURN_HINTS`` (1/0, true/false) is off; then the turn's reply, a streamed completion
through the node's gateway (``FLATSHARE_GATEWAY_URL``), read to its ``[DONE]``.

``POST /calls/start?seconds=S&turns=N&tokens=T`` on ``--listen`` starts a call of N turns spread
over S seconds, each reply T tokens long (default 16; a turn whose reply takes longer than its
share of S makes the call longer); it answers ``{"call": ID, "calls_in_progress"}``, and 503 while
draining. ``GET /status`` returns the current status; ``GET /calls`` what the recent calls
received, turn by turn (the requests are ``voice-ID-TURN-hint`` and ``voice-ID-TURN-reply``).
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from ..common.durable import write_atomic
from ..common.files import Damaged, read_bytes
from ..common.completions import post_completion, request_body
from .http import Request, json_body, serve

POLL_S = 0.05
#: How long a turn hint or a reply may take before the worker gives up on it (seconds).
REQUEST_TIMEOUT_S = 60.0
#: How many finished calls ``GET /calls`` remembers.
CALL_LOG = 200


def _truthy(value: str) -> bool:
    return value.strip().lower() in {"1", "true", "yes", "on"}


class Worker:
    """The stand-in worker's calls and drain state."""

    def __init__(self, drain_file: Path, status_file: Path, engine_url: str, gateway_url: str, hints: bool) -> None:
        self.drain_file = drain_file
        self.status_file = status_file
        self.engine_url = engine_url
        self.gateway_url = gateway_url
        self.hints = hints
        self.lock = threading.Lock()
        self.calls = 0
        self.state = "serving"
        self.drain_id: str | None = None
        self.ids = itertools.count(1)
        self.records: collections.deque[dict] = collections.deque(maxlen=CALL_LOG)

    def status(self) -> dict:
        """The status document (without writing it)."""
        return {"schema": 1, "state": self.state, "drain_id": self.drain_id, "written_at": time.time(),
                "calls_in_progress": self.calls, "turn_hints": self.hints}

    def write_status(self) -> None:
        """Write the status file atomically."""
        self.status_file.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(self.status_file, (json.dumps(self.status()) + "\n").encode())

    def turn(self, call_id: int, turn: int, tokens: int) -> dict:
        """One user turn: the hint (unless hints are off), then the streamed reply through the gateway."""
        result: dict = {"turn": turn, "hint": None}
        prompt = f"caller turn {turn} of call {call_id}"
        if self.hints:
            hint = post_completion(self.engine_url, request_body(prompt, 1, stream=False, turn_hint=True),
                                   f"voice-{call_id}-{turn}-hint", REQUEST_TIMEOUT_S)
            result["hint"] = {"status": hint.status, "error": hint.error}
        reply = post_completion(self.gateway_url, request_body(prompt, tokens), f"voice-{call_id}-{turn}-reply",
                                REQUEST_TIMEOUT_S)
        result["reply"] = {k: v for k, v in reply.as_dict().items() if k in ("status", "tokens", "done", "error")}
        return result

    def call(self, call_id: int, seconds: float, turns: int, tokens: int) -> None:
        """One call: ``turns`` user turns over ``seconds`` seconds (at least: a turn ends with its reply)."""
        record: dict[str, Any] = {"call": call_id, "started_at": time.time(), "turns": [], "ended_at": None}
        with self.lock:
            self.records.append(record)
        slot_s = seconds / max(turns, 1)
        try:
            for index in range(turns):
                began = time.monotonic()
                record["turns"].append(self.turn(call_id, index + 1, tokens))
                time.sleep(max(0.0, slot_s - (time.monotonic() - began)))
            if not turns:
                time.sleep(seconds)
        finally:
            record["ended_at"] = time.time()
            with self.lock:
                self.calls -= 1

    def watch_drain(self) -> None:
        """Follow the drain file forever, writing the status on every change."""
        last: tuple | None = None
        while True:
            drain_id = self._drain_id()
            with self.lock:
                if drain_id is None:
                    self.state, self.drain_id = "serving", None
                else:
                    self.drain_id = drain_id
                    self.state = "draining" if self.calls else "drained"
                now = (self.state, self.drain_id, self.calls)
            if now != last:
                try:
                    self.write_status()
                except OSError as err:  # a directory or a FIFO where the status belongs: said, tried again
                    print(f"voice: cannot write {self.status_file} ({err.strerror or err})", flush=True)
                    time.sleep(POLL_S)
                    continue
                print(f"voice: {self.state} (drain {self.drain_id}, {self.calls} calls)", flush=True)
                last = now
            time.sleep(POLL_S)

    def _drain_id(self) -> str | None:
        """The drain file's drain id (``unnamed`` when it says none or cannot be read), or None when there is no
        drain file: its presence drains the worker (a link to nothing drains nobody); read without blocking."""
        if not self.drain_file.exists():
            return None
        try:
            text = (read_bytes(self.drain_file, allow_symlink=True) or b"").decode(errors="replace")
        except Damaged:
            return "unnamed"
        return text.strip() or "unnamed"


def _number(query: dict, name: str, default: str, kind: type = float, least: float = 0):
    """A query parameter as a number of at least ``least``; ValueError (one line) otherwise."""
    text = query.get(name, [default])[0]
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or value < least:
        raise ValueError(f"{name}: must be a {'whole ' if kind is int else ''}number >= {least:g}, got {text!r}")
    return value


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
        gateway_url=os.environ.get("FLATSHARE_GATEWAY_URL", "http://127.0.0.1:8080").rstrip("/"),
        hints=_truthy(os.environ.get("FLATSHARE_TURN_HINTS", "1")),
    )

    def start_call(request: Request):
        try:
            seconds = _number(request.query, "seconds", "1")
            turns = _number(request.query, "turns", "1", int)
            tokens = _number(request.query, "tokens", "16", int, least=1)
        except ValueError as err:
            return json_body(400, {"error": str(err)})
        with worker.lock:
            if worker.state != "serving":
                return json_body(503, {"error": "draining"}, {"Retry-After": "1"})
            worker.calls += 1
            call_id = next(worker.ids)
        threading.Thread(target=worker.call, args=(call_id, seconds, turns, tokens), daemon=True).start()
        return json_body(200, {"call": call_id, "calls_in_progress": worker.calls})

    def calls(_request: Request):
        with worker.lock:
            return json_body(200, {"calls": [dict(r, turns=list(r["turns"])) for r in worker.records]})

    server = serve(host, int(port), {
        ("POST", "/calls/start"): start_call,
        ("GET", "/status"): lambda _r: json_body(200, worker.status()),
        ("GET", "/calls"): calls,
    })
    threading.Thread(target=worker.watch_drain, daemon=True).start()
    print(f"voice: taking calls on {host}:{port}, gateway {worker.gateway_url}, "
          f"turn hints {'on' if worker.hints else 'off'}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
