"""Stand-in for the vLLM engine (``vllm serve``), for the sandbox only.

Installed as ``bin/vllm`` in a sandbox node's engine venv, beside a
``vllm-0.32.0.dist-info`` metadata directory, and started by the rendered
engine unit exactly as production starts vLLM: ``vllm serve MODEL FLAGS...``.
It speaks the interfaces flatshare-ops reads from the real engine:

- its command line (``/proc/PID/cmdline``), read with the option table of the
  venv's vLLM release (dumped from vLLM's own parser); whatever vLLM rejects is
  refused here too (exit 2, vLLM's message), so a release with a flag vLLM
  rejects crash-loops in the sandbox as it would in production;
- ``GET /health`` (503 while loading, 200 when ready), ``GET /version``
  (``{"version": ...}`` from the venv's installed metadata, or
  ``FLATSHARE_STANDIN_VERSION``), ``GET /metrics`` (Prometheus text with
  ``vllm:num_requests_running``, ``vllm:cache_config_info`` and make-room's
  ``flatshare:make_room_turns_announced_total``);
- ``POST /v1/turns`` (the voice worker's turn hint) and ``POST /v1/requests/start``
  / ``POST /v1/requests/end`` to move the running-requests gauge.

``FLATSHARE_STANDIN_LOAD_S`` (seconds, default 1) is how long it takes to get ready.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

from .http import json_body, serve

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


class EngineState:
    """What the stand-in engine counts while it runs."""

    def __init__(self, args: dict) -> None:
        self.args = args
        self.ready = False
        self.running = 0
        self.turns = 0
        self.lock = threading.Lock()

    def metrics(self) -> str:
        """Prometheus text exposition of the stand-in's gauges and counters."""
        a = self.args
        labels = (
            f'cache_dtype="{a.get("kv_cache_dtype") or "auto"}",'
            f'enable_prefix_caching="{bool(a.get("enable_prefix_caching"))}",'
            f'kv_offloading_size="{a.get("kv_offloading_size") or "None"}"'
        )
        name = (a.get("served_model_name") or [a.get("model")])[0]
        return (
            "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
            "# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{model_name="{name}"}} {self.running}\n'
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
            "# TYPE vllm:cache_config_info gauge\n"
            f"vllm:cache_config_info{{{labels}}} 1.0\n"
            "# HELP flatshare:make_room_turns_announced_total Voice turns announced to make-room.\n"
            "# TYPE flatshare:make_room_turns_announced_total counter\n"
            f"flatshare:make_room_turns_announced_total {self.turns}\n"
        )


def main(argv: list[str] | None = None) -> None:
    """Run the stand-in engine until SIGTERM (whose default action ends it)."""
    args = parse_serve_args(sys.argv[1:] if argv is None else argv)
    state = EngineState(args)

    def health(_q):
        return json_body(200 if state.ready else 503, {"ready": state.ready})

    def change(delta: int, field: str):
        def handler(_q):
            with state.lock:
                setattr(state, field, max(0, getattr(state, field) + delta))
            return json_body(200, {field: getattr(state, field)})
        return handler

    routes = {
        ("GET", "/health"): health,
        ("GET", "/version"): lambda _q: json_body(200, {"version": installed_release()}),
        ("GET", "/metrics"): lambda _q: (200, {"Content-Type": "text/plain; version=0.0.4"}, state.metrics().encode()),
        ("POST", "/v1/turns"): change(1, "turns"),
        ("POST", "/v1/requests/start"): change(1, "running"),
        ("POST", "/v1/requests/end"): change(-1, "running"),
    }
    server = serve(args.get("host") or "127.0.0.1", int(args.get("port") or 8000), routes)
    load_s = float(os.environ.get("FLATSHARE_STANDIN_LOAD_S", "1"))
    threading.Timer(load_s, lambda: setattr(state, "ready", True)).start()
    print(f"stand-in engine: serving {args['model']} on {args.get('host')}:{args.get('port')}, ready in {load_s:g} s",
          flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
