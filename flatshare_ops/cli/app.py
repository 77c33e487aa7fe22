"""``flatshare``'s app and what its command modules share: the options every area takes, and asking the fleet.

Each area of the command line is a module of its own (as Kamal has one CLI file per area): ``profiles``,
``sandbox``, ``nodes`` (bootstrap, doctor), ``hold`` (an operator's hold), ``release`` (release, rollback),
``reports`` (check, status, releases). Argument parsing and exit codes only: what a command does lives in
the package's other parts (README.md, "Layout").
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, no_args_is_help=True,
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

RootOption = Annotated[Path, typer.Option("--root", help="The checkout's top directory.")]
ProfileOption = Annotated[
    Optional[Path], typer.Option("--profile", help="Profile file, relative to --root.")
]
InventoryOption = Annotated[Optional[Path], typer.Option(
    "--inventory", envvar="FLATSHARE_INVENTORY", help="The inventory (default profiles/fleet.toml).")]
NodesOption = Annotated[Optional[list[str]], typer.Option("--node", help="A node to act on (repeatable).")]



def fleet_answers(node, inventory, build):
    from ..config.inventory import inventory_path
    from ..control.fanout import ask
    from ..control.targets import targets

    return ask(targets(inventory_path(inventory), node or [], not node), build)
