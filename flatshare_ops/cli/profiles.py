"""``flatshare profiles render | set | pin-module | verify``: the profile and the files it renders."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..errors import FlatshareError
from .app import app, RootOption, ProfileOption, to_stderr


profiles_app = typer.Typer(no_args_is_help=True, short_help="The profile and its rendered files.", help="The serving profile and the files it renders.")
app.add_typer(profiles_app, name="profiles")


def checkout_outputs(root: Path) -> dict[Path, str]:
    """What ``profiles render`` compares and writes: the profiles' rendered files (render/checkout.py
    ``expected_outputs``) and the command reference generated from this command line (cli/reference.py)."""
    from ..render.checkout import expected_outputs
    from .reference import COMMANDS_DOC, command_reference

    return {**expected_outputs(root), COMMANDS_DOC: command_reference()}


@profiles_app.command("render", short_help='Show drift of the rendered files, or --update them.')
def profiles_render(
    update: Annotated[bool, typer.Option("--update", help="Write the files that drifted.")] = False,
    root: RootOption = Path("."),
) -> None:
    """Compare the rendered files of production and of every variant (profiles/*.toml) with the checkout
    (exit 1 on drift; a rendered file no profile renders any more is stale, and drift too), or write them and
    remove the stale ones with --update. A placeholder module pin is not drift: ``release`` refuses it and
    ``doctor`` warns of it, so a sandbox demo is not opened by warnings about production."""
    from ..render.checkout import drift, remove_stale, stale_outputs, write_outputs

    outputs = checkout_outputs(root)
    if update:
        for path in write_outputs(root, outputs):
            typer.echo(f"wrote {path}")
        for path in remove_stale(root, outputs):
            typer.echo(f"removed {path} (no profile renders it)")
        return
    stale = stale_outputs(root, outputs)
    diffs = drift(root, outputs)
    if diffs:
        for diff in diffs.values():
            typer.echo(diff, nl=False)
        changed = len(diffs) - len(stale)
        to_stderr(
            f"profiles: {changed} rendered file(s) differ from the profile"
            + (f", {len(stale)} stale (no profile renders them: {', '.join(map(str, stale))})" if stale else "")
            + "; run 'make profiles UPDATE=1' to rewrite them" + (" and remove the stale ones" if stale else ""),
        )
        raise typer.Exit(1)


@profiles_app.command("set", context_settings={"ignore_unknown_options": True}, short_help='Set one profile value and re-render.')
def profiles_set(
    key: Annotated[str, typer.Argument(metavar="KEY", help="Dotted key, e.g. engine.make_room.decode_hold_tokens.")],
    value: Annotated[str, typer.Argument(metavar="VALUE", help="TOML value (48, true, 0.5, \"text\"); bare words are strings.")],
    root: RootOption = Path("."),
    profile: ProfileOption = None,
) -> None:
    """Set one profile value (comments and layout kept), validate, and render the checkout's files.

    Nothing is written unless the edited profile validates and every rendered file can be produced."""
    from ..config.edit import set_value
    from ..render.checkout import DEFAULT_PROFILE, write_outputs

    def report(written: list[Path]) -> None:
        for written_path in written:
            typer.echo(f"wrote {written_path}")

    path = root / (profile or DEFAULT_PROFILE)
    old, new, _ = set_value(path, key, value, then=lambda: write_outputs(root, checkout_outputs(root)), echo=report)
    typer.echo(f"{path}: {key}: {_as_toml(old)} -> {_as_toml(new)}")


def _as_toml(value: object) -> str:
    """A value as the profile spells it (``true``, ``"text"``, ``48``); ``(unset)`` for a key that was not set."""
    import tomlkit

    return "(unset)" if value is None else tomlkit.item(value).as_string()


@profiles_app.command("pin-module", short_help="Pin the serve module's sha256.")
def profiles_pin_module(
    sha256: Annotated[Optional[str], typer.Option("--sha256", metavar="HEX",
                                                   help="The hash a make-room revision publishes.")] = None,
    file: Annotated[Optional[Path], typer.Option("--file", metavar="PATH", help="A built module file.")] = None,
    from_node: Annotated[Optional[str], typer.Option(
        "--from-node", metavar="NAME", help="The module the node built (its engine's last start).")] = None,
    root: RootOption = Path("."),
    profile: ProfileOption = None,
    inventory: Annotated[Optional[Path], typer.Option("--inventory", metavar="FILE", envvar="FLATSHARE_INVENTORY",
                                                      help="The inventory (with --from-node).")] = None,
) -> None:
    """Pin the serve module's sha256 in a profile (comments kept) and re-render the checkout's files.

    Give exactly one of --sha256, --file, --from-node. The profile is --profile (default production; with
    --from-node, the profile the inventory names for that node)."""
    import hashlib

    from ..config.edit import set_value
    from ..render.checkout import DEFAULT_PROFILE, write_outputs

    given = [g for g in (sha256, file, from_node) if g is not None]
    if len(given) != 1:
        raise FlatshareError("profiles pin-module: give exactly one of --sha256 HEX, --file PATH, --from-node NAME")
    path = root / (profile or DEFAULT_PROFILE)
    if file is not None:
        from ..common.files import Damaged, read_bytes

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
    def say_written(written) -> None:
        for p in written:
            typer.echo(f"wrote {p}")

    old, new, _ = set_value(path, "module.sha256", f'"{sha256}"',
                            then=lambda: write_outputs(root, checkout_outputs(root)), echo=say_written)
    typer.echo(f"{path}: module.sha256: {old} -> {new}")


def _module_on_node(name: str, inventory: Path | None) -> tuple[str, Path]:
    """(sha256 of the module node ``name`` built, the profile file the inventory names for it)."""
    import json as _json

    from ..config.inventory import inventory_path
    from ..control import commands
    from ..control.fanout import ask
    from ..control.targets import targets

    (target,) = targets(inventory_path(inventory), [name], False)
    answer = ask([target], lambda t: commands.module(t.spec, t.loaded.profile.module.path))[name]
    if "error" in answer or not isinstance(answer.get("sha256"), str):
        raise FlatshareError(f"profiles pin-module: {name} did not report its module: "
                             f"{answer.get('error') or _json.dumps(answer)}")
    return answer["sha256"], target.profile_path


@profiles_app.command("verify", short_help='Check the rendered units (and flags) with systemd and vLLM.')
def profiles_verify(
    root: RootOption = Path("."),
    profile: ProfileOption = None,
    vllm: Annotated[Optional[Path], typer.Option(
        "--vllm", metavar="VENV",
        help="Also parse the engine's command line with the vLLM installed in VENV (e.g. .venv-vllm), "
             "as a release's preflight does on the node.")] = None,
    as_json: Annotated[bool, typer.Option(
        "--json", help="Print one JSON document on stdout: {profile, units, systemd_analyze (its output, empty "
                       "when clean), vllm (null without --vllm, else {venv, ok, error}), warnings, ok}; people's "
                       "lines go to stderr.")] = False,
) -> None:
    """Render the profile's units and check them with systemd-analyze verify (exit 1 on any output);
    with --vllm, also with vLLM's own parser (exit 1 if it rejects the command line). A canary threshold
    the analysis can never decide (ttft_p95_max_s not a vLLM bucket bound) is a warning."""
    import json as _json

    from ..config.profile import load_profile
    from ..control.analysis import threshold_warnings
    from ..render import render_profile
    from ..render.checkout import DEFAULT_PROFILE
    from ..render.units import unit_programs
    from ..render.verify import verify_units

    loaded = load_profile(root / (profile or DEFAULT_PROFILE))
    warnings = threshold_warnings(loaded.profile.release.analysis)
    for warning in warnings:
        to_stderr(f"warning: {warning}")
    rendered = render_profile(loaded)
    output = verify_units(rendered.units, unit_programs(loaded.profile))
    document: dict[str, object] = {"profile": loaded.profile.name, "units": sorted(rendered.units), "systemd_analyze": output,
                "vllm": None, "warnings": warnings, "ok": not output}

    def done(code: int) -> None:
        if as_json:
            typer.echo(_json.dumps(document, indent=2, sort_keys=True))
        raise typer.Exit(code)

    if output:
        to_stderr(output, nl=False)
        to_stderr("profiles: systemd-analyze verify reported the above for the rendered units")
        done(1)
    say = to_stderr if as_json else typer.echo  # with --json, stdout carries the document alone
    say(f"{loaded.profile.name}: {len(rendered.units)} units rendered; systemd-analyze verify printed nothing")
    if vllm is not None:
        from ..node.preflight import parse_with_venv

        answer = parse_with_venv(vllm, rendered.argv[2:])
        document["vllm"] = {"venv": str(vllm), "ok": bool(answer.get("ok")), "error": answer.get("error")}
        if not answer.get("ok"):
            document["ok"] = False
            to_stderr(f"profiles: vLLM in {vllm} rejects the engine's command line: {answer.get('error')}")
            done(1)
        say(f"{loaded.profile.name}: vLLM's own parser in {vllm} reads the engine's command line")
    done(0)
