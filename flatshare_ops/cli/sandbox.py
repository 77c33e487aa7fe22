"""``flatshare sandbox up | status | reboot | down``: the local sandbox fleet."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from .app import app, RootOption, ProfileOption


sandbox_app = typer.Typer(no_args_is_help=True, short_help="The local sandbox fleet.", help="The local two-node sandbox fleet (cyan, peacock).")
app.add_typer(sandbox_app, name="sandbox")
SandboxDir = Annotated[Path, typer.Option("--dir", metavar="DIR", help="The sandbox directory.")]


def sandbox_installed() -> None:
    """Every sandbox command calls this first: it needs the sandbox package, which a node's install leaves out
    (control/wheels.py ``OPERATOR_ONLY``); its ``--help`` (answered before the command runs) does not.

    Raises:
        FlatshareError: it is not installed here (exit 2, one line saying where the sandbox runs), or it is there
            but does not import (a file of it damaged, a library it needs missing: one line saying so).
    """
    from importlib import import_module
    from importlib.util import find_spec

    from ..errors import FlatshareError

    def broken(module: str, why: str) -> FlatshareError:
        return FlatshareError(f"this install's sandbox does not import ({module}: {why[:200]}): install it again "
                              "with 'make setup' in the checkout")

    def ours(err: ModuleNotFoundError) -> bool:  # the sandbox's own module missing, not a library it imports
        return err.name is not None and (err.name + ".").startswith("flatshare_ops.sandbox.")

    try:  # a module of it, not the package: a leftover empty flatshare_ops/sandbox/ is no sandbox
        package = find_spec("flatshare_ops.sandbox")
        found = package is not None and find_spec("flatshare_ops.sandbox.fleet") is not None
    except ModuleNotFoundError as err:  # flatshare_ops.sandbox is no package (a sandbox.py), or a library is missing
        if not ours(err):
            raise broken("flatshare_ops.sandbox", f"{type(err).__name__}: {err}") from None
        package, found = None, False
    except Exception as err:  # finding it imports the package, and that raised
        raise broken("flatshare_ops.sandbox", f"{type(err).__name__}: {err}") from None
    if not found:
        from pkgutil import iter_modules

        if package is not None and any(iter_modules(package.submodule_search_locations or [])):
            raise broken("flatshare_ops.sandbox.fleet", "it is missing beside the sandbox's other modules")
        raise FlatshareError("this install of flatshare-ops has no sandbox (a node's install leaves it out): run "
                             "'flatshare sandbox' from a checkout, after 'make setup'")
    for module, names in NEEDED.items():
        try:
            loaded = import_module(module)
        except Exception as err:  # any error of its import: the sandbox cannot run, whatever it is
            raise broken(module, f"{type(err).__name__}: {err}") from None
        missing = [name for name in names if not callable(getattr(loaded, name, None))]
        if missing:
            raise broken(module, f"it has no {', '.join(missing)}")


#: What the sandbox commands use of each sandbox module (checked before any of them runs).
NEEDED = {"flatshare_ops.sandbox.fleet": ("parse_addresses", "up", "status", "reboot", "down"),
          "flatshare_ops.sandbox.machines": ("up", "status", "reboot", "down")}


@sandbox_app.command("up", short_help='Bring the sandbox fleet up.')
def sandbox_up(
    directory: SandboxDir = Path(".sandbox"),
    root: RootOption = Path("."),
    profile: ProfileOption = None,
    addresses: Annotated[Optional[str], typer.Option(
        "--addresses", metavar="NAME=ADDRESS,...", envvar="FLATSHARE_SANDBOX_ADDRESSES",
        help="Node loopback addresses, e.g. cyan=127.0.0.2,peacock=127.0.0.3 (the default).")] = None,
    system_scope: Annotated[Optional[list[str]], typer.Option(
        "--system-scope", metavar="NAME", help="A node reached on the system-scope path, through a bus of its own (repeatable).")] = None,
    bare: Annotated[Optional[list[str]], typer.Option(
        "--bare", metavar="NAME", help="A fresh node: sshd, its manager and an engine venv only; bootstrap it (repeatable).")] = None,
    engine: Annotated[Optional[str], typer.Option(
        "--engine", metavar="vllm|stand-in", help="vllm (vLLM 0.32.0's real CPU engine, .venv-vllm; the default for a new sandbox) or "
                         "stand-in (starts in a second); default: what the sandbox was brought up with.")] = None,
    machines: Annotated[bool, typer.Option(
        "--machines", help="Each node a Debian 12 machine booted by systemd-nspawn (systemd as PID 1, production's "
                           "layout and units, the real engine), with step 1 of PRODUCTION.md's runbook only: "
                           "bootstrap them. Default addresses cyan=127.0.60.2,peacock=127.0.60.3.")] = False,
) -> None:
    """Bring the sandbox up (idempotent): managers, sshd, each node's layout and profile, bootstrapped with no
    release: the first release is the real one ('flatshare release --all --inventory DIR/fleet.toml')."""
    sandbox_installed()
    from ..render.checkout import DEFAULT_PROFILE
    from ..sandbox.fleet import parse_addresses, up

    if machines:
        from ..sandbox import machines as machine_nodes

        if system_scope or bare or engine not in (None, "vllm"):
            raise typer.BadParameter("--machines runs production's layout and the real engine, from a bare machine: "
                                     "it takes none of --system-scope, --bare, --engine stand-in")
        inventory = machine_nodes.up(directory, root.resolve(), root / (profile or DEFAULT_PROFILE),
                                     parse_addresses(addresses), echo=typer.echo)
        typer.echo(f"sandbox up: inventory {inventory}")
        return

    if engine is None and not (directory / "state.json").exists():
        engine = "vllm"
    inventory = up(directory, root / (profile or DEFAULT_PROFILE), parse_addresses(addresses), echo=typer.echo,
                   system_scope=tuple(system_scope or ()), bare=tuple(bare or ()), engine=engine, release=False)
    typer.echo(f"sandbox up: inventory {inventory}")


@sandbox_app.command("status", short_help='What runs on each sandbox node.')
def sandbox_status(
    directory: SandboxDir = Path(".sandbox"),
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """What runs on each sandbox node (exit 1 if anything is down)."""
    sandbox_installed()
    import json

    from ..sandbox import machines
    from ..sandbox.fleet import status

    if (directory / "machines.json").exists():
        report = machines.status(directory)
        if as_json:
            typer.echo(json.dumps(report, indent=2, sort_keys=True))
        elif not report:
            typer.echo(f"sandbox: machines down (run 'flatshare sandbox up --machines --dir {directory}')")
        for node, entry in report.items():
            units = ", ".join(f"{name} {state}" for name, state in entry["units"].items()) or "no units"
            if as_json:
                continue
            if entry["system"] == "without its keeper":
                typer.echo(f"{node}: machine running without its keeper (nothing boots it again after a reboot); "
                           f"'flatshare sandbox down --dir {directory}' shuts it down")
            else:
                typer.echo(f"{node}: machine {entry['system']}, sshd {'up' if entry['sshd'] else 'DOWN'}; {units}")
                if entry.get("kill_failures"):
                    typer.echo(f"{node}: its systemd could not kill a control group {entry['kill_failures']} "
                               "times this boot (cgroup v1 here: docs/reference/machines.md); a process of a "
                               "stopped unit may still run")
        healthy = bool(report) and all(e["system"] == "running" and e["sshd"] for e in report.values())
        raise typer.Exit(0 if healthy else 1)
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
                f"{units}; {_engine_words(entry)}"
            )
    healthy = bool(report) and all(
        e["manager"] and e["sshd"] and e["engine_health"] == 200 and set(e["units"].values()) == {"active"}
        for e in report.values()
    )
    raise typer.Exit(0 if healthy else 1)


@sandbox_app.command("reboot", short_help='Reboot a sandbox node.')
def sandbox_reboot(
    node: Annotated[str, typer.Option("--node", metavar="NAME", help="The sandbox node to reboot.")],
    directory: SandboxDir = Path(".sandbox"),
) -> None:
    """Reboot a sandbox node's systemd (stop its manager, clear its runtime dir, start it): what is enabled comes up.
    A machine is rebooted for real ('systemctl reboot' in it; it boots again)."""
    sandbox_installed()
    from ..sandbox.fleet import reboot

    if (directory / "machines.json").exists():
        from ..sandbox import machines

        machines.reboot(directory, node, echo=typer.echo)
        return

    reboot(directory, node, echo=typer.echo)


@sandbox_app.command("down", short_help='Stop everything the sandbox started.')
def sandbox_down(directory: SandboxDir = Path(".sandbox")) -> None:
    """Stop every process the sandbox started (by process id); machines are shut down."""
    sandbox_installed()
    from ..sandbox import machines
    from ..sandbox.fleet import down

    if (directory / "machines.json").exists():
        machines.down(directory, echo=typer.echo)
        typer.echo("sandbox down")
        return

    down(directory, echo=typer.echo)
    typer.echo("sandbox down")


def _engine_words(entry: dict) -> str:
    """``sandbox status``'s words for a node's engine: its main pid and what its ``/health`` answered."""
    pid = f"engine pid {entry['engine_pid']}" if entry["engine_pid"] else "no engine process"
    health = entry["engine_health"]
    return f"{pid}, /health {health}" if health else f"{pid}, /health answered nothing"
