"""What a release costs, side by side in one run on one sandbox node, against a bare shell script.

The bare script (bench/bare_release.sh) does only what a release must: stop the
gateway, install the units, daemon-reload, restart the engine, wait for
/health, start the gateway. N times, alternating, on the same node:

- `flatshare release --node cyan` over SSH (an engine flag change: the whole
  switch, voice drain included), and the bare script installing the same kind
  of change;
- a monitor samples the node's gateway /health and its voice drain file every
  10 ms: the node "does not take calls" while the gateway does not answer 200
  or the drain file is present.

Prints the medians and the ratios the issues set targets for: with the stand-in
engine, release total (minus the preflight, which runs before the drain) <= 1.5x
the bare script; with vLLM's real engine (``--engine vllm``: the same restarts of
the same real engine), release total <= 1.1x the bare script plus the node's own preflight run once by hand
(in each round, under the same monitor); both: time not taking calls <= the bare script's whole run + 0.3 s.
Each release is of a release the node never ran, so that its switch runs its preflight. Also what shipping the
switcher adds (building the zip, sending it, keeping it on the node), as a share of the release.

Run: .venv/bin/python bench/release_cost.py [N] [--engine vllm|stand-in] [--all]
(stand-in: about 10 s a round; vllm: about 90 s a round and both CPUs; one heavy job at a time).
FLATSHARE_SANDBOX_ADDRESSES=cyan=A,peacock=B picks the loopback addresses.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from conftest import copy_checkout  # noqa: E402
from flatshare_ops.sandbox.fleet import SandboxNode, down, parse_addresses, up  # noqa: E402

ADDRESSES = {"cyan": "127.0.8.2", "peacock": "127.0.8.3"}
BIN = Path(sys.executable).parent


class Monitor:
    """Samples whether the node takes calls every 10 ms; sums the time it does not."""

    def __init__(self, node: SandboxNode) -> None:
        self.node, self.url = node, f"http://{node.address}:8080/health"
        self.down_s, self._stop = 0.0, threading.Event()

    def _serving(self) -> bool:
        if (self.node.run_dir / "voice.drain").exists():
            return False
        try:
            with urllib.request.urlopen(self.url, timeout=0.5) as answer:
                return answer.status == 200
        except OSError:
            return False

    def __enter__(self):
        def run():
            last = time.monotonic()
            while not self._stop.is_set():
                serving = self._serving()
                now = time.monotonic()
                if not serving:
                    self.down_s += now - last
                last = now
                time.sleep(0.01)
        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *_exc) -> None:
        self._stop.set()
        self._thread.join()


#: Each release's output, for whether its switch ran its preflight or reused a kept one.
OUTPUTS: list[str] = []


def timed(argv: list[str], env: dict | None = None) -> float:
    start = time.monotonic()
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, **(env or {})})
    errors: list[str] = []
    reader = threading.Thread(target=lambda: errors.extend(process.stderr), daemon=True)  # type: ignore[arg-type]
    reader.start()
    lines = [f"{time.monotonic() - start:7.2f} {line}" for line in process.stdout]  # type: ignore[union-attr]
    process.wait()
    reader.join()
    elapsed = time.monotonic() - start
    output = "".join(lines)
    if process.returncode != 0:
        raise SystemExit(f"{argv[0]} exited {process.returncode}:\n{output[-2000:]}\n{''.join(errors)[-2000:]}")
    OUTPUTS.append(output)
    return elapsed


def preflight_s(node: SandboxNode) -> float:
    """The preflight's own cost, run once by hand as the node's switch runs it (node/preflight.py ``run``: the
    paths, then vLLM in the engine venv with the engine's environment, as the engine's user) on the release the
    node runs, under the same Monitor as the releases and the bare runs (its polling costs CPU too)."""
    from flatshare_ops.node import preflight

    serving = json.loads((node.state_dir / "releases/current/serving.json").read_text())
    with Monitor(node):
        outcome = preflight.run(serving)
    assert not outcome.problems, outcome.problems
    return outcome.seconds


def shipping_s(checkout: Path, inventory: Path) -> tuple[float, int]:
    """(seconds shipping adds to one release, bytes shipped): zipping the switcher in a new process,
    sending it over SSH, keeping it on the node (its zip that runs compiled there)."""
    code = ("import time, sys; from pathlib import Path; t = time.monotonic(); "
            "from flatshare_ops.control.bundle import source, switcher; "
            f"s = switcher(source(Path({str(checkout)!r}))); print(time.monotonic() - t, len(s['zip_b64']))")
    build, size = map(float, subprocess.check_output([sys.executable, "-c", code], text=True).split())
    from flatshare_ops.control.targets import targets

    (target,) = targets(inventory, ["cyan"], False)
    conn = target.connect()
    try:
        payload = os.urandom(int(size * 3 / 4))
        start = time.monotonic()
        result = conn.run(["sh", "-c", "cat > /dev/null"], stdin=payload, timeout_s=60)
        send = time.monotonic() - start
        start = time.monotonic()
        conn.run(["true"], timeout_s=30)
        send -= time.monotonic() - start  # the command's own round trip is paid anyway
        assert result.status == 0
    finally:
        conn.close()
    from flatshare_ops.control.bundle import source, switcher
    from flatshare_ops.node.entry import keep

    with tempfile.TemporaryDirectory() as scratch:
        start = time.monotonic()
        keep(Path(scratch), switcher(source(checkout)))
        kept = time.monotonic() - start
    return build + max(0.0, send) + kept, int(size)


#: The canary's analysis in the --all rounds: short, and lenient on a loaded machine (one passing measurement of
#: three decides), so that its window is count x interval_s of calls.
FLEET_ANALYSIS = {"interval_s": "5", "count": "3", "min_requests": "1", "failure_limit": "0",
                  "inconclusive_limit": "2", "ttft_p95_max_s": "10", "baseline_factor": "4", "baseline_margin_s": "2.5"}


def _stage(node: SandboxNode, staged: Path, value: str) -> None:
    """The node's engine unit with the other make-room value than ``value``, staged for the bare script."""
    staged.mkdir(parents=True, exist_ok=True)
    engine = (node.manager.unit_dir / "flatshare-engine.service").read_text()
    flag = '"--additional-config.make_room.decode_hold_tokens" '
    other = "48" if f'{flag}"0"' in engine else "0"
    (staged / "flatshare-engine.service").write_text(engine.replace(f'{flag}"{value}"', f'{flag}"{other}"'))


def fleet_rounds(checkout: Path, inventory: Path, nodes: dict[str, SandboxNode], addresses: dict[str, str],
                 runs: int, staged_root: Path) -> tuple[list[float], list[float], float]:
    """``release --all`` of cyan and peacock (cyan the canary, analysed against peacock for FLEET_ANALYSIS's
    window, with golden answers), against the bare script on cyan, the same window waited, the bare script on
    peacock; calls stream through both gateways throughout (the analysis needs them; both sides pay for them).

    Returns:
        (release --all seconds, bare seconds, the window in seconds), one value a round in each list.
    """
    from conftest import calls_through_both

    for key, value in FLEET_ANALYSIS.items():
        subprocess.run([str(BIN / "flatshare"), "profiles", "set", f"release.analysis.{key}", value, "--root",
                        str(checkout)], check=True, capture_output=True)
    window = float(FLEET_ANALYSIS["interval_s"]) * float(FLEET_ANALYSIS["count"])
    # Both nodes on what the checkout renders first (peacock's first release; cyan's engine restarted, since the
    # bare script changed its unit behind its release's back), untimed.
    subprocess.run([str(BIN / "flatshare"), "profiles", "set", "engine.make_room.decode_hold_tokens", "7", "--root",
                    str(checkout)], check=True, capture_output=True)
    timed([str(BIN / "flatshare"), "release", "--all", "--analysis", "skip", "--inventory", str(inventory),
           "--root", str(checkout)])
    fleet_times, bare_times = [], []
    with calls_through_both(addresses, 1, 8, timeout_s=120, join_s=180, pause_s=0.5):
        for i in range(runs):
            value = "0" if i % 2 == 0 else "48"
            subprocess.run([str(BIN / "flatshare"), "profiles", "set", "engine.make_room.decode_hold_tokens",
                            value, "--root", str(checkout)], check=True, capture_output=True)
            fleet_times.append(timed([str(BIN / "flatshare"), "release", "--all", "--inventory", str(inventory),
                                      "--root", str(checkout)]))
            start = time.monotonic()
            for number, name in enumerate(("cyan", "peacock")):
                node = nodes[name]
                _stage(node, staged_root / name, value)
                timed(["bash", str(REPO / "bench/bare_release.sh"), str(staged_root / name), str(node.manager.unit_dir),
                       f"http://{node.address}:8000"], {"XDG_RUNTIME_DIR": str(node.manager.runtime_dir)})
                if number == 0:
                    time.sleep(window)  # the analysis window the release spends on calls
            bare_times.append(time.monotonic() - start)
    return fleet_times, bare_times, window


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="release_cost.py")
    parser.add_argument("runs", nargs="?", type=int, default=5)
    parser.add_argument("--engine", choices=("stand-in", "vllm"), default="stand-in")
    parser.add_argument("--outputs", type=Path, help="write each release's output there, each line with its "
                        "seconds since the release began (where a release's time goes)")
    parser.add_argument("--all", action="store_true",
                        help="also release --all of both nodes with the canary's analysis, against the bare script on "
                             "each node with the analysis window between (issue 34's second target)")
    options = parser.parse_args()
    runs = options.runs
    addresses = parse_addresses(os.environ.get("FLATSHARE_SANDBOX_ADDRESSES")) or ADDRESSES
    with tempfile.TemporaryDirectory(prefix="flatshare-bench-") as scratch:
        root = Path(scratch)
        checkout = copy_checkout(REPO, root / "checkout")
        base = root / "sandbox"
        up(base, checkout / "profiles/rtx-5060-ti-serve.toml", addresses, echo=lambda _l: None, engine=options.engine)
        node = SandboxNode("cyan", addresses["cyan"], base.resolve())
        inventory = base / "fleet.toml"
        release_times, release_down, bare_times, bare_down, preflights = [], [], [], [], []
        try:
            staged = root / "units-next"
            for i in range(runs):
                # A value no release of this run had: each release is a new one, so that its switch runs its
                # preflight (a release switched to again reuses the one it kept: not the case measured here).
                value = str(i + 1)
                subprocess.run([str(BIN / "flatshare"), "profiles", "set", "engine.make_room.decode_hold_tokens",
                                value, "--root", str(checkout)], check=True, capture_output=True)
                with Monitor(node) as monitor:
                    release_times.append(timed([str(BIN / "flatshare"), "release", "--node", "cyan", "--inventory",
                                                str(inventory), "--root", str(checkout)]))
                release_down.append(monitor.down_s)
                # The bare script installs the same kind of change: the engine unit with another value.
                staged.mkdir(exist_ok=True)
                engine = (node.manager.unit_dir / "flatshare-engine.service").read_text()
                flag = '"--additional-config.make_room.decode_hold_tokens" '
                (staged / "flatshare-engine.service").write_text(
                    engine.replace(f'{flag}"{value}"', f'{flag}"{100 + i}"'))
                with Monitor(node) as monitor:
                    bare_times.append(timed(["bash", str(REPO / "bench/bare_release.sh"), str(staged),
                                             str(node.manager.unit_dir), f"http://{node.address}:8000"],
                                            {"XDG_RUNTIME_DIR": str(node.manager.runtime_dir)}))
                bare_down.append(monitor.down_s)
                preflights.append(preflight_s(node))  # in each round: the three side by side
            preflight = statistics.median(preflights)
            ship, size = shipping_s(checkout, inventory)
            fleet = None
            if options.all:
                others = {n: SandboxNode(n, addresses[n], base.resolve()) for n in ("cyan", "peacock")}
                fleet = fleet_rounds(checkout, inventory, others, addresses, runs, root / "fleet-units")
            # Leave the node on its release (the bare script changed its units behind the release's back).
            subprocess.run([str(BIN / "flatshare"), "release", "--node", "cyan", "--inventory", str(inventory),
                            "--root", str(checkout)], capture_output=True)
        finally:
            down(base, echo=lambda _l: None)
    if options.outputs:
        options.outputs.write_text("\n".join(OUTPUTS))
    release, bare = statistics.median(release_times), statistics.median(bare_times)
    down_release, down_bare = statistics.median(release_down), statistics.median(bare_down)
    print(f"medians of {runs} runs on one sandbox node, {options.engine} engine (release over SSH; bare script local)")
    print(f"  release total {release:.2f} s, of which preflight {preflight:.2f} s; bare script {bare:.2f} s")
    if options.engine == "vllm":
        # Issue 34's target: against the bare restarts plus the same preflight run once by hand (a release runs
        # it once, or reuses the one it kept when nothing it checked changed: node/preflight.py).
        print(f"  ratio release / (bare + preflight) = {release / (bare + preflight):.2f}   (target <= 1.1); "
              f"release / bare = {release / bare:.2f}")
    else:
        print(f"  ratio (release - preflight) / bare = {(release - preflight) / bare:.2f}   (target <= 1.5)")
    print(f"  not taking calls: release {down_release:.2f} s, bare script {down_bare:.2f} s; "
          f"release - bare run = {down_release - bare:+.2f} s   (target <= +0.30 s)")
    rounds = ", ".join(f"{r:.2f} s ({'preflight reused' if 'preflight: reused' in out else 'preflight run'})"
                       for r, out in zip(release_times, [o for o in OUTPUTS if "plan for cyan" in o]))
    print(f"  each release: {rounds}; each bare run: {', '.join(f'{b:.2f} s' for b in bare_times)}")
    ran = [r for r, out in zip(release_times, [o for o in OUTPUTS if "plan for cyan" in o])
           if "preflight: reused" not in out]
    if ran and options.engine == "vllm":
        print(f"  the releases that ran their preflight: median {statistics.median(ran):.2f} s, "
              f"{statistics.median(ran) / (bare + preflight):.2f}x (bare + preflight)")
    print(f"  shipping the switcher ({size / 1e6:.2f} MB base64): {ship:.3f} s = {ship / release:.1%} of the release")
    if fleet is not None:
        fleet_times, fleet_bare, window = fleet
        whole, base_all = statistics.median(fleet_times), statistics.median(fleet_bare)
        print(f"release --all of cyan and peacock (cyan the canary, a {window:g} s analysis window), calls streaming:")
        print(f"  release --all {whole:.2f} s; bare script on each node with the window between {base_all:.2f} s, "
              f"plus the preflight once {preflight:.2f} s")
        print(f"  ratio release --all / (bare + window + preflight) = {whole / (base_all + preflight):.2f}   "
              f"(target <= 1.1)")
        print(f"  each release --all: {', '.join(f'{t:.2f} s' for t in fleet_times)}; each bare: "
              f"{', '.join(f'{t:.2f} s' for t in fleet_bare)}")


if __name__ == "__main__":
    main()
