"""``flatshare``: the operator's command line, one module per area (:mod:`.app` says which). Argument parsing and
exit codes only.

Exit codes are :class:`flatshare_ops.errors.Exit`'s (README.md, "Exit codes"); ``flatshare check`` uses
serving-check's Nagios codes. An operator's error is one line naming the place, the rule and the way out,
never a traceback.
"""

from __future__ import annotations

import errno
import os
import sys

from ..common.streams import OutputError, output_lost, prepare
from ..control.interrupts import end_quietly, hold_signals, stop_on_signals
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
    and a Ctrl-C with a traceback; once the command has ended a signal is only noted (a second one ends the
    process at once), and once its output is flushed it is ignored: the exit code is the command's
    (control/interrupts.py). A closed standard stream is opened on /dev/null first, and an output that could
    not be written ends the command with exit 141 (common/streams.py)."""
    prepare()
    stop_on_signals()
    code: object = 0
    try:
        try:
            app = commands()
        except OperatorInterrupted as stop:
            stop.said = BEFORE_COMMAND
            raise
        app()
    except SystemExit as done:
        code = done.code
        closed = done.__context__  # typer exits 1 when the output's reader went away (`flatshare releases | head`)
        if isinstance(closed, OSError) and closed.errno == errno.EPIPE:
            code = Exit.OUTPUT_CLOSED
            raise SystemExit(code) from None
        raise
    except BrokenPipeError as lost:  # typer's own message (a usage error's) could not be written: its code stands
        shown = getattr(lost.__context__, "exit_code", None)
        code = shown if isinstance(shown, int) else Exit.OUTPUT_CLOSED
        sys.exit(code)
    except OutputError as lost:  # stdout failed otherwise than by its reader going away (a full disk)
        hold_signals()
        code = Exit.OUTPUT_CLOSED
        output_lost(lost, "flatshare")
        sys.exit(code)
    except FlatshareError as err:
        hold_signals()
        code = err.exit_code
        _say(f"flatshare: {err}")
        sys.exit(code)
    except OperatorInterrupted as stop:
        hold_signals()
        code = stop.code
        word = "Ctrl-C" if stop.code == Exit.INTERRUPTED else "SIGTERM"
        _say(f"flatshare: interrupted by {word}" + (f" {stop.said}" if stop.said else ""))
        sys.exit(code)
    finally:
        hold_signals()
        _end(code)


def _say(line: str) -> None:
    """``line`` on stderr; a stderr whose reader went away takes nothing, and the exit code still says it."""
    try:
        print(line, file=sys.stderr, flush=True)
    except OSError:
        pass


def _end(code: object) -> None:
    """Flush what the command printed (a signal meanwhile is noted: a second one ends the process), then ignore
    signals for the rest of the process. A connection an interrupted rollout left still being opened (its SSH
    handshake past the short wait it gets then) is never torn down by the interpreter's exit, which can abort
    with "FATAL: exception not rethrown": the process then ends at once with its code."""
    import threading

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or gone terminal: nothing more to show there
            pass
    end_quietly()
    if any(t.is_alive() and t.name.startswith("connect-") for t in threading.enumerate()):
        os._exit(code if isinstance(code, int) else 0 if code is None else 1)
