"""One way to say what pydantic found wrong, for every schema the tool reads (profile, inventory, journal, sandbox state)."""

from __future__ import annotations

import re
from typing import Any

from pydantic import ValidationError
from pydantic_core import ErrorDetails


def dotted(loc: tuple[Any, ...]) -> str:
    """A pydantic error location as a dotted key (``engine.make_room.retain_s``, ``steps[2].name``);
    aliased fields (``schema_``) are shown by their file spelling."""
    # pydantic adds "[key]" after a table key it found wrong (a node's name): the key itself is the place.
    text = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc
                   if part != "[key]").lstrip(".")
    return re.sub(r"\bschema_\b", "schema", text)


def keys_at(model: Any, loc: tuple[Any, ...]) -> list[str] | None:
    """The keys the schema ``model`` (a pydantic model class) allows in the table at ``loc`` (a dotted key's parts,
    as pydantic's error locations give them), by their file spelling; None where the schema does not say (a free
    table, a list, a value)."""
    import typing

    from pydantic import BaseModel

    current = model
    for part in loc:
        if isinstance(part, int):
            return None
        fields = getattr(current, "model_fields", None)
        if fields is None:
            return None
        by_name = {(f.alias or n): f for n, f in fields.items()}
        field = by_name.get(part)
        if field is None:
            return None
        candidates = [field.annotation, *typing.get_args(field.annotation)]
        current = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if current is None:
            return None
    fields = getattr(current, "model_fields", None)
    return sorted((f.alias or n) for n, f in fields.items()) if fields is not None else None


def did_you_mean(name: str, keys: list[str] | None) -> str:
    """`` (did you mean decode_hold_tokens?)`` for the closest of ``keys`` to ``name`` (difflib's ratio), else ``""``."""
    import difflib

    close = difflib.get_close_matches(name, keys or [], n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def spelled(value: object) -> str:
    """``value`` as the file spells it, for a message: ``true``/``false``, a TOML date or time in ISO 8601
    (``2026-01-01``, ``12:30:00``), a string in double quotes, a number as written; a list or a table by its items
    the same way. TOML and JSON spell these alike; Python's repr (``True``, ``datetime.date(...)``) never shows."""
    import datetime
    import json
    import math

    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (datetime.date, datetime.time)):  # datetime.datetime is a date
        return value.isoformat()
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(spelled(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {spelled(v)}" for k, v in value.items()) + "}"
    return repr(value)


def rule(error: ErrorDetails, model: Any = None) -> str:
    """What one pydantic error says, in our words: the rule broken and, where it helps, the value given; for an
    unknown key, the closest key the schema ``model`` allows there."""
    kind = error["type"]
    if kind == "extra_forbidden":
        loc = tuple(error["loc"])
        hint = did_you_mean(str(loc[-1]), keys_at(model, loc[:-1])) if model is not None and loc else ""
        return f"unknown key{hint}; check its spelling, or remove it"
    if kind == "missing":
        return "required key is missing"
    message = error["msg"].removeprefix("Value error, ")
    got = error.get("input")
    if kind in ("literal_error", "enum"):
        allowed = error.get("ctx", {}).get("expected")
        return f"{spelled(got)} is not one of the values allowed here" + (f": {allowed}" if allowed else "")
    if kind.endswith("_type") or kind.startswith(("greater", "less", "string_pattern", "literal", "too_short")):
        return f"{message}, got {spelled(got)}"
    return message


def ordered(err: ValidationError) -> list[ErrorDetails]:
    """The errors, an unknown key first (a typo also makes its intended key "missing")."""
    return sorted(err.errors(), key=lambda e: e["type"] != "extra_forbidden")


def one_line(err: ValidationError) -> str:
    """``KEY: RULE`` for the first error, with a count of any others."""
    errors = ordered(err)
    first = errors[0]
    key = dotted(tuple(first["loc"]))
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{key + ': ' if key else ''}{rule(first)}{more}"
