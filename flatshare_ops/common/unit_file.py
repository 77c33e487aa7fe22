"""Unit files read as systemd reads them, so that two releases' units compare by meaning (standard library only).

Sources: systemd.syntax(7) (sections, ``Key=Value``, comments, continuation
lines), systemd.service(5) "COMMAND LINES" (``ExecStart=`` words, quoting,
escapes, prefixes, a lone ``;``), systemd.exec(5) ``Environment=``,
systemd.unit(5) "SPECIFIERS" and drop-ins, systemd.time(7) (time spans);
docs/reference/systemd.md restates what we rely on.

Meaning, not text: comments and blank lines are gone; ``ExecStart=`` becomes
the argv systemd would run (``"a b"`` and ``a\\x20b`` are the same word);
``Environment=`` becomes its assignments; a time span becomes microseconds
(``900s`` = ``15min``); keys that change nothing at runtime
(:data:`IGNORED_KEYS`, as NixOS's switch-to-configuration ignores them) are
dropped; an empty assignment resets a list, as systemd does for drop-ins.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

#: [Unit] keys that change nothing at runtime (NixOS switch-to-configuration-ng, ``compare_units``).
IGNORED_KEYS = frozenset({
    ("Unit", "Description"), ("Unit", "Documentation"), ("Unit", "X-Flatshare-Change"),
})
#: Keys whose values are command lines (systemd.service(5)).
EXEC_KEYS = frozenset({"ExecStart", "ExecStartPre", "ExecStartPost", "ExecReload", "ExecStop", "ExecStopPost",
                       "ExecCondition"})
#: The [Unit] key that says what changing a unit costs a switch (read by the plan; docs/release.md).
CHANGE_KEY = "X-Flatshare-Change"

_TIME_UNITS = {"us": 1, "usec": 1, "ms": 1000, "msec": 1000, "s": 10**6, "sec": 10**6, "second": 10**6,
               "seconds": 10**6, "m": 60 * 10**6, "min": 60 * 10**6, "minute": 60 * 10**6, "minutes": 60 * 10**6,
               "h": 3600 * 10**6, "hr": 3600 * 10**6, "hour": 3600 * 10**6, "hours": 3600 * 10**6,
               "d": 86400 * 10**6, "day": 86400 * 10**6, "days": 86400 * 10**6}
_C_ESCAPES = {"a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v", "\\": "\\", '"': '"',
              "'": "'", "s": " "}

#: What systemd strips and splits on (its WHITESPACE: space, tab, newline, carriage return): not Python's
#: Unicode whitespace, which also holds U+0085, U+2028 and U+2029 (fileio.c read_line, docs/reference/systemd.md).
WHITESPACE = " \t\n\r"
#: systemd's line ends: newline, carriage return, CR LF, NUL.
_LINES = re.compile(r"\r\n|[\r\n\0]")


class UnitSyntaxError(ValueError):
    """A unit file systemd would not read the way it looks (an unterminated quote, a key outside a section)."""


def parse(text: str) -> list[tuple[str, str, str]]:
    """The assignments of a unit file, in order: ``[(section, key, raw value)]``.

    Comments (lines starting with ``#`` or ``;``) and blank lines are dropped;
    a line ending in a backslash continues on the next (the backslash becomes
    a space; comment lines inside a continuation are skipped).

    Raises:
        UnitSyntaxError: an assignment before any section header.
    """
    entries: list[tuple[str, str, str]] = []
    section: str | None = None
    pending = ""
    for raw in _LINES.split(text):
        line = raw.strip(WHITESPACE)
        if pending:
            if line.startswith(("#", ";")):
                continue
            line = pending + line
            pending = ""
        elif not line or line.startswith(("#", ";")):
            continue
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        key, eq, value = line.partition("=")
        if not eq:
            continue  # systemd logs and ignores a line without '='
        if section is None:
            raise UnitSyntaxError(f"assignment {key.strip(WHITESPACE)}= before any [section]")
        entries.append((section, key.strip(WHITESPACE), value.strip(WHITESPACE)))
    if pending:
        key, eq, value = pending.strip(WHITESPACE).partition("=")
        if eq and section is not None:
            entries.append((section, key.strip(WHITESPACE), value.strip(WHITESPACE)))
    return entries


def _unescape_specifiers(value: str) -> str:
    """``%%`` is a literal ``%``; other specifiers (``%n``) are kept as written (they mean the same in both)."""
    return value.replace("%%", "\0pct\0")


def split_words(value: str) -> list[str]:
    """Split a value into words as systemd's ``extract_first_word`` does with unquoting and C escapes.

    Double and single quotes group words; backslash escapes (``\\"``, ``\\\\``,
    ``\\n``, ``\\xNN``, ``\\NNN`` octal, ``\\s``) are decoded in and out of quotes.

    Raises:
        UnitSyntaxError: an unterminated quote or a trailing backslash.
    """
    return [word for word, _raw in _words(value)]


def _words(value: str) -> list[tuple[str, str]]:
    """:func:`split_words`, each word with its text as written (a separator ``;`` is one written bare)."""
    words: list[tuple[str, str]] = []
    i, n = 0, len(value)
    while True:
        while i < n and value[i] in WHITESPACE:
            i += 1
        if i >= n:
            return words
        start = i
        word: list[str] = []
        quote = None
        while i < n:
            c = value[i]
            if quote is None and c in WHITESPACE:
                break
            if c in "\"'" and quote is None:
                quote = c
                i += 1
                continue
            if quote is not None and c == quote:
                quote = None
                i += 1
                continue
            if c == "\\":
                decoded, i = _c_escape(value, i)
                word.append(decoded)
                continue
            word.append(c)
            i += 1
        if quote is not None:
            raise UnitSyntaxError(f"unterminated {quote} quote in {value!r}")
        words.append(("".join(word), value[start:i]))


def _c_escape(value: str, i: int) -> tuple[str, int]:
    if i + 1 >= len(value):
        raise UnitSyntaxError(f"trailing backslash in {value!r}")
    c = value[i + 1]
    if c in _C_ESCAPES:
        return _C_ESCAPES[c], i + 2
    if c == "x" and re.fullmatch(r"[0-9a-fA-F]{2}", value[i + 2 : i + 4]):
        return chr(int(value[i + 2 : i + 4], 16)), i + 4
    if re.fullmatch(r"[0-7]{3}", value[i + 1 : i + 4]):
        return chr(int(value[i + 1 : i + 4], 8)), i + 4
    if c == "u" and re.fullmatch(r"[0-9a-fA-F]{4}", value[i + 2 : i + 6]):
        return chr(int(value[i + 2 : i + 6], 16)), i + 6
    return c, i + 2  # systemd keeps an unknown escape's character


def exec_commands(value: str) -> list[tuple[str, list[str]]]:
    """An ``Exec*=`` value as ``[(prefixes, argv)]``, one per command.

    A ``;`` written bare as a word of its own separates commands; a quoted ``";"`` or an
    escaped ``\\;`` is an argument (systemd.service(5), "Command lines").

    ``$$`` becomes ``$`` and ``%%`` becomes ``%`` (systemd.service(5)); ``$VAR`` is kept as written,
    since it is expanded at exec time the same way for both sides of a comparison.

    Raises:
        UnitSyntaxError: a quoting error.
    """
    words = _words(_unescape_specifiers(value))
    commands: list[tuple[str, list[str]]] = []
    current: list[str] = []
    for word, raw in words + [(";", ";")]:
        if raw == ";":
            if current:
                found = re.match(r"^[-@:+!]*", current[0])
                assert found is not None  # the pattern matches any text (at least the empty prefix)
                prefix = found.group()
                argv = [current[0][len(prefix):], *current[1:]]
                commands.append((prefix, [w.replace("$$", "$").replace("\0pct\0", "%") for w in argv]))
            current = []
        else:
            current.append(word)
    return commands


def time_span_us(value: str) -> int | None:
    """A systemd time span (``90``, ``90s``, ``1min 30s``, ``infinity``) in microseconds; None if it is not one."""
    text = value.strip(WHITESPACE)
    if text == "infinity":
        return -1
    total, found = 0, False
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", text):
        scale = _TIME_UNITS.get(unit or "s")
        if scale is None:
            return None
        total += int(float(number) * scale)
        found = True
    return total if found and re.fullmatch(r"(\s*\d+(\.\d+)?\s*[a-z]*)+", text) else None


def _meaning_of(key: str, value: str) -> object:
    if key in EXEC_KEYS:
        return tuple((prefix, tuple(argv)) for prefix, argv in exec_commands(value))
    if key == "Environment":
        return tuple(w.replace("\0pct\0", "%") for w in split_words(_unescape_specifiers(value)))
    if key.endswith("Sec"):
        span = time_span_us(value)
        if span is not None:
            return span
    return value.replace("%%", "%")


def meaning(text: str, drop_ins: Sequence[str] = ()) -> dict[tuple[str, str], tuple]:
    """What a unit (and its own drop-ins, applied in order after it) means to systemd.

    Returns:
        (section, key) -> tuple of values in order (most keys hold one; list keys such
        as ``Environment=``, ``ExecStartPre=``, ``After=`` accumulate, and an empty
        assignment resets them); ignored keys (:data:`IGNORED_KEYS`) left out.

    Raises:
        UnitSyntaxError: the unit cannot be read as systemd would.
    """
    result: dict[tuple[str, str], tuple] = {}
    for source in (text, *drop_ins):
        for section, key, value in parse(source):
            if (section, key) in IGNORED_KEYS or key.startswith("X-"):
                continue
            if value == "":
                result.pop((section, key), None)
                continue
            result[(section, key)] = result.get((section, key), ()) + (_meaning_of(key, value),)
    return result


def change_class(text: str, default: str = "switch") -> str:
    """The unit's ``X-Flatshare-Change=`` value: what changing it costs a switch (``default`` when absent)."""
    value = default
    try:
        for section, key, raw in parse(text):
            if section == "Unit" and key == CHANGE_KEY:
                value = raw
    except UnitSyntaxError:
        pass
    return value
