"""``releases/outcomes.jsonl``: what each switch command on the node ended with, refusals included.

A refusal changes nothing on the node, so neither the journal nor the history
holds it. When the operator's side loses its session before it read the
outcome (a stall at the admission, a dropped connection), it asks the node
about the switch by its id (``flatshare-node status --switch ID``), and the
answer must be the node's truth: "refused: why", not "never began". So every
switch command appends its outcome here (one JSON object per line, the
:class:`common.protocol.Outcome` fields plus ``node`` and ``at``), and the file
is kept to its newest :data:`KEEP` lines. Written by node/cli.py alone; read by
node/status.py.
"""

from __future__ import annotations

import os
import stat
import time
from dataclasses import asdict
from typing import overload

from ..common import durable
from ..common.files import Damaged, dumps, loads, read_bytes
from ..common.protocol import Outcome
from .context import NodeContext

OUTCOMES = "outcomes.jsonl"
#: How many outcomes the file keeps (the newest); it is rewritten down to this when it has twice as many.
KEEP = 200
#: The most the file may hold (bytes): twice KEEP outcomes, with room for long messages.
MAX_BYTES = 4 << 20


def append(ctx: NodeContext, outcome: Outcome) -> None:
    """Append one outcome (fsynced); trim the file to the newest :data:`KEEP` (atomically) when it grew past
    twice that, or past :data:`MAX_BYTES` (then only its newest lines that fit in half of it are kept: a file
    grown by hand or by damage never stops the outcomes that follow from being kept).

    Raises:
        Damaged: the file is not a regular file (a directory, a FIFO, a link...) or cannot be read: nothing is
            appended to it.
        OSError: the record could not be written (the caller says so; the outcome itself still went out).
        ValueError: the outcome holds a number that is not finite (a bug: nothing is written).
    """
    path = ctx.releases / OUTCOMES
    line = dumps({**asdict(outcome), "node": ctx.node, "at": time.time()}, sort_keys=True)
    lines = _newest_lines(path)
    if lines is None or len(lines) + 1 > 2 * KEEP:
        kept = _newest_lines(path, MAX_BYTES // 2) if lines is None else lines
        durable.write_atomic(path, b"\n".join([*kept, line.encode()][-KEEP:]) + b"\n")
    else:
        durable.append_line(path, line)


@overload
def _newest_lines(path, tail: int) -> list[bytes]: ...
@overload
def _newest_lines(path, tail: None = None) -> list[bytes] | None: ...
def _newest_lines(path, tail: int | None = None) -> list[bytes] | None:
    """The file's lines; None when it is larger than :data:`MAX_BYTES` and ``tail`` is None; with ``tail``, the
    whole lines within its last ``tail`` bytes.

    Raises:
        Damaged: not a regular file, or unreadable.
    """
    from ..common.files import NotAFile, open_regular

    if tail is None:
        try:
            return (read_bytes(path, limit=MAX_BYTES) or b"").splitlines()
        except Damaged:
            if not _oversized(path):
                raise
            return None
    try:
        fd = open_regular(path)
    except NotAFile as err:
        raise Damaged(path, err.strerror) from None
    except OSError as err:
        raise Damaged(path, f"unreadable ({err.strerror or err})") from None
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        f.seek(max(0, size - tail))
        data = f.read(tail)
    return data.splitlines()[1:] if size > tail else data.splitlines()  # the first line may be cut


def _oversized(path) -> bool:
    """Whether path is a regular file (not a link) larger than :data:`MAX_BYTES`."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(info.st_mode) and info.st_size > MAX_BYTES


def find(ctx: NodeContext, switch_id: str) -> dict | None:
    """The newest recorded outcome of switch ``switch_id`` on this node, or None (damaged lines are skipped; of a
    file larger than :data:`MAX_BYTES`, only the newest lines, as :func:`append` keeps them).

    Raises:
        Damaged: the file itself is damaged (a FIFO, a directory, unreadable...).
    """
    path = ctx.releases / OUTCOMES
    lines = _newest_lines(path)
    found = None
    for line in _newest_lines(path, MAX_BYTES // 2) if lines is None else lines:
        try:
            document = loads(line.decode("utf-8", errors="replace"))
        except ValueError:
            continue
        if isinstance(document, dict) and document.get("switch") == switch_id and document.get("node") == ctx.node:
            found = document
    return found
