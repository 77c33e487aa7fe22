"""Release output that survives a lost terminal: every line to the terminal and, timestamped, to a log.

An operator's SSH session drops; a release must not stop halfway because its
stdout went away. :class:`ReleaseOutput` writes each line to the log first
(append, flush), then to the terminal; when a terminal write fails (EIO,
EPIPE) or SIGHUP arrives, it stops writing to the terminal and the release
carries on. The log keeps every line.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import TextIO


class ReleaseOutput:
    """A line sink: ``releases/release.log`` (timestamped) plus the terminal while it lasts.

    Args:
        log_path: the log file (appended to; its directory must exist), or None for no log.
        stream: the terminal stream (default ``sys.stdout``).
        prefix: put before every line (e.g. ``[cyan] ``).
    """

    def __init__(self, log_path: Path | None, stream: TextIO | None = None, prefix: str = "") -> None:
        self.stream = stream if stream is not None else sys.stdout
        self.prefix = prefix
        self.terminal = True
        self._log = open(log_path, "a", encoding="utf-8") if log_path else None

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

    def line(self, text: str) -> None:
        """Write one line: to the log (with a UTC timestamp), then to the terminal if it is still there."""
        text = f"{self.prefix}{text}"
        if self._log:
            stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            self._log.write(f"{stamp} {text}\n")
            self._log.flush()
        if self.terminal:
            try:
                self.stream.write(text + "\n")
                self.stream.flush()
            except OSError:  # EIO (terminal gone), EPIPE (reader gone)
                self.lose_terminal()

    def close(self) -> None:
        """Close the log."""
        if self._log:
            self._log.close()
            self._log = None
