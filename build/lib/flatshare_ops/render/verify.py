"""Check rendered units with ``systemd-analyze verify``, systemd's own unit-file checker.

``systemd-analyze verify`` also checks that each ``Exec*=`` program exists;
the programs live on the nodes, not here, so the units are verified under a
scratch ``--root`` holding an empty executable at each program's path. Any
output at all counts as failure: ``verify`` exits 0 on warnings unless given
``--recursive-errors=no`` (docs/reference/systemd.md#systemd-analyze-verify).
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

from ..errors import FlatshareError

class VerifyError(FlatshareError):
    """``systemd-analyze verify`` printed something about a unit, or is missing."""


def verify_units(units: dict[str, str], programs: list[str]) -> str:
    """Run ``systemd-analyze verify`` on rendered units.

    Args:
        units: unit name -> unit file text.
        programs: absolute paths of the programs the units run (stubbed under the scratch root).

    Returns:
        Everything systemd-analyze printed (stdout and stderr); empty means the units are clean.

    Raises:
        VerifyError: systemd-analyze is not installed.
    """
    tool = shutil.which("systemd-analyze")
    if tool is None:
        raise VerifyError("systemd-analyze not found; install the 'systemd' Debian package")
    with tempfile.TemporaryDirectory(prefix="flatshare-verify-") as scratch:
        root = Path(scratch)
        unit_dir = root / "etc/systemd/system"
        unit_dir.mkdir(parents=True)
        for name, text in units.items():
            (unit_dir / name).write_text(text, encoding="utf-8")
        for program in programs:
            stub = root / program.lstrip("/")
            stub.parent.mkdir(parents=True, exist_ok=True)
            stub.write_text("#!/bin/sh\n")
            stub.chmod(0o755)
        result = subprocess.run(
            [tool, "verify", "--man=no", "--recursive-errors=no", f"--root={root}",
             *[str(unit_dir / name) for name in units]],
            capture_output=True,
            text=True,
            check=False,
        )
    output = (result.stdout + result.stderr).replace(str(unit_dir) + "/", "")
    if result.returncode != 0 and not output:
        output = f"systemd-analyze verify exited {result.returncode}"
    return output
