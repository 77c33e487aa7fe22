"""What one environment variable of the sandbox's real engine changes in its CPU: a start, and calls, against the
node profile's own environment, in the same run on the same node.

The sandbox's real engine (vLLM 0.32.0's CPU engine) runs beside another engine and the tests' other processes on
2 CPUs, so its environment is chosen for that (docs/reference/vllm.md, "The CPU engine": each override and its
figures). This brings up a real-engine sandbox in a scratch directory (``sandbox up --engine vllm`` and the first
release: a few minutes), then, N rounds, alternating on cyan: the baseline (the profile's environment) and the
candidate (the profile's plus ``VAR=VALUE``, in a drop-in of the engine's unit). Each: the engine restarted, the
CPU of its processes until ``/health`` answers 200 (the start), then CALLS completions of TOKENS tokens, THREADS at
once, straight to the engine (the calls' CPU). With ``--busy`` a busy loop runs beside it the whole time (the
suite's load: the thread an OpenMP region waits for is then often not running). The figures are each process's
user + system time from proc(5), the engine's and its children's: the machine's load changes the wall time, not
them, except through what the engine does while it waits.

Run: .venv/bin/python bench/engine_environment_cost.py VAR=VALUE [N] [--busy]
(N = 2 rounds by default; about 3 minutes to bring the sandbox up, then about 1 minute a round; one heavy job at a
time). FLATSHARE_SANDBOX_ADDRESSES=cyan=A,peacock=B picks the loopback addresses (default 127.0.8.x).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from statistics import median

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from cpu_log import tree_cpu_s  # noqa: E402  (a process and its descendants, from proc(5))
from flatshare_ops.common.systemd import ManagerAddress, connect, daemon_reload, run_job, unit_property  # noqa: E402
from flatshare_ops.sandbox.fleet import SandboxNode, down, parse_addresses, up  # noqa: E402

ENGINE = "flatshare-engine.service"
CALLS, THREADS, TOKENS = 30, 3, 16


def _health(url: str) -> int:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as answer:
            return answer.status
    except OSError:
        return 0


def _round(node: SandboxNode, drop_in: Path, setting: str | None) -> tuple[float, float]:
    """(CPU of a start, CPU of the calls) with ``setting`` (``VAR=VALUE``) in the engine's environment, or none."""
    drop_in.write_text(f"[Service]\nEnvironment={setting}\n" if setting else "[Service]\n")
    address = ManagerAddress("user", node.manager.runtime_dir)
    url = f"http://{node.address}:8000"
    with connect(address) as bus:
        daemon_reload(bus)
        run_job(bus, "restart", ENGINE, 120)
        pid = int(unit_property(bus, ENGINE, "Service", "MainPID"))
    deadline = time.monotonic() + 300
    while _health(url) != 200:
        if time.monotonic() > deadline:
            raise SystemExit(f"{ENGINE} did not answer /health within 300 s ({setting or 'baseline'})")
        time.sleep(0.2)
    started = tree_cpu_s(pid)
    model = json.load(urllib.request.urlopen(url + "/v1/models", timeout=10))["data"][0]["id"]
    body = json.dumps({"model": model, "prompt": "The flat is", "max_tokens": TOKENS, "ignore_eos": True}).encode()
    errors: list[str] = []

    def caller(count: int) -> None:
        for _ in range(count):
            request = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
            try:
                urllib.request.urlopen(request, timeout=120).read()
            except OSError as err:
                errors.append(str(err))

    threads = [threading.Thread(target=caller, args=(CALLS // THREADS,)) for _ in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise SystemExit(f"calls failed ({setting or 'baseline'}): {errors[:3]}")
    return started, tree_cpu_s(pid) - started


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--busy"]
    if not args or "=" not in args[0]:
        raise SystemExit(__doc__.split("Run: ")[1].split("\n")[0])
    setting, rounds = args[0], int(args[1]) if len(args) > 1 else 2
    addresses = parse_addresses(os.environ.get("FLATSHARE_SANDBOX_ADDRESSES") or "cyan=127.0.8.2,peacock=127.0.8.3")
    assert addresses is not None  # given a text, parse_addresses gives its pairs or raises
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if "--busy" in sys.argv else None
    results: dict[str, list[tuple[float, float]]] = {"baseline": [], setting: []}
    with tempfile.TemporaryDirectory(prefix="fs-bench-") as scratch:
        base = Path(scratch) / "sb"
        try:
            up(base, REPO / "profiles/rtx-5060-ti-serve.toml", addresses, echo=lambda _l: None, engine="vllm")
            node = SandboxNode("cyan", addresses["cyan"], base, engine="vllm")
            drop_ins = node.manager.config_dir / "systemd/user" / f"{ENGINE}.d"
            drop_ins.mkdir(parents=True, exist_ok=True)
            for _ in range(rounds):
                for name in results:
                    results[name].append(_round(node, drop_ins / "zz-bench.conf", None if name == "baseline" else name))
        finally:
            if busy is not None:
                busy.kill()
            down(base, echo=lambda _l: None)
    print(f"cyan's real engine, {rounds} rounds{' beside a busy loop' if busy else ''}: CPU of a start, and of "
          f"{CALLS} calls of {TOKENS} tokens {THREADS} at once (medians)")
    start_base, calls_base = (median(r[i] for r in results["baseline"]) for i in (0, 1))
    for name, rows in results.items():
        start, calls = (median(r[i] for r in rows) for i in (0, 1))
        print(f"  {name:30} start {start:6.1f} s ({start / start_base:.2f}x)   calls {calls:6.1f} s "
              f"({calls / calls_base:.2f}x)   each: {', '.join(f'{a:.1f}/{b:.1f}' for a, b in rows)}")


if __name__ == "__main__":
    main()
