"""``flatshare profiles set KEY VALUE``: edit one value with comments and layout kept.

The edit is made with tomlkit on the profile's own document, validated as a
whole (with its ``extends`` chain) before anything is written, and written
atomically. A key the file inherits from its parent is added to the file.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import tomlkit
import tomlkit.exceptions
from tomlkit.items import Table

from .atomic import write_atomic
from .errors import ProfileError
from .profile import LoadedProfile, load_document, validate

_KEY = re.compile(r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$")


def parse_value(text: str) -> Any:
    """Read VALUE as a TOML value (``48``, ``true``, ``0.5``, ``"x"``, ``[..]``), else as a plain string."""
    try:
        return tomlkit.parse(f"v = {text}")["v"]
    except tomlkit.exceptions.ParseError:
        return text


def set_value(path: Path, key: str, raw_value: str) -> tuple[Any, Any, LoadedProfile]:
    """Set ``key`` (dotted, e.g. ``engine.make_room.decode_hold_tokens``) in the profile file.

    Args:
        path: the profile file to edit.
        key: dotted key path.
        raw_value: the value as typed on the command line.

    Returns:
        (old value or None, new value, the validated profile after the edit).

    Raises:
        ProfileError: bad key, the file is unreadable, or the edited profile
            does not validate (then the file is left unchanged).
    """
    path = Path(path)
    if not _KEY.match(key):
        raise ProfileError(f"{path}: {key}: not a dotted key like engine.make_room.decode_hold_tokens")
    try:
        text = path.read_text(encoding="utf-8")
        document = tomlkit.parse(text)
    except FileNotFoundError:
        raise ProfileError(f"{path}: profile file not found; check the path") from None
    except tomlkit.exceptions.ParseError as err:
        raise ProfileError(f"{path}:{err.line}: malformed TOML; fix it before editing") from None

    parts = key.split(".")
    table: Any = document
    for part in parts[:-1]:
        if part not in table:
            table[part] = tomlkit.table()
        table = table[part]
        if not isinstance(table, (dict, Table)):
            raise ProfileError(f"{path}: {key}: {part} is a value, not a table")
    old = table.get(parts[-1])
    old = old.unwrap() if hasattr(old, "unwrap") else old
    new = parse_value(raw_value)
    table[parts[-1]] = new
    new_text = tomlkit.dumps(document)

    # Validate the edited text, with the file's real extends chain, before writing.
    data, chain, origins = load_document(path, new_text)
    profile = validate(data, origins, path)
    write_atomic(path, new_text.encode())
    loaded = LoadedProfile(profile=profile, path=path, chain=chain, data=data, origins=origins)
    return old, (new.unwrap() if hasattr(new, "unwrap") else new), loaded
