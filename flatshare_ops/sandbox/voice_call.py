"""A call placed at a sandbox node's voice worker, the caller's side (standard library only).

``POST /calls/start?seconds=S&turns=N&tokens=T`` starts it (sandbox/voice.py); ``GET /calls`` says, turn
by turn, what its turn hint (a one-token completion straight to the engine, which the serve module counts)
and its reply (a streamed completion through the gateway) received. ``make demo`` places one on each node
after the release, so that serving-check's ``turns_announced`` counts real turn hints:

    python -m flatshare_ops.sandbox.voice_call --inventory .sandbox/fleet.toml [--turns 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import tomllib
import urllib.error
import urllib.request
from pathlib import Path

from ..common.poll import poll_until
from .node_profile import VOICE_PORT


def place(voice_url: str, seconds: float = 1.0, turns: int = 2, tokens: int = 4, timeout_s: float = 120.0) -> dict:
    """Place one call at the voice worker at ``voice_url`` and wait for it to end.

    Args:
        voice_url: the worker's base URL (``http://HOST:PORT``).
        seconds: how long the call lasts (its turns spread over it), seconds.
        turns: the user turns, each a hint and a reply.
        tokens: each reply's length, tokens.
        timeout_s: how long the call may take to end, seconds.

    Returns:
        The worker's record of the call (``GET /calls``): ``{"call", "ended_at", "turns": [{"hint": {...},
        "reply": {...}}, ...]}``, each hint and reply a completion outcome (common/completions.py).

    Raises:
        RuntimeError: the worker refused the call, did not answer, or the call did not end in ``timeout_s``.
    """
    start = urllib.request.Request(f"{voice_url}/calls/start?seconds={seconds:g}&turns={turns}&tokens={tokens}",
                                   data=b"", method="POST")
    try:
        with urllib.request.urlopen(start, timeout=30) as answer:
            call = json.load(answer)["call"]
    except (OSError, ValueError, KeyError) as err:
        raise RuntimeError(f"the voice worker at {voice_url} took no call: {err}") from None

    def ended() -> dict | None:
        try:
            with urllib.request.urlopen(f"{voice_url}/calls", timeout=30) as answer:
                found = [r for r in json.load(answer)["calls"] if r["call"] == call]
        except (OSError, ValueError, KeyError):
            return None
        return found[0] if found and found[0]["ended_at"] is not None else None

    record = poll_until(ended, timeout_s, interval_s=0.5)
    if record is None:
        raise RuntimeError(f"call {call} at {voice_url} did not end within {timeout_s:g} s")
    return record


def main(argv: list[str] | None = None) -> int:
    """Place one call at each inventory node's voice worker; print a line per call; 0 when every turn's hint
    and reply were answered, else 1."""
    parser = argparse.ArgumentParser(prog="voice_call")
    parser.add_argument("--inventory", type=Path, required=True, help="the sandbox inventory (fleet.toml)")
    parser.add_argument("--turns", type=int, default=2, help="user turns per call (default 2)")
    args = parser.parse_args(argv)
    nodes = tomllib.loads(args.inventory.read_text())["nodes"]
    failed = False
    for name, node in nodes.items():
        url = f"http://{node['host']}:{VOICE_PORT}"
        try:
            record = place(url, turns=args.turns)
        except RuntimeError as err:
            print(f"{name}: {err}")
            failed = True
            continue
        hints = [t["hint"]["status"] for t in record["turns"]]
        replies = [bool(t["reply"]["done"]) for t in record["turns"]]
        ok = all(h == 200 for h in hints) and all(replies)
        failed |= not ok
        print(f"{name}: voice call {record['call']}: {len(record['turns'])} turn(s), hints answered "
              f"{sum(h == 200 for h in hints)}/{len(hints)}, replies ended with [DONE] {sum(replies)}/{len(replies)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
