"""``flatshare``'s app and what its command modules share: the options every area takes, and asking the fleet.

Each area of the command line is a module of its own (as Kamal has one CLI file per area): ``profiles``,
``sandbox``, ``nodes`` (bootstrap, doctor), ``hold`` (an operator's hold), ``release`` (release, rollback),
``reports`` (check, status, releases). Argument parsing and exit codes only: what a command does lives in
the package's other parts (docs/architecture.md, "Layout").
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

app = typer.Typer(add_completion=True, pretty_exceptions_enable=False, no_args_is_help=True,
                  rich_markup_mode=None, context_settings={"help_option_names": ["-h", "--help"]},
                  help="Render, release and check Flatshare's GPU serving fleet.")


def _print_version(value: bool) -> None:
    if value:
        from .. import version
        from ..common.protocol import GENERATION, VERSION

        typer.echo(f"flatshare {version()} (bundle protocol {VERSION}, switcher generation {GENERATION})")
        raise typer.Exit(0)


@app.callback()
def _top(version: Annotated[bool, typer.Option("--version", "-V", is_eager=True, callback=_print_version,
                                               help="Print flatshare-ops' version and exit.")] = False) -> None:
    """Render, release and check Flatshare's GPU serving fleet."""

RootOption = Annotated[Path, typer.Option("--root", metavar="DIR", help="The checkout's top directory.")]
ProfileOption = Annotated[
    Optional[Path], typer.Option("--profile", metavar="FILE", help="Profile file, relative to --root.")
]
InventoryOption = Annotated[Optional[Path], typer.Option(
    "--inventory", metavar="FILE", envvar="FLATSHARE_INVENTORY", help="The inventory (default profiles/fleet.toml).")]
NodesOption = Annotated[Optional[list[str]], typer.Option("--node", metavar="NAME",
                                                          help="A node to act on (repeatable).")]


def to_stderr(text: str, nl: bool = True) -> None:
    """``text`` (and a newline) on stderr, for people: a stderr whose reader went away takes nothing, and the
    command's exit code still says what happened (a drift, a refusal), never 141: that is for stdout's reader."""
    try:
        typer.echo(text, nl=nl, err=True)
    except OSError:
        pass


def answer_code(answer: dict) -> int | None:
    """The exit code one node's fleet answer (control/fanout.py ``ask``) stands for: None when it is an answer;
    the node-side command's own code when it ran and said why not (a refusal 3, damage 5); else
    ``Exit.UNREACHABLE`` (the node could not be asked), the same code for the same fact in every command."""
    from ..errors import Exit

    if "error" not in answer:
        return None
    code = answer.get("code")
    return code if isinstance(code, int) and not isinstance(code, bool) and 0 < code < 126 else Exit.UNREACHABLE



def fleet_answers(node, inventory, build):
    from ..config.inventory import inventory_path
    from ..control.fanout import ask
    from ..control.targets import targets

    return ask(targets(inventory_path(inventory), node or [], not node), build)
