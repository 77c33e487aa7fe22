"""The release's serving-check: serving-check, the program a node's timer runs, run by the switch on the new release.

The switch does not import serving-check's code (node/ and check/ depend on nothing of each other's): it runs
serving-check as a program, with ``--json --inside-release``, and reads its report back as data
(common/serving_report.py ``Report.from_json``). First the copy the release shipped (this switcher's own
``flatshare_ops``, with the node venv's interpreter); when that gives no report (it printed nothing, or no
report, or hung), the node's installed serving-check, the one its timer runs (``python -I``: the venv's own
packages only). When neither gives a report, :class:`NoReport` says why: that is serving-check's own trouble,
no verdict on the engine.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

from ..common.files import loads
from ..common.poll import poll_until
from ..common.serving_report import Report
from ..common.text import clip_tail, one_line
from ..errors import FlatshareError
from .context import NodeContext

#: serving-check's own bound inside a release (seconds: ``--deadline``); the process is given a little more.
DEADLINE_S = 50.0
#: The most of a report that is read (bytes): a node's report is a few KB.
MAX_REPORT_BYTES = 1 << 20
#: Runs serving-check from the directory holding this switcher's ``flatshare_ops`` (argv[1]).
SHIPPED = ("import sys; sys.path.insert(0, sys.argv[1]); sys.argv = ['serving-check'] + sys.argv[2:]; "
           "from flatshare_ops.check.cli import main; main()")
#: Runs the node venv's installed serving-check (with ``-I``: nothing but the venv's own packages).
INSTALLED = "import sys; sys.argv = ['serving-check'] + sys.argv[1:]; from flatshare_ops.check.cli import main; main()"


class NoReport(FlatshareError):
    """Neither serving-check gave a report: the check's own trouble (the message says each one's), not a verdict."""


def run_serving_check(ctx: NodeContext, progress: Callable[[float], None] | None = None,
                      note: Callable[[str], None] | None = None, code: Path | None = None) -> Report:
    """serving-check's report on the node's active release, as the release's serving-check step sees it.

    Args:
        progress: called with the seconds waited, at the process's progress cadence (common/poll.py), while
            serving-check runs.
        note: told, in one line, when the shipped serving-check gave no report and the installed one checked.
        code: the directory holding the shipped ``flatshare_ops`` (default: this switcher's own).

    Returns:
        the report (its findings and their worst status, :attr:`Report.status`).

    Raises:
        NoReport: neither the shipped nor the installed serving-check gave a report.
    """
    code = code or Path(__file__).resolve().parents[2]  # the directory holding this switcher's flatshare_ops/
    args = ["--json", "--inside-release", "--deadline", f"{DEADLINE_S:g}", "--state-dir", str(ctx.state_dir),
            "--node-name", ctx.node]
    if ctx.address.runtime_dir is not None:
        args += ["--runtime-dir", str(ctx.address.runtime_dir)]
    report, shipped = _run([sys.executable, "-B", "-c", SHIPPED, str(code), *args], progress)
    if report is not None:
        return report
    report, installed = _run([sys.executable, "-I", "-B", "-c", INSTALLED, *args], progress)
    if report is not None:
        if note is not None:
            note(f"the release's own serving-check gave no report ({shipped}): the node's installed serving-check "
                 "(its timer's) checked instead")
        return report
    raise NoReport(f"serving-check gave no report: the release's own: {shipped}; the node's installed one: {installed}")


def _run(argv: list[str], progress: Callable[[float], None] | None) -> tuple[Report | None, str]:
    """(the report one serving-check process gave, or None; why not, in a few words)."""
    with tempfile.TemporaryFile() as output:
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT)
        try:
            ended = poll_until(lambda: process.poll() is not None, DEADLINE_S + 10, 0.02, progress)
        finally:
            if process.poll() is None:  # past its bound, or an interrupt (SIGTERM's, Ctrl-C's) while it ran
                process.kill()
                process.wait()
        if not ended:
            return None, f"no report within {DEADLINE_S + 10:g} s (killed)"
        output.seek(0)
        data = output.read(MAX_REPORT_BYTES + 1)
    said = one_line(clip_tail(data[:MAX_REPORT_BYTES].decode("utf-8", errors="replace").strip(), 200)) or "no output"
    if len(data) > MAX_REPORT_BYTES:
        return None, f"exit {process.returncode}: more than {MAX_REPORT_BYTES >> 20} MiB of output"
    try:  # bounded JSON (no NaN, no nesting past common/files.py's limit), then the report's own shape
        report = Report.from_json(loads(data.decode("utf-8", errors="replace")))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None, f"exit {process.returncode}: {said}"
    if not report.findings:
        return None, f"exit {process.returncode}: a report with no findings"
    return report, ""
