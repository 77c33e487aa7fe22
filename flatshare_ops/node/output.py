"""Release output that survives a lost terminal and a full disk: every line to release.log and the terminal.

docs/reference/release-protocol.md ("A dropped session"): an operator's SSH
session drops; a release must not stop halfway because its stdout went away.
:class:`ReleaseOutput` writes each line to the log first (append, flush),
then to the terminal. When a terminal write fails (EIO, EPIPE), would block
(a stalled reader: the terminal is written without blocking), or SIGHUP
arrives, it stops writing to the terminal and the release carries on. When
the log cannot be written (ENOSPC, EIO), the terminal still gets every line
and a note saying so: output never ends a switch.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import TextIO

from ..common import protocol
from ..common.clock import utc_stamp
from ..common.files import open_regular
from ..common.text import one_line


class ReleaseOutput:
    """A line sink: ``releases/release.log`` (timestamped) plus the terminal while it lasts.

    Args:
        log_path: the log file (appended to; its directory must exist), or None for no log.
        stream: the terminal stream (default ``sys.stdout``).
        prefix: put before every line (e.g. ``[cyan] ``).
        nonblocking: write the terminal without blocking (the node side: a stalled
            SSH session must never stall the switch).
    """

    def __init__(self, log_path: Path | None, stream: TextIO | None = None, prefix: str = "",
                 nonblocking: bool = False) -> None:
        self.stream = stream if stream is not None else sys.stdout
        self.prefix = prefix
        self.terminal = True
        self.log_error: str | None = None
        self._log = None
        self._fd = None
        #: The switch whose progress goes to the operator as :class:`protocol.Progress` lines (set by the
        #: switch command, whose operator reads them); None: waits are printed as lines for people.
        self.switch: str | None = None
        self.phase: protocol.SwitchPhase = protocol.SwitchPhase.DECIDING
        self.step = ""
        if log_path is not None:
            try:  # never through a link, never blocking on a FIFO: release.log is the node's own record
                fd = open_regular(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                self._log = os.fdopen(fd, "a", encoding="utf-8")
            except OSError as err:
                self.log_error = f"{log_path}: {err.strerror or err}"
        if nonblocking:
            try:
                fd = self.stream.fileno()
                if not os.isatty(fd):  # a terminal's blocking mode is shared with the shell: leave it
                    self.stream.flush()
                    os.set_blocking(fd, False)
                    self._fd = fd
            except (OSError, ValueError, AttributeError):
                self._fd = None
        if self.log_error:
            self.line(f"note: release.log cannot be written ({self.log_error}); this output is not kept on the node")

    def watch_hangup(self) -> None:
        """On SIGHUP, stop writing to the terminal (the session is gone) and keep going."""
        signal.signal(signal.SIGHUP, lambda *_: self.lose_terminal())

    def lose_terminal(self) -> None:
        """Stop writing to the terminal; point the stream at /dev/null so nothing else fails on it."""
        self.terminal = False
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self.stream.fileno())
            os.close(devnull)
        except (OSError, ValueError, AttributeError):
            pass

    def _write_log(self, text: str) -> None:
        if self._log is None:
            return
        try:
            self._log.write(f"{utc_stamp()} {text}\n")
            self._log.flush()
        except OSError as err:
            self.log_error = f"{getattr(self._log, 'name', 'release.log')}: {err.strerror or err}"
            try:
                self._log.close()
            except OSError:
                pass
            self._log = None
            self._write_terminal(f"{self.prefix}note: release.log cannot be written any more ({self.log_error}); "
                                 "later lines are not kept on the node")

    def _write_terminal(self, text: str) -> None:
        if not self.terminal:
            return
        data = (text + "\n").encode(errors="replace")
        try:
            if self._fd is not None:
                written = os.write(self._fd, data)
                if written < len(data):
                    raise BlockingIOError
            else:
                self.stream.write(text + "\n")
                self.stream.flush()
        except OSError:  # EIO (terminal gone), EPIPE (reader gone), EAGAIN (reader stalled)
            self.lose_terminal()

    def line(self, text: str) -> None:
        """Write one line: to the log (with a UTC timestamp), then to the terminal if it is still there. What it
        holds that is not text for one line (a newline, a terminal escape read from a file or a message) is shown
        escaped (common/text.py ``one_line``): it never starts a line of its own, poses as a protocol line, or
        reaches the terminal raw."""
        text = one_line(f"{self.prefix}{text}")
        self._write_log(text)
        self._write_terminal(text)

    def stage(self, phase: protocol.SwitchPhase, step: str = "") -> None:
        """The switch moved on (its :class:`protocol.SwitchPhase`; the step under way):
        the operator's side is told, in a :class:`protocol.Progress` line."""
        self.phase, self.step = phase, step
        if self.switch is not None:
            self._write_terminal(protocol.line(protocol.Progress(self.switch, phase, step)).rstrip("\n"))

    def waiting(self, what: str, waited_s: float, bound_s: float, engine_says: str | None = None) -> None:
        """A long wait's progress: in release.log as a line for people (``  still waiting for ...``); to the
        operator's side as a :class:`protocol.Progress` line (it shows it live on a terminal, or as that line),
        or as the line itself when no operator reads protocol lines."""
        message = protocol.Progress(self.switch or "", self.phase, self.step, what, round(waited_s, 1), bound_s,
                                    engine_says)
        text = one_line(f"{self.prefix}  {protocol.waiting_words(message)}")
        self._write_log(text)
        self._write_terminal(text if self.switch is None else protocol.line(message).rstrip("\n"))

    def log_only(self, text: str) -> None:
        """Write lines to the log only (a traceback kept for a bug report, never shown to the operator)."""
        for piece in text.rstrip("\n").split("\n"):
            self._write_log(f"{self.prefix}{piece}")

    def close(self) -> None:
        """Close the log (and give the terminal its blocking mode back)."""
        if self._fd is not None:
            try:
                os.set_blocking(self._fd, True)
            except OSError:
                pass
            self._fd = None
        if self._log:
            try:
                self._log.close()
            except OSError:
                pass
            self._log = None
