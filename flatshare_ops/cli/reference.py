"""docs/reference/commands.md: every ``flatshare`` command and option, generated from the command line itself.

``flatshare profiles render`` compares it with the checkout as it compares the profile's rendered files
(``make profiles`` fails on drift, ``make profiles UPDATE=1`` rewrites it), so the reference never says
what the code does not do. The text is built from the commands' own help and options (typer's click tree),
never from the help formatter's output: it does not depend on the terminal's width.
"""

from __future__ import annotations

import inspect
from pathlib import Path

#: Where the reference lives in the checkout.
COMMANDS_DOC = Path("docs/reference/commands.md")


def command_reference() -> str:
    """The reference document: one section per command, in the order ``flatshare -h`` lists them.

    Returns:
        Markdown text ending in a newline.
    """
    import typer.main
    from typer import _click as click

    from . import commands

    app = commands()

    root = typer.main.get_command(app)
    lines = ["# Command reference", "",
             "Generated from the command line by `make profiles UPDATE=1` (flatshare_ops/cli/reference.py); "
             "`make profiles` fails when it drifts. `flatshare COMMAND -h` prints the same on a terminal.", ""]

    def section(command, path: list[str], parent) -> None:
        ctx = click.Context(command, info_name=path[-1], parent=parent, **(command.context_settings or {}))
        if getattr(command, "hidden", False):
            return
        subcommands = getattr(command, "commands", None)
        if subcommands is not None and len(path) > 1 and not command.params:
            lines.extend([f"## {' '.join(path)}", "", _text(command.help), ""])
        elif subcommands is None or len(path) == 1:
            title = "##" if len(path) <= 2 else "###"
            lines.extend([f"{title} {' '.join(path)}", "", "```", _usage(command, ctx, path), "```", "",
                          _text(command.help), ""])
            rows = [r for r in (_row(p, ctx) for p in command.get_params(ctx)) if r is not None]
            if rows:
                lines.extend(["| Argument or option | Meaning |", "| --- | --- |", *rows, ""])
        if subcommands is not None:
            for name in command.list_commands(ctx):
                section(subcommands[name], [*path, name], ctx)

    section(root, ["flatshare"], None)
    return "\n".join(lines).rstrip() + "\n"


def _text(help_text: str | None) -> str:
    return inspect.cleandoc(help_text or "").replace("\n\n", "\n\n") or "(no help text)"


def _usage(command, ctx, path: list[str]) -> str:
    words = [" ".join(path)]
    if any(getattr(p, "param_type_name", "") == "option" for p in command.params) or command.params == []:
        words.append("[OPTIONS]")
    for param in command.params:
        if getattr(param, "param_type_name", "") == "argument":
            words.append(param.metavar or param.name.upper())
    if getattr(command, "commands", None) is not None:
        words.append("COMMAND [ARGS]...")
    return " ".join(words)


def _row(param, ctx) -> str | None:
    if getattr(param, "hidden", False):
        return None
    if getattr(param, "param_type_name", "") == "argument":
        name = param.metavar or param.name.upper()
        meaning = param.help or ""
    else:
        record = param.get_help_record(ctx)
        if record is None:
            return None
        name, meaning = record
    return f"| `{_cell(name)}` | {_cell(meaning)} |"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")
