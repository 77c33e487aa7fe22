"""What the node's entry point adds to a node command, in CPU time, against the installed code run directly.

Every node command the operator's side sends (status, history, probe, hold, a switch) goes through
``flatshare-node`` (node/entry.py), which runs the switcher the active release shipped: it checks the kept
switcher's zip that runs against its sha256 and runs the command with it in its own process. The baseline is
the same command run by the installed code (``python -m flatshare_ops.node``), which checks nothing and has
its bytecode cached by Python: the ratio is what running exactly the shipped code costs.

On a scratch state directory (no systemd manager needed): one stored release whose switcher is this checkout's,
kept as a release keeps it, and an empty history. The commands: ``history`` (imports least), and ``hold``
(reads the hold file). Both run N times alternating; the CPU time (user + system) of each is read from
``getrusage(RUSAGE_CHILDREN)``, so the machine's load changes the wall time, not the figures.

Run: .venv/bin/python bench/node_command_cost.py [N]   (N = 20 by default; a few seconds)
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import median

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from cpu_log import run_cpu_s  # noqa: E402  (getrusage of the children around one run)


def _cpu_s(argv: list[str]) -> float:
    done, spent = run_cpu_s(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)}: exit {done.returncode}: {done.stderr.strip()[-300:]}")
    return spent


def main() -> None:
    from flatshare_ops.control.bundle import source, switcher
    from flatshare_ops.node.entry import keep

    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    entry = Path(sys.executable).parent / "flatshare-node"
    with tempfile.TemporaryDirectory(prefix="node-command-cost-") as scratch:
        releases = Path(scratch) / "releases"
        shipped = switcher(source(REPO))
        keep(releases, shipped)
        stored = releases / "0000000000000001"
        stored.mkdir()
        (stored / "switcher").write_text(shipped["sha256"] + "\n")
        os.symlink(stored.name, releases / "current")
        (releases / "history.jsonl").write_text("")
        rows = []
        for command in ("history", "hold"):
            tail = [command, "--node", "cyan", "--state-dir", scratch, "--scope", "user"]
            through_entry, installed = [], []
            _cpu_s([str(entry), *tail])  # the first use of a kept switcher is not what a command costs
            for _ in range(rounds):
                through_entry.append(_cpu_s([str(entry), *tail]))
                installed.append(_cpu_s([sys.executable, "-m", "flatshare_ops.node", *tail]))
            rows.append((command, median(through_entry), median(installed)))
    print(f"node command CPU time (median of {rounds}, user + system):")
    print(f"  {'command':<10} {'flatshare-node':>15} {'installed code':>15} {'ratio':>7}")
    for command, mine, base in rows:
        print(f"  {command:<10} {mine * 1000:>12.1f} ms {base * 1000:>12.1f} ms {mine / base:>6.2f}x")


if __name__ == "__main__":
    main()
