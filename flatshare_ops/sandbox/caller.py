"""A caller for the sandbox: calls through a list of gateways, the way a caller with two numbers dials.

Each call is a streamed completion (``POST /v1/completions``, :mod:`.completions`) sent to the
first gateway of the list; a ``503`` or a refused connection (or one closed before any answer: a
gateway going away) moves it to the next one, and when
every gateway refused, the caller waits the ``Retry-After`` (1 s when none is given) and dials the
list again, until the call's bound. Any other answer is the call's: a stream that breaks is a
dropped call, not retried. The core is standard library only (the tests and ``make demo`` use it);
``--inventory`` reads each node's gateway URL from its profile.

``python -m flatshare_ops.sandbox.caller (--gateway [NAME=]URL ... | --inventory FILE)
[--concurrency N] [--calls K | --for S] [--tokens T] [--timeout S] [--pause S] [--spread] [--json | --brief]``
runs N calls at once (each seat pausing S seconds between its calls; with ``--spread`` seat k dials the list
starting at its k-th gateway), K calls in all (N by default) or new calls for S seconds, and reports per
call which
gateway answered, the tokens received, whether the stream ended with ``[DONE]`` and the time to
first token. SIGTERM or Ctrl-C stops starting calls; the calls in progress finish and are
reported. Exit 0 when every call ended with ``[DONE]`` and no error, 1 otherwise, 2 bad input.
"""

from __future__ import annotations

import argparse
import itertools
import json
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..common.completions import post_completion, request_body

#: The wait before dialling the list again when every gateway refused and none said how long.
DEFAULT_RETRY_S = 1.0


@dataclass(frozen=True)
class Gateway:
    """A gateway a caller can dial: its name (a node's, or the URL) and base URL."""

    name: str
    url: str


@dataclass
class CallReport:
    """One call as the caller lived it.

    Attributes:
        call: the call's number (its requests are ``caller-CALL``).
        gateway: the name of the gateway that answered, None if none did.
        attempts: each refusal before that: ``{"gateway", "refusal"}``, the refusal ``HTTP 503``,
            ``connection refused`` or ``closed before any answer``.
        tokens: tokens received; completion_tokens: the engine's own count (its usage chunk), if sent.
        done: the stream ended with ``data: [DONE]``.
        ttft_s: seconds from dialling the gateway that answered to the first token.
        duration_s: seconds from the first dial to the end of the answer.
        error: what went wrong, in one line; None for a call that ended well.
    """

    call: int
    started_at: float
    gateway: str | None = None
    attempts: list[dict] = field(default_factory=list)
    status: int = 0
    tokens: int = 0
    completion_tokens: int | None = None
    done: bool = False
    finish_reason: str | None = None
    ttft_s: float | None = None
    duration_s: float = 0.0
    error: str | None = None

    @property
    def ended_well(self) -> bool:
        """The stream ended with ``[DONE]`` and nothing went wrong."""
        return self.done and self.error is None

    def line(self) -> str:
        """One line for people."""
        before = _refusals(self.attempts)
        head = f"call {self.call}: " + (f"{self.gateway} answered" if self.gateway else "no gateway answered")
        head += f" (after {before})" if before else ""
        if not self.gateway:
            return f"{head}: {self.error}"
        first = f", first token after {self.ttft_s:.3f} s" if self.ttft_s is not None else ""
        end = "ended with [DONE]" if self.done else "no [DONE]"
        trouble = f"; {self.error}" if self.error else ""
        return f"{head}: {self.tokens} token(s), {end}{first}{trouble}"


def _refusals(attempts: list[dict]) -> str:
    """The refusals a call met, each kind once in the order first met, with its count when more than one:
    25 rounds of both gateways refusing read ``cyan: connection refused x25, peacock: connection refused x25``."""
    counts: dict[tuple[str, str], int] = {}
    for attempt in attempts:
        key = (attempt["gateway"], attempt["refusal"])
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{gateway}: {refusal}" + (f" x{n}" if n > 1 else "") for (gateway, refusal), n in counts.items())


def place_call(gateways: list[Gateway], call: int, tokens: int, timeout_s: float) -> CallReport:
    """One call: dial the gateways in order until one takes it (see the module's docstring).

    Args:
        gateways: in the order the caller dials them.
        call: the call's number.
        tokens: ``max_tokens`` of the call's completion.
        timeout_s: the bound on the whole call, dialling and waiting included (seconds).
    """
    report = CallReport(call=call, started_at=time.time())
    began = time.monotonic()
    deadline = began + timeout_s
    body = request_body(f"a caller's call number {call}", tokens)
    while True:
        wait_s = DEFAULT_RETRY_S
        for gateway in gateways:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            outcome = post_completion(gateway.url, body, f"caller-{call}", remaining)
            if outcome.refused or outcome.unanswered or outcome.status == 503:
                refusal = "connection refused" if outcome.refused else \
                    "closed before any answer" if outcome.unanswered else f"HTTP {outcome.status}"
                report.attempts.append({"gateway": gateway.name, "refusal": refusal})
                if outcome.retry_after_s is not None:
                    wait_s = min(wait_s, outcome.retry_after_s)
                continue
            report.gateway = gateway.name
            for name in ("status", "tokens", "completion_tokens", "done", "finish_reason", "ttft_s", "error"):
                setattr(report, name, getattr(outcome, name))
            report.duration_s = time.monotonic() - began
            return report
        if time.monotonic() + wait_s >= deadline:
            report.error = f"every gateway refused the call for {timeout_s:g} s ({len(report.attempts)} attempt(s))"
            report.duration_s = time.monotonic() - began
            return report
        time.sleep(wait_s)


def run_calls(gateways: list[Gateway], concurrency: int = 1, calls: int | None = None, duration_s: float | None = None,
              tokens: int = 16, timeout_s: float = 60.0, stop: threading.Event | None = None,
              on_call=None, pause_s: float = 0.0, spread: bool = False) -> list[CallReport]:
    """Run ``concurrency`` calls at once: ``calls`` in all (``concurrency`` by default), or, with
    ``duration_s``, new calls until that many seconds have passed; each at most ``timeout_s``.

    ``pause_s`` is each seat's pause after a call ends before it dials the next (seconds; a voice caller's
    turn is followed by a silence): 0 keeps the engines as busy as the seats can make them, which on the
    sandbox's 2 CPUs takes both of them whatever the engine. ``stop`` (set by another thread) ends the
    starting of calls (and a pause); those in progress finish. ``on_call(report)`` is called as each call
    ends. ``spread``: seat k dials the list starting at gateway k (mod their number), so that every gateway
    takes calls while all serve (a canary and its baseline both have calls to measure); otherwise every seat
    dials the list in order. Returns the reports in call order.
    """
    stop = stop or threading.Event()
    numbers = itertools.count(1)
    limit = None if duration_s is not None else (calls if calls is not None else concurrency)
    end = time.monotonic() + duration_s if duration_s is not None else None
    lock = threading.Lock()
    reports: list[CallReport] = []

    def dial(seat: int) -> None:
        order = gateways[seat % len(gateways):] + gateways[:seat % len(gateways)] if spread else gateways
        while not stop.is_set() and (end is None or time.monotonic() < end):
            with lock:
                number = next(numbers)
            if limit is not None and number > limit:
                return
            report = place_call(order, number, tokens, timeout_s)
            with lock:
                reports.append(report)
            if on_call is not None:
                on_call(report)
            if pause_s > 0 and stop.wait(pause_s):
                return

    threads = [threading.Thread(target=dial, args=(seat,), daemon=True) for seat in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        while thread.is_alive():
            thread.join(0.1)  # short joins: the main thread stays free for signals
    return sorted(reports, key=lambda r: r.call)


def summary(reports: list[CallReport]) -> str:
    """One line: calls, how many ended well, which gateway answered how many."""
    by_gateway: dict[str, int] = {}
    for report in reports:
        by_gateway[report.gateway or "none"] = by_gateway.get(report.gateway or "none", 0) + 1
    answered = ", ".join(f"{name} {count}" for name, count in sorted(by_gateway.items()))
    well = sum(r.ended_well for r in reports)
    moved: dict[tuple[str, str], int] = {}
    again = 0  # refused, then answered by the gateway that refused them (asked again after its Retry-After)
    for report in reports:
        if report.attempts and report.gateway:
            path = (report.attempts[0]["gateway"], report.gateway)
            if path[0] == path[1]:
                again += 1
            else:
                moved[path] = moved.get(path, 0) + 1
    paths = ", ".join(f"{a} -> {b} {count}" for (a, b), count in sorted(moved.items()))
    return (f"calls: {len(reports)}, ended with [DONE] and no error: {well}; answered by: {answered or 'none'}; "
            f"moved to another gateway: {sum(moved.values())}" + (f" ({paths})" if paths else "")
            + (f"; answered by the gateway that first refused them: {again}" if again else ""))


def inventory_gateways(path: Path) -> list[Gateway]:
    """Each node's gateway (its profile's ``gateway.url``), in inventory order.

    Raises:
        ProfileError: the inventory or a profile does not load (one line).
    """
    from ..config.inventory import load_inventory, node_profile_path
    from ..config.profile import load_profile

    inventory = load_inventory(path)
    return [Gateway(name, str(load_profile(node_profile_path(path, node)).profile.gateway.url).rstrip("/"))
            for name, node in inventory.nodes.items()]


def _gateway(text: str) -> Gateway:
    name, _, url = text.rpartition("=") if "=" in text.split("//")[0] else ("", "", text)
    if not url.startswith("http://"):
        raise argparse.ArgumentTypeError(f"{text!r} is not [NAME=]http://HOST:PORT")
    return Gateway(name or url, url.rstrip("/"))


def main(argv: list[str] | None = None) -> int:
    """The caller's command line (the module's docstring); returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m flatshare_ops.sandbox.caller",
                                     description="Calls through gateways, failing over on 503 or a refused connection.")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--gateway", action="append", type=_gateway, help="[NAME=]URL, in dialling order (repeat)")
    where.add_argument("--inventory", type=Path, help="dial each node's gateway, in inventory order")
    how_many = parser.add_mutually_exclusive_group()
    how_many.add_argument("--calls", type=int, help="calls in all (default: --concurrency)")
    how_many.add_argument("--for", dest="duration_s", type=float, help="start new calls for this many seconds")
    parser.add_argument("--concurrency", type=int, default=1, help="calls at once (default 1)")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per call (default 16)")
    parser.add_argument("--timeout", type=float, default=60.0, help="bound on each call, seconds (default 60)")
    parser.add_argument("--pause", dest="pause_s", type=float, default=0.0,
                        help="each seat's pause between its calls, seconds (default 0)")
    parser.add_argument("--spread", action="store_true",
                        help="seat k dials the gateways starting at the k-th, so that every one takes calls")
    output = parser.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="the reports as one JSON document")
    output.add_argument("--brief", action="store_true",
                        help="a line only for calls that did not end well, then the summary (which counts the "
                             "calls that moved to another gateway)")
    args = parser.parse_args(argv)
    for name, value, least in (("--concurrency", args.concurrency, 1), ("--tokens", args.tokens, 1),
                               ("--calls", args.calls, 1), ("--for", args.duration_s, 0), ("--timeout", args.timeout, 1),
                               ("--pause", args.pause_s, 0)):
        if value is not None and value < least:
            parser.error(f"{name}: must be at least {least}, got {value:g}")
    if args.inventory:
        from ..errors import FlatshareError

        try:
            gateways = inventory_gateways(args.inventory)
        except FlatshareError as err:
            print(f"caller: {err}", file=sys.stderr)
            return 2
    else:
        gateways = args.gateway
    stop = threading.Event()
    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, lambda *_: stop.set())
    print(f"caller: {args.concurrency} call(s) at once through {', '.join(g.name for g in gateways)}"
          + (" (spread: each seat starts at another gateway)" if args.spread else ""), flush=True)
    def said(report: CallReport) -> None:
        if not args.brief or not report.ended_well:
            print(f"  {report.line()}", flush=True)

    reports = run_calls(gateways, args.concurrency, args.calls, args.duration_s, args.tokens, args.timeout, stop,
                        on_call=None if args.json else said, pause_s=args.pause_s, spread=args.spread)
    if args.json:
        print(json.dumps({"calls": [asdict(r) for r in reports]}, indent=2))
    else:
        print(f"caller: {summary(reports)}", flush=True)
    return 0 if reports and all(r.ended_well for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
