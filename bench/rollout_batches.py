"""What a rollout of four nodes in batches of two costs, against one node's release, side by side in one run.

On a four-node sandbox (stand-in engines), N rounds, alternating: ``flatshare release --node n1`` (one node,
a make-room change) and ``flatshare release --all`` of the same kind of change over all four in batches of
two (the inventory's ``[rollout] canaries = 0, batch = 2``; ``min_serving = 2``), the nodes of a batch
switching in parallel, each admitted to drain on its own (adr/0007).

Prints the medians and their ratio; the self-healing issue's target is at most 2.3x (two batches, run in
parallel within each, plus what the admission of a batch adds).

Run: .venv/bin/python bench/rollout_batches.py [N]   (about 25 s a round; one heavy job at a time)
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from conftest import copy_checkout  # noqa: E402
from flatshare_ops.sandbox.fleet import down, up  # noqa: E402

ADDRESSES = {"n1": "127.0.9.2", "n2": "127.0.9.3", "n3": "127.0.9.4", "n4": "127.0.9.5"}
BIN = Path(sys.executable).parent


def _set(checkout: Path, value: int) -> None:
    subprocess.run([str(BIN / "flatshare"), "profiles", "set", "engine.make_room.decode_hold_tokens", str(value),
                    "--root", str(checkout)], check=True, capture_output=True)


def _timed(argv: list[str]) -> float:
    env = {k: v for k, v in os.environ.items() if k not in ("FLATSHARE_NODE", "FLATSHARE_INVENTORY")}
    began = time.monotonic()
    result = subprocess.run(argv, capture_output=True, text=True, env=env)
    took = time.monotonic() - began
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(argv[:3])} exited {result.returncode}:\n{result.stdout}{result.stderr}")
    return took


def main(rounds: int) -> None:
    with tempfile.TemporaryDirectory(prefix="fs-bench-batches-") as scratch:
        checkout = copy_checkout(REPO, Path(scratch) / "checkout")
        base = Path(scratch) / "sandbox"
        up(base, checkout / "profiles/rtx-5060-ti-serve.toml", ADDRESSES, echo=lambda _l: None)
        try:
            text = (base / "fleet.toml").read_text()
            head, _, nodes = text.partition("\n[nodes.")
            inventory = base / "fleet-batches.toml"
            inventory.write_text(head + "\nmin_serving = 2\n\n[rollout]\ncanaries = 0\nbatch = 2\n\n[nodes." + nodes)
            common = ["--inventory", str(inventory), "--root", str(checkout)]
            _set(checkout, 11)
            _timed([str(BIN / "flatshare"), "release", "--all", *common])  # every node on one release first
            one, four = [], []
            value = 12
            for _ in range(rounds):
                value += 1
                _set(checkout, value)
                one.append(_timed([str(BIN / "flatshare"), "release", "--node", "n1", *common]))
                four.append(_timed([str(BIN / "flatshare"), "release", "--all", *common]))  # n2-n4 (n1 is done)
                value += 1
                _set(checkout, value)
                four[-1] = _timed([str(BIN / "flatshare"), "release", "--all", *common])  # all four switch
        finally:
            down(base, echo=lambda _l: None)
    a, b = statistics.median(one), statistics.median(four)
    print(f"one node's release: median {a:.2f} s {sorted(round(x, 2) for x in one)}")
    print(f"four nodes in batches of two: median {b:.2f} s {sorted(round(x, 2) for x in four)}")
    print(f"ratio {b / a:.2f}x (target at most 2.3x)")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
