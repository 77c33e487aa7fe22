"""Where a node's services write their output, and its last lines (standard library only).

The profile's ``layout.output`` (serving.json's ``layout.output``) says where: ``"journal"``
(systemd's default for a service's stdout and stderr, read with ``journalctl``) or a directory in
which each service appends to ``UNIT.log`` (the units get ``StandardOutput=append:DIR/UNIT.log``
and ``StandardError=inherit``: systemd.exec(5), docs/reference/systemd.md). The sandbox's nodes use
files: a user manager without journald has nowhere else to put its services' output.

Read by the node's switch (a failed engine start quotes the engine's last lines) and by serving-check
(an engine that is not running; the serve module's turn count). Every read is bounded: the tail of a
file (at most :data:`TAIL_BYTES`), ``journalctl -n`` with a timeout.
"""

from __future__ import annotations

import os
import re

from .text import one_line

JOURNAL = "journal"
#: How many lines a failure quotes.
QUOTED_LINES = 12
#: At most this much of a file's end is read (bytes).
TAIL_BYTES = 256 * 1024
#: journalctl's bound (seconds).
JOURNALCTL_TIMEOUT_S = 5.0
JOURNALCTL = "journalctl"


def output_file(output: str, unit: str) -> str | None:
    """The file ``unit`` appends its output to, or None when it goes to the journal.

    Args:
        output: ``layout.output``: ``"journal"`` or an absolute directory.
        unit: a unit name (``flatshare-engine.service``).
    """
    if output == JOURNAL:
        return None
    return os.path.join(output, f"{unit}.log")


class Tail:
    """The last lines of a unit's output, or why they could not be read.

    Attributes:
        lines: the lines, oldest first, each made safe to print on one line (:func:`text.one_line`).
        source: where they were read (a file path, or ``journalctl --unit UNIT``).
        problem: why nothing could be read (None when ``lines`` is what the source holds).
    """

    __slots__ = ("lines", "source", "problem")

    def __init__(self, lines: list[str], source: str, problem: str | None = None) -> None:
        self.lines, self.source, self.problem = lines, source, problem

    def quote(self, whose: str = "its", count: int = QUOTED_LINES) -> str:
        """The last ``count`` lines for a message: ``WHOSE last lines (SOURCE): a | b | c``."""
        if self.problem:
            return f"{whose} output could not be read ({self.problem})"
        lines = [line for line in self.lines if line.strip()]
        shown = lines[-count:]
        if not shown:
            return f"{whose} output ({self.source}) is empty"
        # A traceback's cause may lie above the lines quoted (vLLM's API server prints its own traceback
        # after its engine core's): its exception lines come first.
        causes = [line for line in lines[:-count] if _EXCEPTION.match(line)][-3:]
        return f"{whose} last lines ({self.source}): " + " | ".join([*causes, *(["..."] if causes else []), *shown])


def output_mark(layout: dict, unit: str) -> tuple[str, float]:
    """Where ``unit``'s output stands now, for :func:`last_lines`' ``since``: ``("bytes", size of its output
    file)``, or ``("time", now in Unix seconds)`` when it goes to the journal (never raises: a file that cannot
    be read marks 0 bytes)."""
    import time

    path = output_file(str(layout.get("output") or JOURNAL), unit)
    if path is None:
        return ("time", time.time())
    try:
        return ("bytes", float(os.stat(path).st_size))
    except OSError:
        return ("bytes", 0.0)


def last_lines(layout: dict, unit: str, count: int = 200, since: tuple[str, float] | None = None) -> Tail:
    """The last ``count`` lines ``unit`` wrote, wherever the node keeps them (bounded; never raises).

    Args:
        layout: serving.json's ``layout`` (``scope``, ``output``; an older release without ``output``
            means the journal).
        unit: the unit name.
        count: how many lines at most.
        since: only what it wrote after this mark (:func:`output_mark`): a failed start's own lines, not an
            earlier start's (a file that shrank since, rotated, is read whole).
    """
    output = layout.get("output") or JOURNAL
    path = output_file(str(output), unit)
    if path is None:
        after = f"@{since[1]:.0f}" if since is not None and since[0] == "time" else None
        return _journal(unit, str(layout.get("scope", "system")), count, since=after)
    return _file(path, count, int(since[1]) if since is not None and since[0] == "bytes" else 0)


#: How far back :func:`last_marked` reads a unit's output file for a marked line (bytes).
MARKED_BYTES = 32 * 1024 * 1024
#: The chunks it reads backwards in (bytes).
CHUNK_BYTES = 1024 * 1024


def last_marked(layout: dict, unit: str, marker: str, count: int = 20) -> Tail:
    """The newest ``count`` lines of ``unit``'s output that contain ``marker`` (bounded; never raises): a line a
    program prints rarely (the serve module's start line) must not fall out of reach behind a flood of other
    lines (vLLM logs every request).

    Files are read backwards, a chunk at a time, at most :data:`MARKED_BYTES`; the journal is asked with
    ``journalctl --grep`` (journalctl(1)) within its timeout.
    """
    output = layout.get("output") or JOURNAL
    path = output_file(str(output), unit)
    if path is None:
        return _journal(unit, str(layout.get("scope", "system")), count, grep=marker)
    opened = _open_output(path)
    if isinstance(opened, Tail):
        return opened
    fd, size = opened
    found: list[str] = []
    try:
        end, carry, needle = size, b"", marker.encode()
        while end > 0 and size - end < MARKED_BYTES and len(found) < count:
            start = max(0, end - CHUNK_BYTES)
            os.lseek(fd, start, os.SEEK_SET)
            data = os.read(fd, end - start) + carry
            head, _, body = data.partition(b"\n") if start > 0 else (b"", b"", data)
            carry = head  # a line cut at the chunk's start is read whole with the next chunk
            for line in reversed(_split(body)):
                if needle in line.encode():
                    found.append(one_line(_strip_ansi(line)))
                    if len(found) == count:
                        break
            end = start
    except OSError as err:
        return Tail([], path, f"{path}: {err.strerror or err}")
    finally:
        os.close(fd)
    return Tail(list(reversed(found)), path)


def _open_output(path: str) -> tuple[int, int] | Tail:
    """Open a unit's output file to read, never following a link or blocking on what is there: ``(fd, size in
    bytes)``, or a :class:`Tail` saying why it cannot be read (nothing is left open then)."""
    import stat

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return Tail([], path, f"{path} does not exist: the unit has written nothing since its output went there")
    except OSError as err:
        return Tail([], path, f"{path}: {err.strerror or err}")
    try:
        info = os.fstat(fd)
    except OSError as err:
        os.close(fd)
        return Tail([], path, f"{path}: {err.strerror or err}")
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        return Tail([], path, f"{path} is not a regular file")
    return fd, info.st_size


def _file(path: str, count: int, after: int = 0) -> Tail:
    opened = _open_output(path)
    if isinstance(opened, Tail):
        return opened
    fd, size = opened
    if after > size:
        after = 0  # the file shrank since the mark (rotated, truncated): all of it is new
    try:
        start = max(after, size - TAIL_BYTES)
        os.lseek(fd, start, os.SEEK_SET)
        data = os.read(fd, TAIL_BYTES)
    except OSError as err:
        return Tail([], path, f"{path}: {err.strerror or err}")
    finally:
        os.close(fd)
    lines = _split(data)
    if start > after and lines:
        lines = lines[1:]  # the first line read may be cut (at the mark, a line begins)
    return Tail([one_line(_strip_ansi(line)) for line in lines[-count:]], path)


def _journal(unit: str, scope: str, count: int, grep: str | None = None, since: str | None = None) -> Tail:
    import subprocess  # here: serving-check imports this module every minute, and a sandbox reads files

    which = "--user-unit" if scope == "user" else "--unit"
    argv = [JOURNALCTL, which, unit, "-n", str(count), "-o", "cat", "--no-pager", "-q"]
    if grep is not None:
        import re as _re

        argv += ["--grep", _re.escape(grep)]
    if since is not None:
        argv += ["--since", since]  # journalctl(1): "@" and Unix seconds
    source = f"journalctl {which} {unit}"
    try:
        done = subprocess.run(argv, capture_output=True, timeout=JOURNALCTL_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return Tail([], source, f"journalctl did not answer within {JOURNALCTL_TIMEOUT_S:g} s")
    except OSError as err:
        return Tail([], source, f"cannot run journalctl ({err.strerror or err})")
    if done.returncode != 0:
        why = done.stderr.decode(errors="replace").strip().splitlines()
        return Tail([], source, f"journalctl exited {done.returncode}" + (f": {one_line(why[-1])}" if why else ""))
    lines = _split(done.stdout)
    return Tail([one_line(_strip_ansi(line)) for line in lines[-count:]], source)


def _split(data: bytes) -> list[str]:
    # Lines end at a newline only (str.splitlines would also split at \r, U+2028, ...: a progress bar's \r
    # is shown escaped, not taken for a line of its own).
    text = data.decode("utf-8", errors="replace")
    return text.split("\n")[:-1] if text.endswith("\n") else text.split("\n")


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
#: The last line of a Python traceback (``ValueError: ...``), after vLLM's ``(EngineCore pid=N)`` prefix if any.
_EXCEPTION = re.compile(r"^(?:\(\S+ pid=\d+\)\s*)?[A-Za-z_][\w.]*(?:Error|Exception)\b:")


def _strip_ansi(line: str) -> str:
    # vLLM colours its log lines when it thinks it writes to a terminal; the colour codes say nothing.
    return _ANSI.sub("", line)
