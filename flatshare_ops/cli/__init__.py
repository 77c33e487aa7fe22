"""``flatshare``: the operator's command line, one module per area (:mod:`.app` says which). Argument parsing and
exit codes only.

Exit codes are :class:`flatshare_ops.errors.Exit`'s (README.md, "Exit codes"); ``flatshare check`` uses
serving-check's Nagios codes. An operator's error is one line naming the place, the rule and the way out,
never a traceback.
"""

from __future__ import annotations

import sys

from ..control.interrupts import hold_signals, stop_on_signals
from ..errors import Exit, FlatshareError, OperatorInterrupted


def commands():
    """The ``flatshare`` typer app with every command on it (each module registers its own when imported)."""
    from . import profiles, reports, sandbox, nodes, hold, release  # noqa: F401, I001
    from .app import app

    return app


#: What an interrupt during the imports of a command (typer and the command's modules) says: nothing ran yet.
BEFORE_COMMAND = "before the command began: nothing changed"


def main() -> None:
    """Console-script entry point: run the app, turning operator errors into one line and an exit code, and an
    interrupt into one line saying what it stopped before, when the command knows.

    Ctrl-C and SIGTERM raise :class:`OperatorInterrupted` from the first line, before the half second of imports a
    command starts with (typer, pydantic, paramiko), where Python's own handling would end a SIGTERM in silence
    and a Ctrl-C with a traceback (control/interrupts.py); once the command has ended (its line printed, Python's
    own shutdown to come) a signal is only noted, and the exit code is the command's."""
    stop_on_signals()
    try:
        try:
            app = commands()
        except OperatorInterrupted as stop:
            stop.said = BEFORE_COMMAND
            raise
        app()
    except FlatshareError as err:
        hold_signals()
        print(f"flatshare: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
    except OperatorInterrupted as stop:
        hold_signals()
        word = "Ctrl-C" if stop.code == Exit.INTERRUPTED else "SIGTERM"
        print(f"flatshare: interrupted by {word}" + (f" {stop.said}" if stop.said else ""), file=sys.stderr)
        sys.exit(stop.code)
    finally:
        hold_signals()
