"""``flatshare release`` and ``flatshare rollback``: switching nodes, a rollout's batches and its canary."""

from __future__ import annotations

import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional, TypedDict

import typer

from ..common.streams import output_lost
from ..errors import Exit, OperatorInterrupted
from .app import app, RootOption, InventoryOption, NodesOption


#: What a release or rollback interrupted before its rollout began says (cli/__init__.py ``main``): its checks and
#: the reading of nodes' history change nothing, and no switch was asked of any node.
BEFORE_ANY_SWITCH = "before any switch began: nothing changed"


class AnalysisMode(str, Enum):
    """``--analysis``: what a rollout does with its canaries' analysis."""

    on = "on"
    dry_run = "dry-run"
    skip = "skip"


def _analysis_mode(value: str) -> AnalysisMode:
    """``--analysis``'s value, in our words when it is not one of the modes."""
    try:
        return AnalysisMode(value)
    except ValueError:
        from ..common.text import one_line

        raise typer.BadParameter(f"{one_line(value)} is not an analysis mode; use on, dry-run or skip") from None


AnalysisOption = Annotated[AnalysisMode, typer.Option(
    "--analysis", metavar="on|dry-run|skip", parser=_analysis_mode,
    autocompletion=lambda: [m.value for m in AnalysisMode], help="The canaries' analysis in a rollout: on (decide by it), dry-run (measure and report, "
                       "decide nothing) or skip (recorded in the canaries' history).")]
JsonOption = Annotated[bool, typer.Option(
    "--json", help="Print what became of the run as one JSON document on stdout (each node's result, release, "
                   "durations, the canary analyses; with --dry-run, each node's plan); people's lines go to stderr.")]
VerboseOption = Annotated[bool, typer.Option("-v", "--verbose", help="Print each node's whole plan (a dry run "
                                                                     "always does; release.log keeps it).")]
QuietOption = Annotated[bool, typer.Option("-q", "--quiet", help="Print only what this side decides, the nodes' "
                                                                 "errors and the summary.")]
PlainOption = Annotated[bool, typer.Option("--plain", help="Plain lines even on a terminal: no live status line, no "
                                                           "colour (as NO_COLOR or a pipe).")]


#: The longest ``--wait``: a day (seconds). A release waiting longer is not what anyone meant.
MAX_WAIT_S = 86400.0


def _duration(text: str) -> float:
    """``--wait``'s value in seconds: ``90``, ``90s``, ``5m``, ``1h``; more than 0, at most a day."""
    import re

    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text or "")
    if not match or float(match.group(1)) <= 0:
        raise typer.BadParameter(f"{text!r} is not a duration; give one like 90s, 5m or 1h")
    seconds = float(match.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[match.group(2)]
    if seconds > MAX_WAIT_S:
        raise typer.BadParameter(f"{text.strip()!r} is more than a day (24h); give at most 24h")
    return seconds


WaitOption = Annotated[Optional[float], typer.Option(
    "--wait", metavar="DURATION", parser=_duration,
    help="Wait up to DURATION (90s, 5m, 1h) for a node's admission to drain or for another release of it to end, "
         "asking again every few seconds and saying why; without it such a node is refused at once (exit 3).")]


@app.command("release", short_help='Switch nodes to what the checkout renders.')
def release(
    node: NodesOption = None,
    all_nodes: Annotated[bool, typer.Option("--all", help="Every inventory node, one batch at a time.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan and any refusal; change nothing.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Release even with E2 drop-ins linked (recorded).")] = False,
    batch_size: Annotated[Optional[int], typer.Option(
        "--batch-size", min=1, metavar="N", help="Nodes switched at once after the canaries (default: the inventory's "
        "rollout.batch).")] = None,
    no_auto_rollback: Annotated[bool, typer.Option(
        "--no-auto-rollback", help="A node whose new engine does not serve stays failed (the profile's "
        "release.auto_rollback otherwise rolls it back by itself).")] = False,
    analysis: AnalysisOption = AnalysisMode.on,
    retry: Annotated[bool, typer.Option(
        "--retry", help="Release it even though it failed and was taken back on some node (rolled back "
                        "automatically, or its canary analysis failed); without it, such a release is refused.")] = False,
    wait: WaitOption = None,
    changes_answers: Annotated[bool, typer.Option(
        "--changes-answers", help="This release is meant to change the engine's answers: golden answers that "
        "differ are said and recorded, not a failure of the canary analysis.")] = False,
    as_json: JsonOption = False,
    verbose: VerboseOption = False,
    quiet: QuietOption = False,
    plain: PlainOption = False,
    inventory: InventoryOption = None,
    root: RootOption = Path("."),
) -> None:
    """Switch nodes to what the checkout renders (without --node or --all: the node this runs on), and end with
    a summary: each node's result, from -> to, commit, time drained, engine start, analysis and duration.

    Exit codes: 0 released, 1 failed mid-switch, 2 bad input, 3 refused, 4 nothing to do, 5 damaged node
    state, 6 unreachable, 7 still switching, 8 systemd did not answer, 9 rolled back automatically,
    10 the canary analysis failed (the canary rolled back), 11 paused (the analysis was inconclusive),
    130/143 interrupted."""
    try:
        from ..config.inventory import inventory_path
        from ..control.rollout import (Rollout, refuse_drift, refuse_foreign_gateways, refuse_placeholder_pins,
                                       terminal, warn_uncommitted)
        from ..control.targets import every_node, targets

        out = terminal(sys.stderr if as_json else None)
        refuse_drift(root)
        path = inventory_path(inventory)
        chosen = targets(path, node or [], all_nodes)
        refuse_placeholder_pins(chosen)
        refuse_foreign_gateways(chosen)
        warn_uncommitted(root, out)  # only for a release that goes ahead
        rollout = Rollout(root, chosen, every_node(path, chosen), out, force=force, dry_run=dry_run,
                          batch_size=batch_size, auto_rollback=not no_auto_rollback, analysis=analysis.value,
                          inventory=path, verbose=verbose, quiet=quiet, plain=plain, retry=retry, wait_s=wait,
                          changes_answers=changes_answers)
    except OperatorInterrupted as stop:
        stop.said = BEFORE_ANY_SWITCH
        raise
    raise typer.Exit(_finish(rollout, as_json))


def _finish(rollout, as_json: bool) -> int:
    """Run the rollout; with --json, print its summary document (control/rollout.py ``Rollout.document``) alone
    on stdout, and return the rollout's exit code.

    A document that could not be written (``release --json | jq`` with jq gone, a full disk) is lost; the exit
    code still says what the rollout did when that is not ``OK`` (a rollback, a refusal: more than the lost
    output), else ``OUTPUT_CLOSED``, as for any command whose output was cut short."""
    import json

    code = rollout.run()
    if as_json:
        try:
            print(json.dumps(rollout.document(), sort_keys=True, indent=2), flush=True)
        except OSError as err:  # common/streams.py OutputError: a reader gone, a full disk
            output_lost(err, "flatshare")
            return code if code != Exit.OK else Exit.OUTPUT_CLOSED
    return code


class _Shown(TypedDict):
    """How a run shows itself (Rollout's verbose, quiet and plain)."""

    verbose: bool
    quiet: bool
    plain: bool


@app.command("rollback", short_help='Switch nodes back to what served before.')
def rollback(
    node: NodesOption = None,
    all_nodes: Annotated[bool, typer.Option(
        "--all", help="Undo the fleet's last rollout: each node it switched goes back to what it ran before.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan and any refusal; change nothing.")] = False,
    analysis: AnalysisOption = AnalysisMode.on,
    as_json: JsonOption = False,
    verbose: VerboseOption = False,
    quiet: QuietOption = False,
    plain: PlainOption = False,
    inventory: InventoryOption = None,
    root: RootOption = Path("."),
) -> None:
    """Switch nodes back: each to the last release that served before its current one; with --all, the
    fleet to what it ran before its last rollout (a failed or interrupted node first, then as a rollout:
    its canaries analysed)."""
    shown: _Shown = {"verbose": verbose, "quiet": quiet, "plain": plain}
    try:
        from ..common.protocol import Mode
        from ..config.inventory import inventory_path
        from ..control.rollout import Rollout, terminal
        from ..control.targets import every_node, targets

        out = terminal(sys.stderr if as_json else None)
        path = inventory_path(inventory)
        chosen = targets(path, node or [], all_nodes)
        everyone = every_node(path, chosen)
        if not all_nodes:
            rollout = Rollout(root, chosen, everyone, out, mode=Mode.ROLLBACK, dry_run=dry_run, inventory=path,
                              **shown)
        else:
            undo, order = _last_rollout(chosen, out)
            if undo is None:
                out.line("rollback: no node records a rollout to undo; nothing to do")
                raise typer.Exit(4)
            rollout = Rollout(root, order, everyone, out, mode=Mode.UNDO_ROLLOUT, dry_run=dry_run, undo=undo,
                              analysis=analysis.value, inventory=path, **shown)
    except OperatorInterrupted as stop:
        stop.said = BEFORE_ANY_SWITCH
        raise
    raise typer.Exit(_finish(rollout, as_json))


def _last_rollout(chosen, out):
    """(the fleet's last rollout, the nodes in the order to undo it: failed or interrupted first)."""
    from ..common.protocol import UNFINISHED, JournalState
    from ..control import commands
    from ..control.answers import journal_state
    from ..control.fanout import ask
    from ..control.rollout import last_rollout

    histories = ask(chosen, lambda t: commands.history(t.spec))
    statuses = ask(chosen, lambda t: commands.status(t.spec))
    for name, answer in {**histories, **statuses}.items():
        if "error" in answer:
            out.line(f"{name}: UNKNOWN: {answer['error']}")
    records = {n: a.get("records", []) for n, a in histories.items()}
    pending = {n: statuses.get(n, {}).get("switching_rollout") for n in records}
    undo = last_rollout(records, pending)

    def troubled(target) -> bool:
        last = (records.get(target.name) or [{}])[-1]
        return journal_state(statuses.get(target.name, {})) is not JournalState.NONE or last.get("result") in UNFINISHED

    return undo, sorted(chosen, key=lambda t: not troubled(t))
