"""``flatshare profiles set KEY VALUE``: edit one value with comments and layout kept.

The edit is made with tomlkit on the profile's own document, validated as a
whole (with its ``extends`` chain) before anything is written, and written
atomically. A key the file inherits from its parent is added to the file.
"""

from __future__ import annotations

import re
import stat
from pathlib import Path
from typing import Any, TypedDict

import tomlkit
import tomlkit.exceptions
from tomlkit.items import Table

from ..common import durable
from ..common.text import control_character
from ..errors import ProfileError, WriteFailed
from .profile import LoadedProfile, load_document, read_toml, validate

#: The UTF-8 byte order mark (U+FEFF as UTF-8): a profile that starts with one keeps it when a value is set.
BOM = b"\xef\xbb\xbf"
_KEY = re.compile(r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$")


def parse_value(text: str, path: Path, key: str) -> Any:
    """Read VALUE as one TOML value (``48``, ``true``, ``0.5``, ``"x"``, ``[..]``), else as a plain string.

    Raises:
        ProfileError: VALUE spans lines, holds a control character, or carries a comment.
    """
    if control_character(text):
        raise ProfileError(f"{path}: {key}: VALUE must be one value on one line, without control characters")
    try:
        document = tomlkit.parse(f"v = {text}")
    except tomlkit.exceptions.TOMLKitError:
        return text
    item = document["v"]
    if list(document) != ["v"] or getattr(item, "trivia", None) and item.trivia.comment:
        raise ProfileError(f"{path}: {key}: VALUE must be only the value (no comment, no other keys)")
    return item


def _known_key(path: Path, key: str, parts: list[str]) -> None:
    """Refuse a key the profile's schema does not have, naming the whole key, the part that is not one, and the
    closest key the schema has there.

    Raises:
        ProfileError: ``FILE: KEY: not a profile key (PART is not a key of TABLE; did you mean X?)``.
    """
    from ..schema_errors import did_you_mean, keys_at
    from .profile import Profile

    for depth, part in enumerate(parts):
        keys = keys_at(Profile, tuple(parts[:depth]))
        if keys is None:
            return  # a free table (the engine's environment, say): any key may be set there
        if part not in keys:
            where = f"of [{'.'.join(parts[:depth])}]" if depth else "at the profile's top"
            raise ProfileError(f"{path}: {key}: not a profile key ({part} is not a key {where}"
                               f"{did_you_mean(part, keys).replace(' (', '; ').rstrip(')')}); "
                               "docs/reference/profile-values.md lists the keys")


class _Kept(TypedDict):
    """What a rewrite keeps of the file (durable.write_atomic's mode and owner)."""

    mode: int
    owner: tuple[int, int]


def set_value(path: Path, key: str, raw_value: str, then=None, echo=None) -> tuple[Any, Any, LoadedProfile]:
    """Set ``key`` (dotted, e.g. ``engine.make_room.decode_hold_tokens``) in the profile file.

    Args:
        path: the profile file to edit.
        key: dotted key path.
        raw_value: the value as typed on the command line.
        then: called after the profile is written (the render of the checkout's
            files); if it raises, the profile's old text is put back and the error re-raised.
        echo: given what ``then`` returned.

    Returns:
        (old value or None, new value, the validated profile after the edit).

    Raises:
        ProfileError: bad key or value, the file is unreadable, the edited
            profile does not validate, or ``then`` failed; the file is then left
            (or put back) as it was.
    """
    path = Path(path)
    target = path.resolve()  # a symlinked profile is written through to the file it names
    if not _KEY.match(key):
        raise ProfileError(f"{path}: {key}: not a dotted key like engine.make_room.decode_hold_tokens")
    read_toml(path)  # the same one-line errors as loading (missing, not UTF-8, malformed)
    raw = path.read_bytes()  # bytes: keep \r\n as written
    bom = BOM if raw.startswith(BOM) else b""  # and a UTF-8 byte order mark, if the file has one
    text = raw[len(bom):].decode("utf-8")
    document = tomlkit.parse(text)

    parts = key.split(".")
    _known_key(path, key, parts)
    table: Any = document
    for part in parts[:-1]:
        if part not in table:
            table[part] = tomlkit.table()
        table = table[part]
        if not isinstance(table, (dict, Table)):
            raise ProfileError(f"{path}: {key}: {part} is a value, not a table")
    current = table.get(parts[-1])
    if isinstance(current, (dict, Table)):
        raise ProfileError(f"{path}: {key}: is a table; set one of its keys ({', '.join(current)})")
    old = current.unwrap() if hasattr(current, "unwrap") else current
    new = parse_value(raw_value, path, key)
    if hasattr(current, "trivia") and hasattr(new, "trivia"):
        # Keep the line's own comment and spacing: only the value changes.
        new.trivia.indent, new.trivia.comment_ws = current.trivia.indent, current.trivia.comment_ws
        new.trivia.comment, new.trivia.trail = current.trivia.comment, current.trivia.trail
    elif hasattr(new, "trivia"):
        # A new key is a line of its own: the value parsed alone ends without one, and tomlkit would then end it
        # with the blank line that kept the next table apart.
        new.trivia.trail = "\n"
    table[parts[-1]] = new
    new_text = tomlkit.dumps(document)

    if "\r\n" in text:  # keep the operator's line endings
        new_text = new_text.replace("\r\n", "\n").replace("\n", "\r\n")

    # Validate the edited text, with the file's real extends chain, before writing.
    data, chain, origins = load_document(path, new_text)
    profile = validate(data, origins, path)
    info = target.stat()
    keep: _Kept = {"mode": stat.S_IMODE(info.st_mode), "owner": (info.st_uid, info.st_gid)}
    try:
        encoded = new_text.encode()
    except UnicodeEncodeError:  # a lone surrogate (bytes that were not UTF-8 on the command line) inside a value
        raise ProfileError(f"{path}: {key}: the value holds text that is not UTF-8; give it as UTF-8 text") from None
    try:
        durable.write_atomic(target, bom + encoded, **keep)
    except OSError as err:  # a full disk, a read-only checkout: the old file stands
        raise WriteFailed(f"{path}: cannot be written ({err.strerror or err}); nothing was changed") from None
    if then is not None:
        try:
            result = then()
        except BaseException:
            try:
                durable.write_atomic(target, raw, **keep)
            except OSError as err:
                raise WriteFailed(f"{path}: the render failed and the profile could not be put back "
                                  f"({err.strerror or err}); it holds the new value: set it back by hand") from None
            raise
        if echo is not None:
            echo(result)
    loaded = LoadedProfile(profile=profile, path=path, chain=chain, data=data, origins=origins)
    return old, (new.unwrap() if hasattr(new, "unwrap") else new), loaded
