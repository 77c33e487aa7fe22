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

import time
from dataclasses import asdict

from ..common import durable
from ..common.files import dumps, loads, read_bytes
from ..common.protocol import Outcome
from .context import NodeContext

OUTCOMES = "outcomes.jsonl"
#: How many outcomes the file keeps (the newest); it is rewritten down to this when it has twice as many.
KEEP = 200
#: The most the file may hold (bytes): twice KEEP outcomes, with room for long messages.
MAX_BYTES = 4 << 20


def append(ctx: NodeContext, outcome: Outcome) -> None:
    """Append one outcome (fsynced); trim the file to the newest :data:`KEEP` (atomically) when it grew past
    twice that.

    Raises:
        Damaged: the file is damaged (too large, not a regular file...): nothing is appended to it.
        OSError: the record could not be written (the caller says so; the outcome itself still went out).
        ValueError: the outcome holds a number that is not finite (a bug: nothing is written).
    """
    path = ctx.releases / OUTCOMES
    lines = (read_bytes(path, limit=MAX_BYTES) or b"").splitlines()
    line = dumps({**asdict(outcome), "node": ctx.node, "at": time.time()}, sort_keys=True)
    durable.append_line(path, line)
    if len(lines) + 1 > 2 * KEEP:
        durable.write_atomic(path, b"\n".join([*lines, line.encode()][-KEEP:]) + b"\n")


def find(ctx: NodeContext, switch_id: str) -> dict | None:
    """The newest recorded outcome of switch ``switch_id`` on this node, or None (damaged lines are skipped).

    Raises:
        Damaged: the file itself is damaged (too large, a FIFO or a directory...).
    """
    raw = read_bytes(ctx.releases / OUTCOMES, limit=MAX_BYTES)
    found = None
    for line in (raw or b"").decode("utf-8", errors="replace").splitlines():
        try:
            document = loads(line)
        except ValueError:
            continue
        if isinstance(document, dict) and document.get("switch") == switch_id and document.get("node") == ctx.node:
            found = document
    return found
