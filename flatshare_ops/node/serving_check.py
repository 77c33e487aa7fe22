"""The release's serving-check: serving-check, the program a node's timer runs, run by the switch on the new release.

The switch does not import serving-check's code (node/ and check/ depend on nothing of each other's): it runs
the same code the release shipped (this switcher's own ``flatshare_ops``, with the node venv's interpreter) as
a program, with ``--json --inside-release``, and reads its report back as data (common/serving_report.py
``Report.from_json``). A run that gives no report is UNKNOWN, with its exit status.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ..common.serving_report import UNKNOWN, Finding, Report
from ..common.text import clip_tail, one_line
from .context import NodeContext

#: serving-check's own bound inside a release (seconds: ``--deadline``); the process is given a little more.
DEADLINE_S = 50.0
#: Runs serving-check from the directory holding this switcher's ``flatshare_ops`` (argv[1]), without bytecode.
BOOT = ("import sys; sys.path.insert(0, sys.argv[1]); sys.argv = ['serving-check'] + sys.argv[2:]; "
        "from flatshare_ops.check.cli import main; main()")


def run_serving_check(ctx: NodeContext) -> Report:
    """serving-check's report on the node's active release, as the release's serving-check step sees it.

    Returns:
        the report (its findings and their worst status, :attr:`Report.status`); a run that printed no
        report is one UNKNOWN finding naming its exit status and its last output.

    Never raises for what serving-check does; an interrupt (SIGTERM's, Ctrl-C's exception) ends the run's
    process before it goes on.
    """
    code = Path(__file__).resolve().parents[2]  # the directory holding this switcher's flatshare_ops/
    argv = [sys.executable, "-B", "-c", BOOT, str(code), "--json", "--inside-release", "--deadline", f"{DEADLINE_S:g}",
            "--state-dir", str(ctx.state_dir), "--node-name", ctx.node]
    if ctx.address.runtime_dir is not None:
        argv += ["--runtime-dir", str(ctx.address.runtime_dir)]
    process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        output, _ = process.communicate(timeout=DEADLINE_S + 10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        return _unknown(f"serving-check gave no report within {DEADLINE_S + 10:g} s (killed)")
    finally:
        if process.poll() is None:  # an interrupt while it ran
            process.kill()
            process.wait()
    try:
        return Report.from_json(json.loads(output))
    except (ValueError, KeyError, TypeError):
        said = clip_tail(output.decode("utf-8", errors="replace").strip(), 300)
        return _unknown(f"serving-check gave no report (exit {process.returncode}): {one_line(said) or 'no output'}")


def _unknown(summary: str) -> Report:
    return Report("", [Finding("serving_check", UNKNOWN, summary)])
