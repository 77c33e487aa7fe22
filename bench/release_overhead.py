"""The tool's own overhead in a release: total time minus what the services took.

Brings up its own sandbox fleet (loopback 127.0.8.x) from a scratch copy of the
checkout, then N times: toggles decode_hold_tokens (48 <-> 0), runs
`flatshare release --node cyan` (over SSH, as an operator would) and reads,
from systemd's own timestamps (microseconds, org.freedesktop.systemd1(5)), how
long each managed unit took to stop (ActiveExit -> InactiveEnter) and to start
(InactiveExit -> ActiveEnter) within the release. The stand-in engine then
takes FLATSHARE_STANDIN_LOAD_S (1 s) to answer /health, which systemd cannot
see; it is reported apart.

Run: .venv/bin/python bench/release_overhead.py [N]   (about 5 s a release)
"""

from __future__ import annotations

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
from flatshare_ops.sandbox.fleet import SandboxNode, down, up  # noqa: E402
from flatshare_ops.systemd import ManagerAddress, connect, unit_property  # noqa: E402

ADDRESSES = {"cyan": "127.0.8.2", "peacock": "127.0.8.3"}
UNITS = ("flatshare-engine.service", "flatshare-gateway.service", "flatshare-voice.service")
ENGINE_LOAD_S = 1.0  # the sandbox profile's FLATSHARE_STANDIN_LOAD_S
BIN = Path(sys.executable).parent


def service_seconds(address: ManagerAddress, window: tuple[float, float]) -> float:
    """Seconds the managed units spent stopping and starting inside the window (systemd's timestamps)."""
    begin, end = (int(t * 1e6) for t in window)
    total = 0
    with connect(address) as bus:
        for unit in UNITS:
            stamp = {p: unit_property(bus, unit, "Unit", p) for p in
                     ("ActiveExitTimestamp", "InactiveEnterTimestamp", "InactiveExitTimestamp", "ActiveEnterTimestamp")}
            if begin <= stamp["ActiveExitTimestamp"] <= end and stamp["InactiveEnterTimestamp"] >= stamp["ActiveExitTimestamp"]:
                total += stamp["InactiveEnterTimestamp"] - stamp["ActiveExitTimestamp"]
            if begin <= stamp["InactiveExitTimestamp"] <= end and stamp["ActiveEnterTimestamp"] >= stamp["InactiveExitTimestamp"]:
                total += stamp["ActiveEnterTimestamp"] - stamp["InactiveExitTimestamp"]
    return total / 1e6


def main() -> None:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    with tempfile.TemporaryDirectory(prefix="flatshare-bench-") as scratch:
        root = Path(scratch)
        checkout = copy_checkout(REPO, root / "checkout")
        base = root / "sandbox"
        up(base, checkout / "profiles/rtx-5060-ti-serve.toml", ADDRESSES, echo=lambda _l: None)
        address = ManagerAddress("user", SandboxNode("cyan", ADDRESSES["cyan"], base.resolve()).manager.runtime_dir)
        totals, services = [], []
        try:
            for i in range(runs):
                value = "0" if i % 2 == 0 else "48"
                subprocess.run([str(BIN / "flatshare"), "profiles", "set", "engine.make_room.decode_hold_tokens",
                                value, "--root", str(checkout)], check=True, capture_output=True)
                start = time.time()
                result = subprocess.run([str(BIN / "flatshare"), "release", "--node", "cyan", "--inventory",
                                         str(base / "fleet.toml"), "--root", str(checkout)], capture_output=True, text=True)
                end = time.time()
                if result.returncode != 0:
                    raise SystemExit(f"release failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
                totals.append(end - start)
                services.append(service_seconds(address, (start, end)))
        finally:
            down(base, echo=lambda _l: None)
    total, service = statistics.median(totals), statistics.median(services)
    overhead = total - service - ENGINE_LOAD_S
    print(f"release of one node over SSH, median of {runs}: total {total:.2f} s")
    print(f"  units stopping and starting (systemd's timestamps): {service:.2f} s")
    print(f"  stand-in engine loading until /health answers: {ENGINE_LOAD_S:.2f} s")
    print(f"  flatshare-ops' own overhead: {overhead:.2f} s ({overhead / total:.0%} of the release)")
    print("  (including the other node's serving-check over SSH, renders, drift check, journal writes, health polls)")


if __name__ == "__main__":
    main()
