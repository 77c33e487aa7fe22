"""Fleets beyond two nodes: a rollout's strategy (canaries, then batches by count or share, a failure limit) and
``min_serving`` as a share, on a four-node sandbox (stand-in engines, this module's own addresses).

The truth: a monitor samples every gateway's ``GET /health`` and every voice drain file every 20 ms (as the
fleet-safety tests do) and counts the nodes taking calls; each node's history says when its switch ran.
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import BIN, loopback_nodes, scratch_sandbox

from flatshare_ops.sandbox.fleet import SandboxNode

ADDRESSES = loopback_nodes(83, ("n1", "n2", "n3", "n4"))
NODES = tuple(ADDRESSES)


class Fleet:
    def __init__(self, checkout: Path, base: Path) -> None:
        self.checkout, self.base = checkout, base

    def node(self, name: str) -> SandboxNode:
        return SandboxNode(name, ADDRESSES[name], self.base)

    def inventory(self, label: str, top: str, rollout: dict) -> Path:
        """The sandbox's inventory with ``top`` lines (min_serving) and a [rollout] table, beside it."""
        text = (self.base / "fleet.toml").read_text()
        head, _, nodes = text.partition("\n[nodes.")
        body = head + "\n" + top + "\n[rollout]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in rollout.items())
        path = self.base / f"fleet-{label}.toml"
        path.write_text(body + "\n[nodes." + nodes)
        return path

    def release(self, inventory: Path, *args: str) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if k not in ("FLATSHARE_NODE", "FLATSHARE_INVENTORY")}
        return subprocess.run([str(BIN / "flatshare"), "release", "--all", "--analysis", "skip", *args,
                               "--inventory", str(inventory), "--root", str(self.checkout)],
                              capture_output=True, text=True, env=env, timeout=400)

    def history(self, name: str) -> list[dict]:
        path = self.node(name).state_dir / "releases/history.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []

    def new_release(self) -> None:
        text = (self.checkout / "profiles/rtx-5060-ti-serve.toml").read_text()
        now = next(line for line in text.splitlines() if line.startswith("decode_hold_tokens"))
        value = next(v for v in ("48", "0", "16", "7", "9") if now.split("=")[1].split("#")[0].strip() != v)
        result = subprocess.run([str(BIN / "flatshare"), "profiles", "set", "engine.make_room.decode_hold_tokens",
                                 value, "--root", str(self.checkout)], capture_output=True, text=True)
        assert result.returncode == 0, result.stdout + result.stderr

    @contextmanager
    def node_profile(self, name: str, old: str, new: str):
        path = self.node(name).profile
        original = path.read_text()
        assert old in original, f"{path} has no {old!r}"
        path.write_text(original.replace(old, new))
        try:
            yield
        finally:
            path.write_text(original)


class Monitor(threading.Thread):
    """How many nodes take calls (gateway /health 200, no drain file), every 20 ms."""

    def __init__(self, fleet: Fleet) -> None:
        super().__init__(daemon=True)
        self.samples: list[tuple[float, int]]
        self.fleet, self.samples, self._halt = fleet, [], threading.Event()

    def serving(self, name: str) -> bool:
        try:
            conn = http.client.HTTPConnection(ADDRESSES[name], 8080, timeout=1.0)
            conn.request("GET", "/health", headers={"Connection": "close"})
            ok = conn.getresponse().status == 200
            conn.close()
        except OSError:
            return False
        return ok and not (self.fleet.node(name).run_dir / "voice.drain").exists()

    def run(self) -> None:
        while not self._halt.is_set():
            self.samples.append((time.time(), sum(self.serving(n) for n in NODES)))
            self._halt.wait(0.02)

    def stop(self) -> int:
        self._halt.set()
        self.join(10)
        return min(count for _, count in self.samples)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    with scratch_sandbox(tmp_path_factory, "strategy", ADDRESSES, canaries=True) as (_, checkout, base):
        yield Fleet(checkout, base)


def _switch_interval(record: dict) -> tuple[float, float]:
    return record["started_at"], record["finished_at"]


def test_canary_first_then_half_the_fleet_at_once_never_below_min_serving_as_a_share(fleet):
    inventory = fleet.inventory("half", 'min_serving = "50%"', {"canaries": 1, "batch": "50%", "max_failed": 0})
    start = {n: len(fleet.history(n)) for n in NODES}
    fleet.new_release()
    monitor = Monitor(fleet)
    monitor.start()
    result = fleet.release(inventory)
    fewest = monitor.stop()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "batches n1 | n2, n3 | n4 (the first: the canary)" in result.stdout, result.stdout
    switched = {n: fleet.history(n)[start[n]:] for n in NODES}
    assert all([r["result"] for r in switched[n] if r["result"] != "analysed"] == ["released"] for n in NODES), switched
    when = {n: _switch_interval(next(r for r in switched[n] if r["result"] == "released")) for n in NODES}
    # The canary first; n2 and n3 in parallel (their switches overlap); n4 after both.
    assert when["n1"][1] <= min(when["n2"][0], when["n3"][0]), when
    assert when["n2"][0] < when["n3"][1] and when["n3"][0] < when["n2"][1], when
    assert max(when["n2"][1], when["n3"][1]) <= when["n4"][0], when
    # min_serving "50%" of 4 nodes: at least 2 take calls at every sample.
    assert fewest >= 2, [s for s in monitor.samples if s[1] < 2][:10]


@pytest.mark.parametrize("max_failed, n4_switched", [(0, False), (1, True)])
def test_the_rollout_stops_once_more_nodes_failed_than_max_failed(fleet, max_failed, n4_switched):
    inventory = fleet.inventory(f"fail{max_failed}", "min_serving = 1",
                                {"canaries": 1, "batch": 1, "max_failed": max_failed})
    start = {n: len(fleet.history(n)) for n in NODES}
    fleet.new_release()
    # n2's new engine never answers within its start budget: it rolls itself back (exit 9), a failed node.
    with fleet.node_profile("n2", 'FLATSHARE_STANDIN_LOAD_S = "1"', 'FLATSHARE_STANDIN_LOAD_S = "30"'), \
            fleet.node_profile("n2", "start_timeout_s = 60", "start_timeout_s = 4"):
        result = fleet.release(inventory, "--json")
    text = result.stdout + result.stderr
    assert result.returncode == 9, text  # the first failure's own code
    summary = json.loads(result.stdout)  # --json: one document on stdout, people's lines on stderr
    assert summary["code"] == 9 and summary["nodes"]["n2"]["result"] == "rolled back automatically", summary
    results = {n: [r["result"] for r in fleet.history(n)[start[n]:] if r["result"] != "analysed"] for n in NODES}
    assert results["n1"] == ["released"] and results["n2"] == ["failed", "rolled back"], results
    assert results["n4"] == (["released"] if n4_switched else []), (results, text)
    if not n4_switched:
        assert summary["nodes"]["n4"]["result"] == "not started" and summary["nodes"]["n4"]["code"] is None, summary
    fleet.release(inventory)  # every node on the checkout's release again
