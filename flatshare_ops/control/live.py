"""The operator's terminal during a release: a live status line for the long waits, colour for the verdicts.

On a terminal (stdout or stderr a tty, ``NO_COLOR`` unset, no ``--plain``), a node's waits (its typed
``Progress`` messages, common/protocol.py) do not pile up: they become one status line, rewritten in place
(carriage return, erase to the end of the line), quoting the engine's latest output line and the time used of
its budget; the next ordinary line replaces it. Anywhere else (a pipe, a file, cron, ``--plain``) each wait is
printed as a line, with no control characters. No line's wording is read here: a wait is a message's kind.
"""

from __future__ import annotations

import os
import re
import sys
import threading
from typing import TextIO

#: Erase the current line: carriage return, then ECMA-48 "erase in line" to its end.
_ERASE = "\r\x1b[K"
#: The Nagios words and their colours (ECMA-48 SGR: green, yellow, red, magenta).
_COLOURS = {"OK": "32", "WARNING": "33", "CRITICAL": "31", "UNKNOWN": "35"}


def is_live(stream: TextIO, plain: bool = False) -> bool:
    """Whether ``stream`` gets live status lines and colour: a terminal, ``NO_COLOR`` unset (no-color.org), and
    ``TERM`` not ``dumb``, and not ``--plain``."""
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError, OSError):
        return False
    return tty and not plain and not os.environ.get("NO_COLOR") and os.environ.get("TERM") != "dumb"


class StatusLine:
    """Writes a release's lines to a stream; on a live terminal, waits as one status line rewritten in place.

    Args:
        write: writes finished text (the release's line sink: ``ReleaseOutput.line``, which keeps the log).
        stream: the terminal the status line is drawn on.
        live: draw status lines (see :func:`is_live`); False prints every line.
    """

    def __init__(self, write, stream: TextIO, live: bool) -> None:
        self.write, self.stream, self.live = write, stream, live
        self._showing = False
        self._lock = threading.Lock()

    def status(self, text: str) -> None:
        """A wait's progress: the status line, rewritten in place, on a live terminal; else a line."""
        with self._lock:
            if self.live:
                width = _width(self.stream)
                shown = " ".join(text.split())
                if len(shown) > width - 1:
                    shown = shown[:width - 2] + "…"
                self._draw(_ERASE + shown)
                self._showing = True
                return
        self.line(text)

    def line(self, text: str) -> None:
        """Print ``text`` as a line (erasing a status line shown)."""
        with self._lock:
            if self._showing:
                self._draw(_ERASE)
                self._showing = False
            self.write(text)

    def finish(self) -> None:
        """Erase a status line still shown (at the end of the run)."""
        with self._lock:
            if self._showing:
                self._draw(_ERASE)
                self._showing = False

    def _draw(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):
            self.live = False  # the terminal is gone: plain lines from here on (they go to the log too)


def _width(stream: TextIO) -> int:
    """The terminal's width in columns: ``COLUMNS``, else the terminal's own, else 80 (shutil's rule)."""
    import shutil

    return max(20, shutil.get_terminal_size((80, 24)).columns)


def coloured(text: str, live: bool) -> str:
    """``text`` with its first Nagios word (OK, WARNING, CRITICAL, UNKNOWN) coloured when ``live``."""
    if not live:
        return text
    return re.sub(r"\b(OK|WARNING|CRITICAL|UNKNOWN)\b",
                  lambda m: f"\x1b[{_COLOURS[m.group(1)]}m{m.group(1)}\x1b[0m", text, count=1)


def stdout_is_live(plain: bool = False) -> bool:
    """:func:`is_live` for this process's stdout."""
    return is_live(sys.stdout, plain)
