"""The generated parts of README.md and PRODUCTION.md, between begin/end markers.

Only the text between ``<!-- BEGIN generated: NAME -->`` and
``<!-- END generated: NAME -->`` is ever replaced; everything else in the
document is the authors' and is left byte for byte.
"""

from __future__ import annotations

import shlex

from ..errors import ProfileError
from ..config.profile import LoadedProfile


def begin_marker(name: str) -> str:
    """The line opening generated block ``name``."""
    return f"<!-- BEGIN generated: {name} (make profiles UPDATE=1 rewrites this block) -->"


def end_marker(name: str) -> str:
    """The line closing generated block ``name``."""
    return f"<!-- END generated: {name} -->"


def replace_block(document: str, name: str, body: str, filename: str) -> str:
    """Replace the body of block ``name`` in ``document``.

    Raises:
        ProfileError: the markers are missing, repeated or out of order.
    """
    begin, end = begin_marker(name), end_marker(name)
    if document.count(begin) != 1 or document.count(end) != 1 or document.index(begin) > document.index(end):
        raise ProfileError(
            f"{filename}: generated block {name!r} needs exactly one '{begin}' line "
            f"followed by one '{end}' line; add them where the block belongs"
        )
    head, rest = document.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{body.rstrip()}\n{end}{tail}"


def quick_start(loaded: LoadedProfile, argv: list[str]) -> str:
    """README's quick start: the engine's command line, one flag per line."""
    lines = [shlex.join(argv[:3])]
    words = argv[3:]
    i = 0
    while i < len(words):
        if i + 1 < len(words) and not words[i + 1].startswith("--"):
            lines.append(shlex.join(words[i : i + 2]))
            i += 2
        else:
            lines.append(shlex.quote(words[i]))
            i += 1
    command = " \\\n    ".join(lines)
    return (
        f"What the engine runs under profile `{loaded.profile.name}` "
        f"(vLLM {loaded.profile.engine.vllm_release}):\n\n```sh\n{command}\n```"
    )


def node_rows(loaded_by_node: dict[str, LoadedProfile]) -> str:
    """PRODUCTION.md's node table: node, card, profile, vLLM release, module sha256, decode hold."""
    rows = [
        "| node | card | profile | vLLM release | module sha256 | decode hold (tokens) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for node, loaded in loaded_by_node.items():
        p = loaded.profile
        rows.append(
            f"| {node} | {p.card.name} | {p.name} | {p.engine.vllm_release} | "
            f"`{p.module.sha256}` | {p.engine.make_room.decode_hold_tokens} |"
        )
    return "\n".join(rows)
