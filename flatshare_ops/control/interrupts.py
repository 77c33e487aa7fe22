"""Ctrl-C and SIGTERM on the operator's side: an interrupt while a command can still stop, and only a note once
its result is decided.

A command stops at a signal (:func:`stop_on_signals`: :class:`errors.OperatorInterrupted` is raised in the main
thread, which a rollout turns into its summary and ``flatshare`` into one line). Once what the command will say
and exit with is decided (a rollout's summary and ``--json`` document, Python's own shutdown after ``main``),
:func:`hold_signals` makes a signal a note that changes nothing: raised there, it cut a summary in two, lost a
``--json`` document already decided, or came out of the interpreter's shutdown as a traceback. Nodes are never
signalled from here: they finish what they do (adr/0008). Standard library only.
"""

from __future__ import annotations

import signal

from ..errors import Exit, OperatorInterrupted

_noted: list[int] = []  # the exit codes of the signals noted while held, in order


def _code(signum: int) -> int:
    return Exit.INTERRUPTED if signum == signal.SIGINT else Exit.TERMINATED


def _raise(signum: int, _frame) -> None:
    raise OperatorInterrupted(_code(signum))


def _note(signum: int, _frame) -> None:
    _noted.append(_code(signum))


def stop_on_signals() -> None:
    """From now on SIGINT and SIGTERM raise :class:`OperatorInterrupted` (``code`` 130 or 143) in the main
    thread. Call it from the main thread."""
    signal.signal(signal.SIGINT, _raise)
    signal.signal(signal.SIGTERM, _raise)


def hold_signals() -> None:
    """From now on SIGINT and SIGTERM are only noted (:func:`noted`): the command's result is decided, and what
    it prints and exits with stands. Only where :func:`stop_on_signals` set them (a rollout run in another
    process, a test's, keeps that process's own handling), and only in the main thread (where Python runs
    handlers); calling it again changes nothing."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return
    for number in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(number) is _raise:
            signal.signal(number, _note)


def noted() -> list[int]:
    """The exit codes (130, 143) of the signals noted since :func:`hold_signals`, in order."""
    return list(_noted)
