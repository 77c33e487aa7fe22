"""``flatshare check | status | releases``: what each node says of itself, one answer per node, every node named."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from ..common.wording import text_field

from ..errors import Exit, FlatshareError
from .app import app, InventoryOption, NodesOption, answer_code, fleet_answers


@app.command("check", short_help='serving-check on nodes over SSH.')
def check(
    all_nodes: Annotated[bool, typer.Option("--all", help="Check every inventory node (what no --node means).")] = False,
    node: Annotated[Optional[list[str]], typer.Option("--node", metavar="NAME",
                                                      help="Check this node (repeatable).")] = None,
    inventory: InventoryOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON document: node -> its report.")] = False,
    quiet: Annotated[bool, typer.Option("-q", "--quiet", help="Print nothing for nodes that are OK.")] = False,
) -> None:
    """Run serving-check on nodes over SSH and print each node's result.

    Every node gets a line; a node that cannot be reached or is slow is UNKNOWN by name. Exit: the worst
    node's Nagios code (0 OK, 1 WARNING, 2 CRITICAL, 3 UNKNOWN), but 6 when a node could not be asked (as
    every command says an unreachable node)."""
    import json as _json

    from ..check.report import EXIT_CODES, UNKNOWN, Finding, Report, nagios_text, worst
    from ..config.inventory import inventory_path
    from ..control import commands
    from ..control.fanout import ask
    from ..control.targets import targets

    if all_nodes and node:
        raise typer.BadParameter("give --all or --node, not both", param_hint="--all")
    try:
        chosen = targets(inventory_path(inventory), node or [], not node)
    except FlatshareError as err:
        typer.echo(f"SERVING-CHECK UNKNOWN - {err}")
        raise typer.Exit(3)
    reports, unreachable = [], False
    for name, answer in ask(chosen, lambda t: commands.serving_check(t.spec)).items():
        unreachable |= answer_code(answer) == Exit.UNREACHABLE
        try:
            reports.append(Report.from_json(answer))
        except (KeyError, TypeError, ValueError):
            error = text_field(answer, "error")
            reports.append(Report(name, [Finding("ssh", UNKNOWN, error or "its serving-check answer is not a "
                                                 "report (no error named): run serving-check on the node")]))
    if as_json:
        typer.echo(_json.dumps({r.node: r.to_json() for r in reports}, indent=2, sort_keys=True))
    else:
        from ..control.live import coloured, stdout_is_live

        live = stdout_is_live()
        for report in reports:
            if not (quiet and report.status == "OK"):
                for line in nagios_text(report).splitlines():
                    typer.echo(coloured(line, live))
    raise typer.Exit(Exit.UNREACHABLE if unreachable else EXIT_CODES[worst(r.status for r in reports)])




@app.command("status", short_help="Each node's release, switch and units.")
def status(
    node: NodesOption = None,
    inventory: InventoryOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON document: node -> its status.")] = False,
) -> None:
    """Each node's active release, any switch in progress or unfinished, its units' states (default: every node).

    Exit 5 when a node's state is damaged (a file named under "damaged", a history line skipped included);
    else 6 when a node could not be asked; else 1 when a node has an unfinished switch, a unit that is not
    active, or a voice drain file left with no release running."""
    import json as _json

    from ..common.protocol import JournalState
    from ..control import commands
    from ..control.answers import journal_state, status_lines

    reports = fleet_answers(node, inventory, lambda t: commands.status(t.spec))
    healthy = all("error" not in r and journal_state(r) is JournalState.NONE and not r.get("damaged")
                  and not r.get("drain_left")
                  and r.get("units") and set(r["units"].values()) == {"active"} for r in reports.values())
    damaged = any("error" not in r and r.get("damaged") for r in reports.values())
    codes = [answer_code(r) for r in reports.values()]
    code = (Exit.OK if healthy else Exit.DAMAGED if damaged or Exit.DAMAGED in codes
            else Exit.UNREACHABLE if Exit.UNREACHABLE in codes else Exit.FAILED)
    if as_json:
        typer.echo(_json.dumps(reports, indent=2, sort_keys=True))
        raise typer.Exit(code)
    for name, report in reports.items():
        for line in status_lines(name, report):
            typer.echo(line)
    raise typer.Exit(code)


@app.command("releases", short_help="Each node's release history.")
def releases(node: NodesOption = None, inventory: InventoryOption = None,
             measurements: Annotated[bool, typer.Option(
                 "--measurements", help="Under each canary analysis, each of its measurements' lines: the window, "
                                        "the verdict and why, the canary's and the baseline's values.")] = False,
             as_json: Annotated[bool, typer.Option(
                 "--json", help="Print each node's records as JSON, analyses whole (releases/README.md).")] = False,
             ) -> None:
    """The release history of each node (default: every node): what ran, what failed, what was rolled back.

    Exit 6 when a node could not be asked, or the node's own code when it said why its history could not be
    read (5: damaged); the node is printed as UNKNOWN by name."""
    import json as _json

    from ..common.text import one_line
    from ..control import commands
    from ..control.answers import history_line, owed_rollback_words
    from ..node.history import failed_releases

    answers = fleet_answers(node, inventory, lambda t: commands.history(t.spec))
    codes = [c for c in (answer_code(a) for a in answers.values()) if c is not None]
    code = Exit.DAMAGED if Exit.DAMAGED in codes else min(codes, default=Exit.OK)
    if as_json:
        typer.echo(_json.dumps(answers, indent=2, sort_keys=True))
        raise typer.Exit(code)
    for name, answer in answers.items():
        typer.echo(f"{name}:")
        if "error" in answer:
            typer.echo(f"  UNKNOWN: {one_line(answer['error'])}")
            continue
        for note in answer.get("skipped", []):
            typer.echo(f"  note: {one_line(note)}")
        if answer.get("disorder"):
            typer.echo(f"  damaged: {one_line(str(answer['disorder']))}: a rollback of {name} is refused until the "
                       "lines are in order (or the file is moved aside)")
        records = [r if isinstance(r, dict) else {} for r in answer.get("records", [])]
        measured = False
        for record in records:
            typer.echo(f"  {history_line(record)}")
            if measurements:
                for line in _measurement_lines(record):
                    typer.echo(f"    {line}")
                    measured = True
        if measurements and not measured:
            typer.echo(f"  no canary analysis of {name} has measurements in its history")
        for release, how in failed_releases(records).items():
            owed = f"; {name} still runs it: {owed_rollback_words(name)}" if how.get("owed") else ""
            typer.echo(f"  FAILED {release}: {how['how']} ({one_line(str(how['why']))}){owed}; 'flatshare release' "
                       "refuses it on every node until given --retry")
    raise typer.Exit(code)


def _measurement_lines(record: dict) -> list[str]:
    """An analysis record as the rollout printed it: its golden answers' line (when it had golden prompts), the
    table's header and one row a measurement (a record written before the table has each measurement's line);
    none for other records."""
    from ..common.text import one_line
    from ..control.analysis import table_header

    analysis = record.get("analysis")
    golden = analysis.get("golden") if isinstance(analysis, dict) else None
    said = [one_line(golden["line"])] if isinstance(golden, dict) and isinstance(golden.get("line"), str) else []
    found = analysis.get("measurements") if isinstance(analysis, dict) else None
    if not isinstance(found, list) or not found:
        return said
    if all(isinstance(m, dict) and isinstance(m.get("row"), str) for m in found):
        return [*said, table_header().strip(), *(one_line(m["row"]).strip() for m in found)]
    return [*said, *(one_line(m["line"]) if isinstance(m, dict) and isinstance(m.get("line"), str)
                     else f"measurement {n}: its line was not recorded" for n, m in enumerate(found, 1))]
