"""Ctrl-C and SIGTERM on the operator's side: an interrupt while a command can still stop, only a note once its
result is decided (a second note ends the process at once), ignored once it has said everything.

A command stops at a signal (:func:`stop_on_signals`: :class:`errors.OperatorInterrupted` is raised in the main
thread, which a rollout turns into its summary and ``flatshare`` into one line). Once what the command will say
and exit with is decided (a rollout's summary and ``--json`` document, Python's own shutdown after ``main``),
:func:`hold_signals` makes a signal a note that changes nothing: raised there, it cut a summary in two, lost a
``--json`` document already decided, or came out of the interpreter's shutdown as a traceback. Nodes are never
signalled from here: they finish what they do (adr/0008). Standard library only.
"""

from __future__ import annotations

import os
import signal

from ..errors import Exit, OperatorInterrupted

_noted: list[int] = []  # the exit codes of the signals noted while held, in order (the last one ends it)


def _code(signum: int) -> int:
    return Exit.INTERRUPTED if signum == signal.SIGINT else Exit.TERMINATED


def _raise(signum: int, _frame) -> None:
    # The first signal ends the command: any later one is a note, even one that arrives before the code that
    # catches this has held them (a second signal raised there lost the first one's summary and exit code).
    signal.signal(signal.SIGINT, _note)
    signal.signal(signal.SIGTERM, _note)
    raise OperatorInterrupted(_code(signum))


def _note(signum: int, _frame) -> None:
    _noted.append(_code(signum))
    if len(_noted) >= FORCED_AFTER:
        # Whatever still holds the process (a terminal that takes no more output: Ctrl-S, a pipe nobody reads)
        # would keep it for good, the signals only noted: it ends now, without flushing what is buffered.
        os._exit(_noted[-1])


#: A signal noted this many times ends the process at once (``os._exit`` with that signal's code).
FORCED_AFTER = 2


def stop_on_signals() -> None:
    """From now on SIGINT and SIGTERM raise :class:`OperatorInterrupted` (``code`` 130 or 143) in the main
    thread. Call it from the main thread."""
    signal.signal(signal.SIGINT, _raise)
    signal.signal(signal.SIGTERM, _raise)


def hold_signals() -> None:
    """From now on SIGINT and SIGTERM are only noted: the command's result is decided, and what
    it prints and exits with stands. Only where :func:`stop_on_signals` set them (a rollout run in another
    process, a test's, keeps that process's own handling), and only in the main thread (where Python runs
    handlers); calling it again changes nothing."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return
    for number in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(number) is _raise:
            signal.signal(number, _note)


def end_quietly() -> None:
    """The command has said all it says (its output flushed): SIGINT and SIGTERM are ignored for what is left of
    the process, Python's own shutdown. Python sets a handler of its own back to the default action late in its
    shutdown, and a signal then ended a process whose output said it succeeded with 143; an ignored signal stays
    ignored. Only where :func:`stop_on_signals` or :func:`hold_signals` set them; the main thread only."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return
    for number in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(number) in (_raise, _note):
            signal.signal(number, signal.SIG_IGN)
