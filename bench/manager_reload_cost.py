"""What a sandbox node's systemd user manager spends on a start and daemon-reloads, with its generators and without.

A switch runs a daemon-reload, and the sandbox starts a manager per node per fleet; a user manager runs its
generators (gpg-agent's environment, XDG autostart...) at its start and at every reload. ``sandbox up`` starts
its managers with none (sandbox/manager.py ``start_manager``; docs/reference/systemd.md, "Generators"). The
baseline, in the same run: a manager started the same way whose generator paths end with an empty component,
which systemd reads as "and then the usual directories" (systemd(1)), so this machine's generators run.

The figure is the manager's CPU time with that of its reaped children (the generators), from /proc/PID/stat,
after its start and N reloads: the machine's load changes the wall time, not the figures.

Run: .venv/bin/python bench/manager_reload_cost.py [N]   (N = 10 reloads by default; a few seconds; as root)
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _cpu_s(pid: int) -> float:
    """user + system time of ``pid`` and of its children it has reaped (seconds; proc(5), fields 14-17)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:15]) / 100


def measure(base: Path, name: str, reloads: int, generators: bool) -> float:
    from flatshare_ops.common.systemd import ManagerAddress, reload
    from flatshare_ops.sandbox.manager import ManagerDirs, start_manager, stop_manager

    dirs = ManagerDirs(name, base / name / "run", base / name / "config", base / name / "log")
    extra = {}
    if generators:  # the usual directories after an empty one: what a manager without the variables runs
        usual = str(base / name / "none") + ":"
        (base / name / "none").mkdir(parents=True, exist_ok=True)
        extra = {"SYSTEMD_GENERATOR_PATH": usual, "SYSTEMD_ENVIRONMENT_GENERATOR_PATH": usual}
    pid = start_manager(dirs, extra)
    try:
        for _ in range(reloads):
            reload(ManagerAddress("user", dirs.runtime_dir))
        return _cpu_s(pid)
    finally:
        stop_manager(dirs.name, pid)


def main() -> None:
    reloads = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    with tempfile.TemporaryDirectory(prefix="flatshare-bench-") as scratch:
        base = Path(scratch)
        with_generators = measure(base, "bench-generators", reloads, True)
        without = measure(base, "bench-none", reloads, False)
    print(f"a manager's start and {reloads} daemon-reloads, CPU (its own and its generators'):")
    print(f"  with this machine's generators (baseline): {with_generators:.2f} s")
    print(f"  without (as sandbox up starts them):       {without:.2f} s  ({without / with_generators:.2f}x)")


if __name__ == "__main__":
    main()
