"""How a release or rollback ended, in one place: the document ``--json`` prints and the table people read.

Pure: a rollout's state in (control/rollout.py builds the document from what each node's outcome said,
common/protocol.py ``Outcome``), a document or lines out. The document is the interface (docs/reference/
commands.md's ``--json`` and docs/release.md, "The summary"); the table is one rendering of it.
"""

from __future__ import annotations

from ..common.protocol import OutcomeResult
from ..errors import Exit

#: What each code means, for summaries (``cyan: refused``): a switch's result where the code is one's.
EXIT_NAMES: dict[int, str] = {
    Exit.OK: OutcomeResult.RELEASED,
    Exit.FAILED: "failed mid-switch (journal kept)",
    Exit.BAD_INPUT: "bad input",
    Exit.REFUSED: OutcomeResult.REFUSED,
    Exit.NOTHING_TO_DO: OutcomeResult.NOTHING_TO_DO,
    Exit.DAMAGED: "damaged node state",
    Exit.UNREACHABLE: "unreachable",
    Exit.STILL_SWITCHING: "still switching",
    Exit.SYSTEMD: "systemd did not answer",
    Exit.ROLLED_BACK: OutcomeResult.AUTO_ROLLED_BACK,
    Exit.ANALYSIS_FAILED: "canary analysis failed (rolled back)",
    Exit.PAUSED: "paused (canary analysis inconclusive)",
    Exit.INTERRUPTED: OutcomeResult.INTERRUPTED,
    Exit.TERMINATED: "terminated",
}

#: The table's columns: (heading, the node entry's key).
COLUMNS = (("node", "node"), ("from -> to", "switched"), ("commit", "commit"), ("result", "result"),
           ("drained", "drained_s"), ("engine start", "engine_start_s"), ("analysis", "analysis"),
           ("took", "duration_s"))


def seconds(value: float | None) -> str:
    """A duration for people: ``24.8 s``, ``2 min 41 s``, ``1 h 3 min``; ``-`` when not known."""
    if value is None:
        return "-"
    if value < 60:
        return f"{value:.1f} s"
    minutes, secs = divmod(round(value), 60)
    if minutes < 60:
        return f"{minutes} min {secs} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min"


def table_lines(document: dict) -> list[str]:
    """The summary as lines: a heading line (the rollout, what it was, its total time and exit code), one row
    per node with the :data:`COLUMNS` (the rollout's one line a node, with the reasons, follows it:
    control/rollout.py).

    Args:
        document: a summary document (``rollout``, ``mode``, ``dry_run``, ``code``, ``meaning``, ``duration_s``,
            ``nodes``: name -> entry with the columns' keys, ``from``, ``to``, ``tried`` and ``message``).
    """
    nodes = document["nodes"]
    what = f"{document['mode']}{' (dry run)' if document.get('dry_run') else ''} of {', '.join(nodes)}"
    lines = [f"rollout {document['rollout']}: {what}: finished in {seconds(document.get('duration_s'))}, "
             f"exit {document['code']} ({document['meaning']})"]
    rows = [[heading for heading, _ in COLUMNS]]
    for name, entry in nodes.items():
        row = []
        for _, key in COLUMNS:
            if key == "node":
                row.append(name)
            elif key == "switched" and entry.get("tried"):  # rolled back by the node: where it went, and back
                row.append(f"{entry.get('from') or '(none)'} -> {entry['tried']} -> {entry.get('to') or '-'}")
            elif key == "switched":
                row.append(f"{entry.get('from') or '(none)'} -> {entry.get('to') or '-'}"
                           if entry.get("to") or entry.get("from") else "-")
            elif key.endswith("_s"):
                row.append(seconds(entry.get(key)))
            else:
                value = entry.get(key)
                row.append(str(value) if value else "-")
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines += ["  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    return lines
