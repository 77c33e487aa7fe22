"""Cost of one local serving-check run against a shell script doing the same probes.

Brings up its own sandbox fleet (loopback 127.0.9.x) and installs flatshare-ops
as a node does (a regular install from wheels, not the editable dev install,
whose import hook costs a few ms), then alternates, N times:
  - `serving-check --quiet` (a new process, as cron or the timer starts it);
  - `bench/serving_check_baseline.sh`: the same probes as a shell script
    (systemctl show of every property the check reads, UnitPath, /proc/locks,
    /proc/PID/cmdline, curl /health /version /metrics and the gateway's /health, sha256sum of the module
    and units, the drop-in directories, the vLLM metadata).
Prints each one's median wall time and the ratio of the medians. Target: <= 1.3.

Run: .venv/bin/python bench/serving_check.py [N]   (about 10 s; FLATSHARE_SANDBOX_ADDRESSES moves its sandbox)
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from flatshare_ops.sandbox.fleet import SandboxNode, down, parse_addresses, up  # noqa: E402

#: The bench's own sandbox addresses; FLATSHARE_SANDBOX_ADDRESSES (cyan=A,peacock=B) moves them, so that two
#: engineers' runs on one machine never share an address.
ADDRESSES = parse_addresses(os.environ.get("FLATSHARE_SANDBOX_ADDRESSES")) or {"cyan": "127.0.9.2",
                                                                              "peacock": "127.0.9.3"}


def timed(argv: list[str], env: dict) -> float:
    start = time.perf_counter()
    result = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    elapsed = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"{argv[0]} exited {result.returncode}: {result.stderr.decode()[-500:]}")
    return elapsed


def regular_install(directory: Path) -> Path:
    """A venv with flatshare-ops installed as a node installs it (wheels, not editable); returns its bin/."""
    from flatshare_ops.control.wheels import build

    import shutil

    wheels = build(REPO, echo=lambda _l: None)
    try:
        subprocess.run([sys.executable, "-m", "venv", str(directory)], check=True)
        subprocess.run([str(directory / "bin/pip"), "install", "--quiet", "--no-index", "--require-hashes",
                        "--find-links", str(wheels.directory), "-r", str(wheels.directory / "requirements.node.lock")],
                       check=True, env={**os.environ, "PYTHONDONTWRITEBYTECODE": ""})
    finally:
        shutil.rmtree(wheels.directory, ignore_errors=True)
    return directory / "bin"


def main() -> None:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 21
    with tempfile.TemporaryDirectory(prefix="flatshare-bench-") as scratch:
        installed = regular_install(Path(scratch) / "venv")
        base = Path(scratch) / "sandbox"
        up(base, REPO / "profiles/rtx-5060-ti-serve.toml", ADDRESSES, echo=lambda _l: None)
        try:
            node = SandboxNode("cyan", ADDRESSES["cyan"], base.resolve())
            env = {**os.environ, "XDG_RUNTIME_DIR": str(node.manager.runtime_dir)}
            check = [str(installed / "serving-check"), "--quiet",
                     "--state-dir", str(node.state_dir), "--runtime-dir", str(node.manager.runtime_dir)]
            gateway = json.loads((node.state_dir / "releases/current/serving.json").read_text())["gateway"]["url"]
            baseline = ["bash", str(REPO / "bench/serving_check_baseline.sh"), str(node.state_dir),
                        str(node.manager.unit_dir), str(node.venv), f"http://{node.address}:8000", gateway]
            timed(check, env), timed(baseline, env)  # warm the page cache for both
            ours, theirs = [], []
            for _ in range(runs):
                ours.append(timed(check, env))
                theirs.append(timed(baseline, env))
        finally:
            down(base, echo=lambda _l: None)
    a, b = statistics.median(ours), statistics.median(theirs)
    print(f"serving-check median {a * 1000:.1f} ms, shell baseline median {b * 1000:.1f} ms over {runs} runs")
    print(f"ratio serving-check / baseline = {a / b:.2f} (target <= 1.3)")


if __name__ == "__main__":
    main()
