"""``flatshare``: the operator's command line. Argument parsing and exit codes only.

Exit codes: 0 success; 1 drift, failed verification, or a release failed
mid-switch (journal kept); 2 bad input (a one-line message naming the file,
line, key and rule, no traceback); 3 refused; 4 nothing to do. ``flatshare
check`` uses the Nagios codes of serving-check.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from .errors import FlatshareError

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, no_args_is_help=True,
                  rich_markup_mode=None,
                  help="Render, release and check Flatshare's GPU serving fleet.")
profiles_app = typer.Typer(no_args_is_help=True, help="The serving profile and the files it renders.")
app.add_typer(profiles_app, name="profiles")

RootOption = Annotated[Path, typer.Option("--root", help="The checkout's top directory.")]
ProfileOption = Annotated[
    Optional[Path], typer.Option("--profile", help="Profile file, relative to --root.")
]


@profiles_app.command("render")
def profiles_render(
    update: Annotated[bool, typer.Option("--update", help="Write the files that drifted.")] = False,
    root: RootOption = Path("."),
) -> None:
    """Compare the production profile's rendered files with the checkout (exit 1 on drift), or write them
    with --update. (Other profiles, such as variants, are checked with 'flatshare profiles verify --profile'.)"""
    from .repo import drift, expected_outputs, write_outputs

    outputs = expected_outputs(root)
    if update:
        for path in write_outputs(root, outputs):
            typer.echo(f"wrote {path}")
        return
    diffs = drift(root, outputs)
    if diffs:
        for diff in diffs.values():
            typer.echo(diff, nl=False)
        typer.echo(
            f"profiles: {len(diffs)} rendered file(s) differ from the profile; "
            "run 'make profiles UPDATE=1' to rewrite them",
            err=True,
        )
        raise typer.Exit(1)


@profiles_app.command("set", context_settings={"ignore_unknown_options": True})
def profiles_set(
    key: Annotated[str, typer.Argument(metavar="KEY", help="Dotted key, e.g. engine.make_room.decode_hold_tokens.")],
    value: Annotated[str, typer.Argument(metavar="VALUE", help="TOML value (48, true, 0.5, \"text\"); bare words are strings.")],
    root: RootOption = Path("."),
    profile: ProfileOption = None,
) -> None:
    """Set one profile value (comments and layout kept), validate, and render the checkout's files.

    Nothing is written unless the edited profile validates and every rendered file can be produced."""
    from .profile_edit import set_value
    from .repo import DEFAULT_PROFILE, expected_outputs, write_outputs

    def report(written: list[Path]) -> None:
        for written_path in written:
            typer.echo(f"wrote {written_path}")

    path = root / (profile or DEFAULT_PROFILE)
    old, new, _ = set_value(path, key, value, then=lambda: write_outputs(root, expected_outputs(root)), echo=report)
    typer.echo(f"{path}: {key}: {old!r} -> {new!r}")


@profiles_app.command("verify")
def profiles_verify(root: RootOption = Path("."), profile: ProfileOption = None) -> None:
    """Render the profile's units and check them with systemd-analyze verify (exit 1 on any output)."""
    from .profile import load_profile
    from .render import render_profile
    from .render.units import unit_programs
    from .repo import DEFAULT_PROFILE
    from .verify import verify_units

    loaded = load_profile(root / (profile or DEFAULT_PROFILE))
    rendered = render_profile(loaded)
    output = verify_units(rendered.units, unit_programs(loaded.profile))
    if output:
        typer.echo(output, nl=False, err=True)
        typer.echo("profiles: systemd-analyze verify reported the above for the rendered units", err=True)
        raise typer.Exit(1)
    typer.echo(f"{loaded.profile.name}: {len(rendered.units)} units rendered; systemd-analyze verify printed nothing")


@app.command("check")
def check(
    all_nodes: Annotated[bool, typer.Option("--all", help="Check every inventory node.")] = False,
    node: Annotated[Optional[list[str]], typer.Option("--node", help="Check this node (repeatable).")] = None,
    inventory: Annotated[Optional[Path], typer.Option("--inventory", envvar="FLATSHARE_INVENTORY",
                                                      help="The inventory (default profiles/fleet.toml).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", help="Print nothing for nodes that are OK.")] = False,
) -> None:
    """Run serving-check on inventory nodes over SSH and print each node's result (Nagios exit codes)."""
    from .check_cli import main as serving_check

    argv = ["--all"] if all_nodes or not node else [a for n in node for a in ("--node", n)]
    argv += ["--inventory", str(inventory)] if inventory else []
    argv += ["--json"] if as_json else []
    argv += ["--quiet"] if quiet else []
    serving_check(argv)


sandbox_app = typer.Typer(no_args_is_help=True, help="The local two-node sandbox fleet (cyan, peacock).")
app.add_typer(sandbox_app, name="sandbox")
SandboxDir = Annotated[Path, typer.Option("--dir", help="The sandbox directory.")]


@sandbox_app.command("up")
def sandbox_up(
    directory: SandboxDir = Path(".sandbox"),
    root: RootOption = Path("."),
    profile: ProfileOption = None,
    addresses: Annotated[Optional[str], typer.Option(
        "--addresses", envvar="FLATSHARE_SANDBOX_ADDRESSES",
        help="Node loopback addresses, e.g. cyan=127.0.0.2,peacock=127.0.0.3 (the default).")] = None,
) -> None:
    """Bring the sandbox up (idempotent): managers, sshd, layout, stand-ins; install and start the units."""
    from .repo import DEFAULT_PROFILE
    from .sandbox.fleet import parse_addresses, up

    inventory = up(directory, root / (profile or DEFAULT_PROFILE), parse_addresses(addresses), echo=typer.echo)
    typer.echo(f"sandbox up: inventory {inventory}")


@sandbox_app.command("status")
def sandbox_status(
    directory: SandboxDir = Path(".sandbox"),
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """What runs on each sandbox node (exit 1 if anything is down)."""
    import json

    from .sandbox.fleet import status

    report = status(directory)
    if as_json:
        typer.echo(json.dumps(report, indent=2, sort_keys=True))
    else:
        if not report:
            typer.echo("sandbox: not up (run 'flatshare sandbox up')")
        for node, entry in report.items():
            units = ", ".join(f"{name} {state}" for name, state in entry["units"].items()) or "no units"
            typer.echo(
                f"{node}: manager {'up' if entry['manager'] else 'DOWN'}, sshd {'up' if entry['sshd'] else 'DOWN'}; "
                f"{units}; engine pid {entry['engine_pid']}, /health {entry['engine_health']}"
            )
    healthy = bool(report) and all(
        e["manager"] and e["sshd"] and e["engine_health"] == 200 and set(e["units"].values()) == {"active"}
        for e in report.values()
    )
    raise typer.Exit(0 if healthy else 1)


@sandbox_app.command("down")
def sandbox_down(directory: SandboxDir = Path(".sandbox")) -> None:
    """Stop every process the sandbox started (by process id)."""
    from .sandbox.fleet import down

    down(directory, echo=typer.echo)
    typer.echo("sandbox down")


InventoryOption = Annotated[Optional[Path], typer.Option(
    "--inventory", envvar="FLATSHARE_INVENTORY", help="The inventory (default profiles/fleet.toml).")]
NodesOption = Annotated[Optional[list[str]], typer.Option("--node", help="A node to act on (repeatable).")]


@app.command("release")
def release(
    node: NodesOption = None,
    all_nodes: Annotated[bool, typer.Option("--all", help="Every inventory node, one batch at a time.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan; change nothing.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Release even with E2 drop-ins linked (recorded).")] = False,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Nodes switched at once.")] = 1,
    inventory: InventoryOption = None,
    root: RootOption = Path("."),
) -> None:
    """Switch nodes to what the checkout renders (without --node: the node this runs on).

    Exit codes: 0 released, 1 failed mid-switch (journal kept), 2 bad input, 3 refused, 4 nothing to do."""
    from .inventory import inventory_path
    from .rollout import refuse_drift, roll, targets, terminal, warn_uncommitted

    out = terminal()
    refuse_drift(root, out)
    warn_uncommitted(root, out)
    path = inventory_path(inventory)
    chosen = targets(path, node or [], all_nodes)
    everyone = targets(path, [], True) if not chosen[0].local else chosen
    raise typer.Exit(roll(root, chosen, everyone, out, force=force, dry_run=dry_run, batch_size=batch_size))


@app.command("rollback")
def rollback(
    node: NodesOption = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan; change nothing.")] = False,
    inventory: InventoryOption = None,
    root: RootOption = Path("."),
) -> None:
    """Switch nodes back to the release their active one replaced."""
    from .inventory import inventory_path
    from .rollout import roll, targets, terminal

    path = inventory_path(inventory)
    chosen = targets(path, node or [], False)
    everyone = targets(path, [], True) if not chosen[0].local else chosen
    raise typer.Exit(roll(root, chosen, everyone, terminal(), dry_run=dry_run, rollback=True))


def _node_reports(node: list[str] | None, inventory: Path | None, command: str) -> dict[str, object]:
    import json as _json

    from .inventory import inventory_path
    from .rollout import run_on_node, targets

    reports: dict[str, object] = {}
    for target in targets(inventory_path(inventory), node or [], not node):
        lines: list[str] = []
        try:
            status = run_on_node(target, target.node_argv(command, "--json"), "", lines.append)
        except FlatshareError as err:  # one unreachable node must not hide the others
            reports[target.name] = {"error": str(err)}
            continue
        try:
            reports[target.name] = _json.loads("\n".join(lines))
        except ValueError:
            reports[target.name] = {"error": f"exit {status}: {' '.join(lines[-1:])}"}
    return reports


@app.command("status")
def status(
    node: NodesOption = None,
    inventory: InventoryOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Each node's active release, any unfinished switch, and its units' states (default: every node).

    Exit 1 when a node is unreachable, has an unfinished switch or a unit that is not active."""
    import json as _json

    reports = _node_reports(node, inventory, "status")
    healthy = all("error" not in r and not r["switching"] and set(r["units"].values()) == {"active"}
                  for r in reports.values())
    if as_json:
        typer.echo(_json.dumps(reports, indent=2, sort_keys=True))
        raise typer.Exit(0 if healthy else 1)
    for name, report in reports.items():
        if "error" in report:
            typer.echo(f"{name}: {report['error']}")
            continue
        units = ", ".join(f"{u} {s}" for u, s in report["units"].items())
        switching = report["switching"]
        if switching and report.get("in_progress"):
            switching = f"IN PROGRESS ({report['in_progress']}): {switching}"
        elif switching:
            switching = f"UNFINISHED {switching}"
        typer.echo(f"{name}: release {report['release']}; " + (f"{switching}; " if switching else "") + units)
    raise typer.Exit(0 if healthy else 1)


@app.command("releases")
def releases(node: NodesOption = None, inventory: InventoryOption = None) -> None:
    """The release history of each node (default: every node)."""
    import time as _time

    for name, history in _node_reports(node, inventory, "history").items():
        typer.echo(f"{name}:")
        if isinstance(history, dict):
            typer.echo(f"  {history.get('error')}")
            continue
        for r in history:
            when = _time.strftime("%Y-%m-%d %H:%M:%S", _time.gmtime(r.get("started_at", 0)))
            typer.echo(f"  {when}Z {r.get('from')} -> {r.get('to')}: {r.get('result')} "
                       f"({r.get('duration_s')} s, by {r.get('user')}@{r.get('host')}"
                       + (", forced" if r.get("forced") else "") + ")")


node_app = typer.Typer(no_args_is_help=True, help="Node-side commands (run on a node by release/status over SSH).")
app.add_typer(node_app, name="node")
NodeName = Annotated[str, typer.Option("--node", help="This node's name.")]
StateDir = Annotated[Path, typer.Option("--state-dir", help="The node's state directory.")]
Scope = Annotated[str, typer.Option("--scope", help="system or user (its systemd manager).")]
RuntimeDir = Annotated[Optional[Path], typer.Option("--runtime-dir", help="A user manager's XDG_RUNTIME_DIR.")]


def _ctx(node: str, state_dir: Path, scope: str, runtime_dir: Path | None):
    from .release import NodeContext
    from .systemd import ManagerAddress

    if scope not in ("system", "user"):
        raise typer.BadParameter("--scope must be system or user")
    return NodeContext(node, state_dir, ManagerAddress(scope, runtime_dir))


@node_app.command("switch")
def node_switch(
    node: NodeName, state_dir: StateDir, scope: Scope = "system", runtime_dir: RuntimeDir = None,
    bundle: Annotated[Optional[str], typer.Option("--bundle", help="'-': read the release as JSON on stdin.")] = None,
    force: Annotated[bool, typer.Option("--force")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run")] = False,
    rollback_: Annotated[bool, typer.Option("--rollback")] = False,
) -> None:
    """Switch this node to the release given on stdin (or back, with --rollback)."""
    import json as _json

    from .output import ReleaseOutput
    from .release import log_path, switch_node

    ctx = _ctx(node, state_dir, scope, runtime_dir)
    payload = None
    if bundle == "-":
        try:
            payload = _json.loads(sys.stdin.read())
        except ValueError:
            raise FlatshareError('node switch: stdin is not JSON; expected a release bundle {"id", "files"}') from None
    elif not rollback_:
        raise FlatshareError("node switch: give --bundle - (the release on stdin) or --rollback")
    ctx.releases.mkdir(parents=True, exist_ok=True)
    out = ReleaseOutput(None if dry_run else log_path(ctx))
    out.watch_hangup()
    try:
        code = switch_node(ctx, payload, out, force=force, dry_run=dry_run, rollback=rollback_)
    except FlatshareError as err:
        out.line(f"flatshare: {err}")
        code = err.exit_code
    finally:
        out.close()
    raise typer.Exit(code)


@node_app.command("status")
def node_status_cmd(node: NodeName, state_dir: StateDir, scope: Scope = "system", runtime_dir: RuntimeDir = None,
                    as_json: Annotated[bool, typer.Option("--json")] = True) -> None:
    """This node's status as JSON."""
    import json as _json

    from .release import node_status

    typer.echo(_json.dumps(node_status(_ctx(node, state_dir, scope, runtime_dir)), sort_keys=True))


@node_app.command("history")
def node_history(node: NodeName, state_dir: StateDir, scope: Scope = "system", runtime_dir: RuntimeDir = None,
                 as_json: Annotated[bool, typer.Option("--json")] = True) -> None:
    """This node's release history as JSON."""
    import json as _json

    from .release import read_history

    typer.echo(_json.dumps(read_history(_ctx(node, state_dir, scope, runtime_dir))))


def main() -> None:
    """Console-script entry point: run the app, turning operator errors into one line and an exit code."""
    try:
        app()
    except FlatshareError as err:
        print(f"flatshare: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
