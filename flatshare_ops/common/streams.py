"""The process's standard streams, for commands whose output may go nowhere (standard library only).

A command started with a standard stream closed (``flatshare releases >&-``) gets ``None`` for it from Python,
and the next file it opens takes that number: a socket on descriptor 2 would receive the lines meant for
people. A stream whose reader went away (``| head``) or whose file is full (``>/dev/full``) fails every write.
Here each closed one is opened on ``/dev/null`` first, and stdout's writes that fail raise :class:`OutputError`
(an ``OSError`` with the same ``errno``), so the command's entry point can tell a lost output from any other
error and end with its exit code for that (``Exit.OUTPUT_CLOSED``).
"""

from __future__ import annotations

import errno
import io
import os
import sys


class OutputError(OSError):
    """A write to stdout failed (its reader went away: ``EPIPE``; a full disk: ``ENOSPC``; ...)."""


class _Stdout(io.TextIOWrapper):
    """sys.stdout, whose failed writes raise :class:`OutputError`."""

    def write(self, text: str) -> int:
        try:
            return super().write(text)
        except OutputError:
            raise
        except OSError as err:
            raise OutputError(err.errno, err.strerror) from None

    def flush(self) -> None:
        try:
            super().flush()
        except OutputError:
            raise
        except OSError as err:
            raise OutputError(err.errno, err.strerror) from None


def prepare() -> None:
    """Open ``/dev/null`` on each of descriptors 0, 1 and 2 that is closed (reading for 0, writing for 1 and 2)
    and give Python streams on them; then make stdout a stream whose failed writes raise :class:`OutputError`.
    Call it first thing in an entry point, before any file is opened."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            opened = os.open(os.devnull, os.O_RDONLY if fd == 0 else os.O_WRONLY)
            if opened != fd:  # the lowest free number: fd itself, unless a lower one was closed too
                os.dup2(opened, fd)
                os.close(opened)
    if sys.stdin is None:
        sys.stdin = open(0, encoding="utf-8", errors="replace", closefd=False)
    if sys.stderr is None:
        sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False, buffering=1)
    stdout = sys.stdout
    if stdout is None:
        sys.stdout = _Stdout(open(1, "wb", closefd=False), encoding="utf-8", errors="strict", line_buffering=True)
    elif type(stdout) is io.TextIOWrapper:
        stdout.flush()
        encoding, errors, lines = stdout.encoding, stdout.errors, stdout.line_buffering
        sys.stdout = _Stdout(stdout.detach(), encoding=encoding, errors=errors, line_buffering=lines)


def output_lost(err: OSError, program: str) -> None:
    """After stdout failed with ``err``: say why on stderr unless its reader simply went away (nobody is there
    to read more), and point descriptor 1 at ``/dev/null``, so that what is still buffered fails no more (the
    interpreter's last flush included, which would print "Exception ignored" and change the exit code)."""
    if err.errno != errno.EPIPE:
        try:
            print(f"{program}: the output could not be written to stdout ({err.strerror or err}); what was not "
                  "written is lost", file=sys.stderr, flush=True)
        except (OSError, ValueError):
            pass
    try:
        nowhere = os.open(os.devnull, os.O_WRONLY)
        os.dup2(nowhere, 1)
        os.close(nowhere)
    except OSError:
        pass
