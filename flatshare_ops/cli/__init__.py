"""``flatshare``: the operator's command line, one module per area (:mod:`.app` says which). Argument parsing and
exit codes only.

Exit codes are :class:`flatshare_ops.errors.Exit`'s (README.md, "Exit codes"); ``flatshare check`` uses
serving-check's Nagios codes. An operator's error is one line naming the place, the rule and the way out,
never a traceback.
"""

from __future__ import annotations

import signal
import sys

from ..errors import Exit, FlatshareError, OperatorInterrupted


def commands():
    """The ``flatshare`` typer app with every command on it (each module registers its own when imported)."""
    from . import profiles, reports, sandbox, nodes, hold, release  # noqa: F401, I001
    from .app import app

    return app


def _stop_on_signals() -> None:
    """Ctrl-C and SIGTERM raise :class:`OperatorInterrupted` from here on: before the half second of imports a
    command starts with (typer, pydantic, paramiko), where Python's own handling would end a SIGTERM in silence
    and a Ctrl-C with a traceback. A rollout catches it and ends with its summary (control/rollout.py); anywhere
    else, :func:`main` says it in one line and exits 130 or 143. Nodes are never signalled: they finish what they
    do."""
    def stop(signum, _frame):
        raise OperatorInterrupted(Exit.INTERRUPTED if signum == signal.SIGINT else Exit.TERMINATED)

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)


def main() -> None:
    """Console-script entry point: run the app, turning operator errors into one line and an exit code, and an
    interrupt into one line saying what it stopped before, when the command knows."""
    _stop_on_signals()
    try:
        commands()()
    except FlatshareError as err:
        print(f"flatshare: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
    except OperatorInterrupted as stop:
        word = "Ctrl-C" if stop.code == Exit.INTERRUPTED else "SIGTERM"
        print(f"flatshare: interrupted by {word}" + (f" {stop.said}" if stop.said else ""), file=sys.stderr)
        sys.exit(stop.code)
