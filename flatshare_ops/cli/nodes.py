"""``flatshare node bootstrap`` and ``flatshare doctor``: preparing nodes and checking the way to them."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..errors import FlatshareError
from .app import app, RootOption, InventoryOption, to_stderr


node_app = typer.Typer(no_args_is_help=True, short_help="Prepare nodes for releases.", help="Prepare a node for releases (its node side runs as flatshare-node).")
app.add_typer(node_app, name="node")


@node_app.command("bootstrap", short_help='Prepare a node for its first release.')
def node_bootstrap(
    node: Annotated[str, typer.Option("--node", metavar="NAME", help="The node to bootstrap.")],
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Check and say what would be done; change nothing.")] = False,
    accept_host_key: Annotated[Optional[str], typer.Option(
        "--accept-host-key", metavar="SHA256:...",
        help="The node's host key fingerprint, checked on the node: added to the fleet's known_hosts.")] = None,
    inventory: InventoryOption = None,
    root: RootOption = Path("."),
) -> None:
    """Bring a node from sshd and an engine venv to ready for its first release (idempotent): host key,
    platform, layout, service user, flatshare-ops' node side, engine venv, model, module build.

    Exit 0 when every item is ok or done; 3 when something must be fixed first (each FAIL line says how)."""
    from ..config.inventory import inventory_path
    from ..control.bootstrap import Bootstrap
    from ..control.targets import targets

    if accept_host_key is not None and not re.fullmatch(r"SHA256:[A-Za-z0-9+/]{43}", accept_host_key):
        from ..common.text import one_line

        raise FlatshareError(f"--accept-host-key: {one_line(accept_host_key)!s} is not a fingerprint as "
                             "'ssh-keygen -lf KEY.pub' prints it (SHA256: and 43 base64 characters, no '=')")
    (target,) = targets(inventory_path(inventory), [node], False)
    raise typer.Exit(Bootstrap(target, root, typer.echo, dry_run, accept_host_key).run())


@app.command("doctor", short_help="Check the operator's side and the way to nodes.")
def doctor(inventory: InventoryOption = None, root: RootOption = Path("."),
           as_json: Annotated[bool, typer.Option("--json", help="Print the items as one JSON document on stdout "
                                                                 "(state, item, detail each; the lines go to stderr).")] = False,
           ) -> None:
    """Check the operator's side (inventory, checkout, keys, known_hosts) and each node's reachability, one
    line per item (exit 1 if anything FAILs)."""
    import json

    from ..config.inventory import inventory_path
    from ..control.doctor import doctor as run

    items: list = []
    code = run(root, inventory_path(inventory), to_stderr if as_json else typer.echo,
               items)
    if as_json:
        typer.echo(json.dumps({"code": code, "items": items}, indent=2, sort_keys=True))
    raise typer.Exit(code)
