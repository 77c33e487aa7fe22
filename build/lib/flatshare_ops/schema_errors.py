"""One way to say what pydantic found wrong, for every schema the tool reads (profile, inventory, journal, sandbox state)."""

from __future__ import annotations

import re
from typing import Any

from pydantic import ValidationError


def dotted(loc: tuple[Any, ...]) -> str:
    """A pydantic error location as a dotted key (``engine.make_room.retain_s``, ``steps[2].name``);
    aliased fields (``schema_``) are shown by their file spelling."""
    text = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".")
    return re.sub(r"\bschema_\b", "schema", text)


def rule(error: dict[str, Any]) -> str:
    """What one pydantic error says, in our words: the rule broken and, where it helps, the value given."""
    kind = error["type"]
    if kind == "extra_forbidden":
        return "unknown key; remove it or check its spelling"
    if kind == "missing":
        return "required key is missing"
    message = error["msg"].removeprefix("Value error, ")
    got = error.get("input")
    if kind.endswith("_type") or kind.startswith(("greater", "less", "string_pattern", "literal", "too_short")):
        return f"{message}, got {got!r}"
    return message


def ordered(err: ValidationError) -> list[dict[str, Any]]:
    """The errors, an unknown key first (a typo also makes its intended key "missing")."""
    return sorted(err.errors(), key=lambda e: e["type"] != "extra_forbidden")


def one_line(err: ValidationError) -> str:
    """``KEY: RULE`` for the first error, with a count of any others."""
    errors = ordered(err)
    first = errors[0]
    key = dotted(tuple(first["loc"]))
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{key + ': ' if key else ''}{rule(first)}{more}"
