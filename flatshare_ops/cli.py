"""``flatshare``: the operator's command line. Argument parsing and exit codes only.

Exit codes are :class:`flatshare_ops.errors.Exit`'s (README.md, "Exit
codes"); ``flatshare check`` uses serving-check's Nagios codes. An
operator's error is one line naming the place, the rule and the way out,
never a traceback.
"""

from __future__ import annotations

import re
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
    """Compare the rendered files of production and of every variant (profiles/*.toml) with the checkout
    (exit 1 on drift), or write them with --update. A placeholder module pin is a warning."""
    from .render.checkout import drift, expected_outputs, placeholder_pins, write_outputs

    outputs = expected_outputs(root)
    for warning in placeholder_pins(root):
        typer.echo(f"warning: {warning}", err=True)
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
    from .config.edit import set_value
    from .render.checkout import DEFAULT_PROFILE, expected_outputs, write_outputs

    def report(written: list[Path]) -> None:
        for written_path in written:
            typer.echo(f"wrote {written_path}")

    path = root / (profile or DEFAULT_PROFILE)
    old, new, _ = set_value(path, key, value, then=lambda: write_outputs(root, expected_outputs(root)), echo=report)
    typer.echo(f"{path}: {key}: {_as_toml(old)} -> {_as_toml(new)}")


def _as_toml(value: object) -> str:
    """A value as the profile spells it (``true``, ``"text"``, ``48``); ``(unset)`` for a key that was not set."""
    import tomlkit

    return "(unset)" if value is None else tomlkit.item(value).as_string()


@profiles_app.command("pin-module")
def profiles_pin_module(
    sha256: Annotated[Optional[str], typer.Option("--sha256", metavar="HEX",
                                                   help="The hash a make-room revision publishes.")] = None,
    file: Annotated[Optional[Path], typer.Option("--file", metavar="PATH", help="A built module file.")] = None,
    from_node: Annotated[Optional[str], typer.Option(
        "--from-node", metavar="NAME", help="The module the node built (its engine's last start).")] = None,
    root: RootOption = Path("."),
    profile: ProfileOption = None,
    inventory: Annotated[Optional[Path], typer.Option("--inventory", envvar="FLATSHARE_INVENTORY",
                                                      help="The inventory (with --from-node).")] = None,
) -> None:
    """Pin the serve module's sha256 in a profile (comments kept) and re-render the checkout's files.

    Give exactly one of --sha256, --file, --from-node. The profile is --profile (default production; with
    --from-node, the profile the inventory names for that node)."""
    import hashlib

    from .config.edit import set_value
    from .render.checkout import DEFAULT_PROFILE, expected_outputs, write_outputs

    given = [g for g in (sha256, file, from_node) if g is not None]
    if len(given) != 1:
        raise FlatshareError("profiles pin-module: give exactly one of --sha256 HEX, --file PATH, --from-node NAME")
    path = root / (profile or DEFAULT_PROFILE)
    if file is not None:
        from .common.files import Damaged, read_bytes

        try:
            data = read_bytes(file, allow_symlink=True)  # a fifo or a device is refused, never waited on
        except Damaged as err:
            raise FlatshareError(f"{err}; give the built module file") from None
        if not data:
            raise FlatshareError(f"{file}: {'not found' if data is None else 'empty'}; give the built module file")
        sha256 = hashlib.sha256(data).hexdigest()
    elif from_node is not None:
        sha256, node_profile = _module_on_node(from_node, inventory)
        path = node_profile if profile is None else path
    if not re.fullmatch(r"[0-9a-f]{64}", sha256 or ""):
        raise FlatshareError(f"profiles pin-module: {sha256!r} is not a sha256 (64 lowercase hex digits)")
    old, new, _ = set_value(path, "module.sha256", f'"{sha256}"',
                            then=lambda: write_outputs(root, expected_outputs(root)),
                            echo=lambda written: [typer.echo(f"wrote {p}") for p in written])
    typer.echo(f"{path}: module.sha256: {old} -> {new}")


def _module_on_node(name: str, inventory: Path | None) -> tuple[str, Path]:
    """(sha256 of the module node ``name`` built, the profile file the inventory names for it)."""
    import json as _json

    from .config.inventory import inventory_path
    from .control import commands
    from .control.fleet import ask
    from .control.targets import targets

    (target,) = targets(inventory_path(inventory), [name], False)
    answer = ask([target], lambda t: commands.module(t.spec, t.loaded.profile.module.path))[name]
    if "error" in answer or not isinstance(answer.get("sha256"), str):
        raise FlatshareError(f"profiles pin-module: {name} did not report its module: "
                             f"{answer.get('error') or _json.dumps(answer)}")
    return answer["sha256"], target.profile_path


@profiles_app.command("verify")
def profiles_verify(
    root: RootOption = Path("."),
    profile: ProfileOption = None,
    vllm: Annotated[Optional[Path], typer.Option(
        "--vllm", metavar="VENV",
        help="Also parse the engine's command line with the vLLM installed in VENV (e.g. .venv-vllm), "
             "as a release's preflight does on the node.")] = None,
) -> None:
    """Render the profile's units and check them with systemd-analyze verify (exit 1 on any output);
    with --vllm, also with vLLM's own parser (exit 1 if it rejects the command line). A canary threshold
    the analysis can never decide (ttft_p95_max_s not a vLLM bucket bound) is a warning."""
    from .config.profile import load_profile
    from .control.analysis import threshold_warnings
    from .render import render_profile
    from .render.checkout import DEFAULT_PROFILE
    from .render.units import unit_programs
    from .render.verify import verify_units

    loaded = load_profile(root / (profile or DEFAULT_PROFILE))
    for warning in threshold_warnings(loaded.profile.release.analysis):
        typer.echo(f"warning: {warning}", err=True)
    rendered = render_profile(loaded)
    output = verify_units(rendered.units, unit_programs(loaded.profile))
    if output:
        typer.echo(output, nl=False, err=True)
        typer.echo("profiles: systemd-analyze verify reported the above for the rendered units", err=True)
        raise typer.Exit(1)
    typer.echo(f"{loaded.profile.name}: {len(rendered.units)} units rendered; systemd-analyze verify printed nothing")
    if vllm is not None:
        from .node.preflight import parse_with_venv

        answer = parse_with_venv(vllm, rendered.argv[2:])
        if not answer.get("ok"):
            typer.echo(f"profiles: vLLM in {vllm} rejects the engine's command line: {answer.get('error')}", err=True)
            raise typer.Exit(1)
        typer.echo(f"{loaded.profile.name}: vLLM's own parser in {vllm} reads the engine's command line")


@app.command("check")
def check(
    all_nodes: Annotated[bool, typer.Option("--all", help="Check every inventory node.")] = False,
    node: Annotated[Optional[list[str]], typer.Option("--node", help="Check this node (repeatable).")] = None,
    inventory: Annotated[Optional[Path], typer.Option("--inventory", envvar="FLATSHARE_INVENTORY",
                                                      help="The inventory (default profiles/fleet.toml).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", help="Print nothing for nodes that are OK.")] = False,
) -> None:
    """Run serving-check on inventory nodes over SSH and print each node's result (Nagios exit codes).

    Every node gets a line; a node that cannot be reached or is slow is UNKNOWN by name."""
    import json as _json

    from .check.report import EXIT_CODES, UNKNOWN, Finding, Report, nagios_text, worst
    from .config.inventory import inventory_path
    from .control import commands
    from .control.fleet import ask
    from .control.targets import targets

    try:
        chosen = targets(inventory_path(inventory), node or [], not node)
    except FlatshareError as err:
        typer.echo(f"SERVING-CHECK UNKNOWN - {err}")
        raise typer.Exit(3)
    reports = []
    for name, answer in ask(chosen, lambda t: commands.serving_check(t.spec)).items():
        try:
            reports.append(Report.from_json(answer))
        except (KeyError, TypeError, ValueError):
            reports.append(Report(name, [Finding("ssh", UNKNOWN, str(answer.get("error") or answer))]))
    if as_json:
        typer.echo(_json.dumps({r.node: r.to_json() for r in reports}, indent=2, sort_keys=True))
    else:
        for report in reports:
            if not (quiet and report.status == "OK"):
                typer.echo(nagios_text(report), nl=False)
    raise typer.Exit(EXIT_CODES[worst(r.status for r in reports)])


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
    system_scope: Annotated[Optional[list[str]], typer.Option(
        "--system-scope", help="A node reached on the system-scope path, through a bus of its own (repeatable).")] = None,
    bare: Annotated[Optional[list[str]], typer.Option(
        "--bare", help="A fresh node: sshd, its manager and an engine venv only; bootstrap it (repeatable).")] = None,
) -> None:
    """Bring the sandbox up (idempotent): managers, sshd, layout, stand-ins; install and start the units."""
    from .render.checkout import DEFAULT_PROFILE
    from .sandbox.fleet import parse_addresses, up

    inventory = up(directory, root / (profile or DEFAULT_PROFILE), parse_addresses(addresses), echo=typer.echo,
                   system_scope=tuple(system_scope or ()), bare=tuple(bare or ()))
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


@sandbox_app.command("reboot")
def sandbox_reboot(
    node: Annotated[str, typer.Option("--node", help="The sandbox node to reboot.")],
    directory: SandboxDir = Path(".sandbox"),
) -> None:
    """Reboot a sandbox node's systemd (stop its manager, clear its runtime dir, start it): what is enabled comes up."""
    from .sandbox.fleet import reboot

    reboot(directory, node, echo=typer.echo)


@sandbox_app.command("down")
def sandbox_down(directory: SandboxDir = Path(".sandbox")) -> None:
    """Stop every process the sandbox started (by process id)."""
    from .sandbox.fleet import down

    down(directory, echo=typer.echo)
    typer.echo("sandbox down")


InventoryOption = Annotated[Optional[Path], typer.Option(
    "--inventory", envvar="FLATSHARE_INVENTORY", help="The inventory (default profiles/fleet.toml).")]
NodesOption = Annotated[Optional[list[str]], typer.Option("--node", help="A node to act on (repeatable).")]


node_app = typer.Typer(no_args_is_help=True, help="Prepare a node for releases (its node side runs as flatshare-node).")
app.add_typer(node_app, name="node")


@node_app.command("bootstrap")
def node_bootstrap(
    node: Annotated[str, typer.Option("--node", help="The node to bootstrap.")],
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
    from .config.inventory import inventory_path
    from .control.bootstrap import Bootstrap
    from .control.targets import targets

    if accept_host_key is not None and not re.fullmatch(r"SHA256:[A-Za-z0-9+/]{43}", accept_host_key):
        from .common.text import one_line

        raise FlatshareError(f"--accept-host-key: {one_line(accept_host_key)!s} is not a fingerprint as "
                             "'ssh-keygen -lf KEY.pub' prints it (SHA256: and 43 base64 characters, no '=')")
    (target,) = targets(inventory_path(inventory), [node], False)
    raise typer.Exit(Bootstrap(target, root, typer.echo, dry_run, accept_host_key).run())


@app.command("doctor")
def doctor(inventory: InventoryOption = None, root: RootOption = Path(".")) -> None:
    """Check the operator's side (inventory, checkout, keys, known_hosts) and each node's reachability, one
    line per item (exit 1 if anything FAILs)."""
    from .config.inventory import inventory_path
    from .control.doctor import doctor as run

    raise typer.Exit(run(root, inventory_path(inventory), typer.echo))


lock_app = typer.Typer(no_args_is_help=True, help="An operator's hold on a node: refuses its releases and rollbacks "
                                                   "with a message; not a drain.")
app.add_typer(lock_app, name="lock")


def _hold(node: list[str] | None, inventory: Path | None, **options) -> dict[str, dict]:
    from .control import commands

    return _fleet_answers(node, inventory, lambda t: commands.hold(t.spec, **options))


@lock_app.command("acquire")
def lock_acquire(
    node: Annotated[str, typer.Option("--node", help="The node to hold.")],
    message: Annotated[str, typer.Option("-m", "--message", help="Why (e.g. 'E2 benchmark').")],
    inventory: InventoryOption = None,
) -> None:
    """Hold a node: its releases and rollbacks are refused with your message until 'flatshare lock release'."""
    import getpass
    import socket

    from .common.text import hold_message, one_line

    wrong = hold_message(message)
    if wrong:
        raise FlatshareError(f"lock acquire: -m: {wrong}")
    who = f"{getpass.getuser()}@{socket.gethostname()}"
    if hold_message(who):
        raise FlatshareError(f"lock acquire: your user@host {one_line(who)} holds a control character; set LOGNAME "
                             "(or USER) to a plain name")
    answer = _hold([node], inventory, acquire=message, who=who)[node]
    if "error" in answer or not answer.get("held"):
        typer.echo(f"{node}: {answer.get('error') or answer}", err=True)
        raise typer.Exit(3)
    typer.echo(f"{node}: held by {answer['hold']['who']}: {answer['hold']['message']}")  # checked above
    running = answer["hold"].get("during_release")
    if running:
        typer.echo(one_line(f"{node}: note: a release is switching it now ({running}); the hold does not stop "
                            "that switch, which goes on to its end: it refuses the releases and rollbacks after it"))


@lock_app.command("status")
def lock_status(node: NodesOption = None, inventory: InventoryOption = None) -> None:
    """Who holds each node, and why (default: every node)."""
    from .common.clock import is_time, utc_stamp
    from .common.text import one_line

    unknown = False
    for name, answer in _hold(node, inventory).items():
        if "error" in answer:
            typer.echo(f"{name}: UNKNOWN: {answer['error']}")
            unknown = True
        elif answer.get("held"):
            hold = answer["hold"]
            since = f" since {utc_stamp(hold['since'])}" if is_time(hold.get("since")) else ""
            typer.echo(one_line(f"{name}: held by {hold.get('who', 'someone (not recorded)')}{since}: "
                                f"{hold.get('message', '(no message)')}"))
        else:
            typer.echo(f"{name}: not held")
    if unknown:
        raise typer.Exit(6)  # a node could not be asked: "not held" is not known of it


@lock_app.command("release")
def lock_release(node: Annotated[str, typer.Option("--node", help="The node to release.")],
                 inventory: InventoryOption = None) -> None:
    """Lift an operator's hold on a node (exit 4 when it was not held)."""
    answer = _hold([node], inventory, release=True)[node]
    if "error" in answer:
        typer.echo(f"{node}: {answer['error']}", err=True)
        raise typer.Exit(6)
    if not answer.get("lifted"):
        typer.echo(f"{node}: not held; nothing to do")
        raise typer.Exit(4)
    typer.echo(f"{node}: hold lifted ({answer['lifted'].get('message')})")


def _on_signals() -> None:
    """Ctrl-C and SIGTERM stop the operator's side only (nodes finish what they do): see control.rollout."""
    import signal

    from .control.rollout import OperatorInterrupted
    from .errors import Exit

    def stop(signum, _frame):
        raise OperatorInterrupted(Exit.INTERRUPTED if signum == signal.SIGINT else Exit.TERMINATED)

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)


@app.command("release")
def release(
    node: NodesOption = None,
    all_nodes: Annotated[bool, typer.Option("--all", help="Every inventory node, one batch at a time.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan and any refusal; change nothing.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Release even with E2 drop-ins linked (recorded).")] = False,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Nodes switched at once.")] = 1,
    no_auto_rollback: Annotated[bool, typer.Option(
        "--no-auto-rollback", help="A node whose new engine does not serve stays failed (the profile's "
        "release.auto_rollback otherwise rolls it back by itself).")] = False,
    inventory: InventoryOption = None,
    root: RootOption = Path("."),
) -> None:
    """Switch nodes to what the checkout renders (without --node or --all: the node this runs on).

    Exit codes: 0 released, 1 failed mid-switch, 2 bad input, 3 refused, 4 nothing to do, 5 damaged node
    state, 6 unreachable, 7 still switching, 8 systemd did not answer, 9 rolled back automatically,
    130/143 interrupted."""
    from .config.inventory import inventory_path
    from .control.rollout import Rollout, refuse_drift, refuse_placeholder_pins, terminal, warn_uncommitted
    from .control.targets import fleet, targets

    out = terminal()
    refuse_drift(root)
    path = inventory_path(inventory)
    chosen = targets(path, node or [], all_nodes)
    refuse_placeholder_pins(chosen)
    warn_uncommitted(root, out)  # only for a release that goes ahead
    _on_signals()
    raise typer.Exit(Rollout(root, chosen, fleet(path, chosen), out, force=force, dry_run=dry_run,
                             batch_size=batch_size, auto_rollback=not no_auto_rollback).run())


@app.command("rollback")
def rollback(
    node: NodesOption = None,
    all_nodes: Annotated[bool, typer.Option(
        "--all", help="Undo the fleet's last rollout: each node it switched goes back to what it ran before.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan and any refusal; change nothing.")] = False,
    inventory: InventoryOption = None,
    root: RootOption = Path("."),
) -> None:
    """Switch nodes back: each to the last release that served before its current one; with --all, the
    fleet to what it ran before its last rollout (a failed or interrupted node first)."""
    from .config.inventory import inventory_path
    from .control.rollout import Rollout, terminal
    from .control.targets import fleet, targets

    out = terminal()
    path = inventory_path(inventory)
    chosen = targets(path, node or [], all_nodes)
    everyone = fleet(path, chosen)
    _on_signals()
    if not all_nodes:
        raise typer.Exit(Rollout(root, chosen, everyone, out, mode="rollback", dry_run=dry_run).run())
    undo, order = _last_rollout(chosen, out)
    if undo is None:
        out.line("rollback: no node records a rollout to undo; nothing to do")
        raise typer.Exit(4)
    raise typer.Exit(Rollout(root, order, everyone, out, mode="undo-rollout", dry_run=dry_run, undo=undo).run())


def _last_rollout(chosen, out):
    """(the fleet's last rollout, the nodes in the order to undo it: failed or interrupted first)."""
    from .control import commands
    from .control.fleet import ask
    from .control.rollout import last_rollout

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
        return bool(statuses.get(target.name, {}).get("switching")) or last.get("result") in ("failed", "abandoned")

    return undo, sorted(chosen, key=lambda t: not troubled(t))


def _fleet_answers(node, inventory, build):
    from .config.inventory import inventory_path
    from .control.fleet import ask
    from .control.targets import targets

    return ask(targets(inventory_path(inventory), node or [], not node), build)


@app.command("status")
def status(
    node: NodesOption = None,
    inventory: InventoryOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Each node's active release, any switch in progress or unfinished, its units' states (default: every node).

    Exit 5 when a node's state is damaged (a file named under "damaged", a history line skipped included);
    else 1 when a node is unreachable, has an unfinished switch, a unit that is not active, or a voice drain
    file left with no release running."""
    import json as _json

    from .control import commands

    reports = _fleet_answers(node, inventory, lambda t: commands.status(t.spec))
    healthy = all("error" not in r and not r.get("switching") and not r.get("damaged") and not r.get("drain_left")
                  and r.get("units") and set(r["units"].values()) == {"active"} for r in reports.values())
    damaged = any("error" not in r and r.get("damaged") for r in reports.values())
    code = 0 if healthy else 5 if damaged else 1
    if as_json:
        typer.echo(_json.dumps(reports, indent=2, sort_keys=True))
        raise typer.Exit(code)
    for name, report in reports.items():
        if "error" in report:
            typer.echo(f"{name}: UNKNOWN: {report['error']}")
            continue
        units = ", ".join(f"{u} {s}" for u, s in report.get("units", {}).items()) or \
            f"units unknown ({report.get('systemd')})"
        switching = report.get("switching")
        if switching and report.get("in_progress"):
            switching = f"IN PROGRESS ({report['in_progress']}): {switching}"
        elif switching:
            switching = f"UNFINISHED {switching}"
        elif report.get("in_progress"):
            switching = f"IN PROGRESS ({report['in_progress']})"
        typer.echo(f"{name}: release {report.get('release')}; " + (f"{switching}; " if switching else "") + units)
        if report.get("drain_left"):
            typer.echo(f"  not taking calls: {report['drain_left']}")
        for damage in report.get("damaged", []):
            typer.echo(f"  damaged: {damage}")
    raise typer.Exit(code)


@app.command("releases")
def releases(node: NodesOption = None, inventory: InventoryOption = None) -> None:
    """The release history of each node (default: every node): what ran, what failed, what was rolled back.

    Exit 1 when a node's history could not be read (it is printed as UNKNOWN by name)."""
    from .common.clock import is_duration, is_time, utc_stamp
    from .control import commands

    unknown = False
    for name, answer in _fleet_answers(node, inventory, lambda t: commands.history(t.spec)).items():
        typer.echo(f"{name}:")
        if "error" in answer:
            typer.echo(f"  UNKNOWN: {answer['error']}")
            unknown = True
            continue
        for note in answer.get("skipped", []):
            typer.echo(f"  note: {note}")
        if answer.get("disorder"):
            typer.echo(f"  damaged: {answer['disorder']}: a rollback of {name} is refused until the lines are in "
                       "order (or the file is moved aside)")
        for r in answer.get("records", []):
            typer.echo(f"  {_history_line(r, is_time, is_duration, utc_stamp)}")
    raise typer.Exit(1 if unknown else 0)


def _history_line(r: dict, is_time, is_duration, utc_stamp) -> str:
    """One history record for people: when, from -> to, what, (how long, by whom, rollout, forced); what a
    record does not say is left out, never printed as None."""
    started = r.get("started_at")
    when = utc_stamp(started) if is_time(started) else "(start not recorded)"
    what = r.get("result")
    if what == "failed":
        what = f"failed at {r.get('step') or 'an unnamed step'}: {r.get('reason') or 'no reason recorded'}"
    details = []
    if is_duration(r.get("duration_s")):
        details.append(f"{r['duration_s']:g} s")
    if isinstance(r.get("user"), str) and isinstance(r.get("host"), str):
        details.append(f"by {r['user']}@{r['host']}")
    if r.get("rollout"):
        details.append(f"rollout {r['rollout']}")
    if r.get("forced"):
        details.append("forced")
    return (f"{when} {r.get('before') or '(none)'} -> {r.get('target') or '(none)'}: {what}"
            + (f" ({', '.join(details)})" if details else ""))


def main() -> None:
    """Console-script entry point: run the app, turning operator errors into one line and an exit code."""
    try:
        app()
    except FlatshareError as err:
        print(f"flatshare: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
