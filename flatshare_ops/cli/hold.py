"""``flatshare hold place | status | lift``: an operator's hold on a node (node/hold.py).

A hold is a record on the node, not a lock (node/lock.py is the release lock a switch holds).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..errors import Exit, FlatshareError
from .app import app, InventoryOption, NodesOption, answer_code, fleet_answers, to_stderr


hold_app = typer.Typer(no_args_is_help=True, short_help="An operator's hold on a node.", help="An operator's hold on a node: refuses its releases and rollbacks "
                                                   "with a message; not a drain.")
app.add_typer(hold_app, name="hold")

def _hold(node: list[str] | None, inventory: Path | None, **options) -> dict[str, dict]:
    from ..control import commands
    from ..errors import OperatorInterrupted

    try:
        return fleet_answers(node, inventory, lambda t: commands.hold(t.spec, **options))
    except OperatorInterrupted as stop:
        if node and ("acquire" in options or options.get("release")):  # a change asked of one node
            what = "place its hold" if "acquire" in options else "lift its hold"
            stop.said = (f"while {node[0]} was asked to {what}: whether it did is not known; "
                         f"'flatshare hold status --node {node[0]}' says")
        raise


@hold_app.command("place", short_help='Hold a node: its releases are refused.')
def hold_place(
    node: Annotated[str, typer.Option("--node", metavar="NAME", help="The node to hold.")],
    message: Annotated[str, typer.Option("-m", "--message", metavar="TEXT", help="Why (e.g. 'E2 benchmark').")],
    inventory: InventoryOption = None,
) -> None:
    """Hold a node: its releases and rollbacks are refused with your message until 'flatshare hold lift'."""
    import getpass
    import socket

    from ..common.text import hold_message, one_line

    wrong = hold_message(message)
    if wrong:
        raise FlatshareError(f"hold place: -m: {wrong}")
    who = f"{getpass.getuser()}@{socket.gethostname()}"
    if hold_message(who):
        raise FlatshareError(f"hold place: your user@host {one_line(who)} holds a control character; set LOGNAME "
                             "(or USER) to a plain name")
    from ..control.answers import hold_line

    answer = _hold([node], inventory, acquire=message, who=who)[node]
    if "error" in answer or answer.get("held") is not True:
        to_stderr(one_line(f"{node}: {answer.get('error') or answer}"))
        raise typer.Exit(answer_code(answer) or Exit.REFUSED)
    typer.echo(hold_line(node, answer))
    hold = found if isinstance(found := answer.get("hold"), dict) else {}
    running = hold.get("during_release")
    if running:
        typer.echo(one_line(f"{node}: note: a release is switching it now ({running}); the hold does not stop "
                            "that switch, which goes on to its end: it refuses the releases and rollbacks after it"))


@hold_app.command("status", short_help='Who holds each node, and why.')
def hold_status(node: NodesOption = None, inventory: InventoryOption = None,
                as_json: Annotated[bool, typer.Option("--json", help="Print each node's answer as one JSON document "
                                                                      "(node -> its hold, or why it was not asked).")] = False,
                ) -> None:
    """Who holds each node, and why (default: every node)."""
    import json

    from ..control.answers import hold_line

    codes = []
    answers = _hold(node, inventory)
    if as_json:
        typer.echo(json.dumps(answers, indent=2, sort_keys=True))
    for name, answer in answers.items():
        if not as_json:
            typer.echo(hold_line(name, answer))
        if "error" in answer or not isinstance(answer.get("held"), bool):
            codes.append(answer_code(answer) or Exit.UNREACHABLE)
    if codes:  # a node could not be asked (6), or said why not (its code: 5 for a damaged hold record)
        raise typer.Exit(min(codes))


@hold_app.command("lift", short_help="Lift a node's hold.")
def hold_lift(node: Annotated[str, typer.Option("--node", metavar="NAME", help="The node whose hold to lift.")],
                 inventory: InventoryOption = None) -> None:
    """Lift an operator's hold on a node (exit 4 when it was not held)."""
    answer = _hold([node], inventory, release=True)[node]
    if "error" in answer:
        to_stderr(f"{node}: {answer['error']}")
        raise typer.Exit(answer_code(answer) or Exit.UNREACHABLE)
    if not answer.get("lifted"):
        typer.echo(f"{node}: not held; nothing to do")
        raise typer.Exit(4)
    from ..common.wording import hold_phrase

    lifted = answer["lifted"] if isinstance(answer["lifted"], dict) else {}
    if isinstance(lifted.get("damaged"), str):
        from ..common.text import one_line

        typer.echo(one_line(f"{node}: hold lifted: its damaged record was removed ({lifted['damaged']})"))
        return
    typer.echo(f"{node}: hold lifted; it was held by {hold_phrase(lifted)}")
