"""The control-character rule for every value that reaches a unit file or a message (standard library only).

systemd.syntax(7) (docs/reference/systemd.md, "Unit file syntax"): a newline
in a value starts a new directive and a trailing backslash continues a line;
no control character is ever wanted in a unit, so such values are refused at
the edge, never escaped.
"""

from __future__ import annotations

import re

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def control_character(value: str) -> str | None:
    """The first control character (U+0000-U+001F, U+007F) in ``value``, or None."""
    match = _CONTROL.search(value)
    return match.group() if match else None


def clip(text: str, limit: int) -> str:
    """``text`` at most ``limit`` characters long, cut at a space (never inside a word or a number: a cut
    ``pid 12345`` must not read ``pid 1``), ``…`` marking the cut; unchanged when it fits."""
    if len(text) <= limit:
        return text
    cut = text[:max(0, limit - 1)]
    space = cut.rfind(" ")
    return (cut[:space] if space > 0 else cut).rstrip() + "…"


def clip_tail(text: str, limit: int) -> str:
    """The end of ``text`` (where a command's failure is said), at most ``limit`` characters, cut at a space,
    ``…`` marking the cut; unchanged when it fits."""
    if len(text) <= limit:
        return text
    cut = text[len(text) - max(0, limit - 1):]
    space = cut.find(" ")
    return "…" + (cut[space + 1:] if 0 <= space < len(cut) - 1 else cut).lstrip()


def one_line(value: object) -> str:
    """``value`` as text safe to print on one line of output: control characters (C0, DEL and every C1, the
    line separators U+2028 and U+2029), the bidirectional formatting characters (which reorder what a terminal
    shows) and lone surrogates (which no UTF-8 output can encode) shown as escapes (``\\n``, ``\\x1b``,
    ``\\u202e``, ``\\ud800``), so a value read from a file can never start a line of its own, pose as a
    protocol line, or stop the output."""
    return _SHOWN.sub(lambda m: m.group().encode("unicode_escape").decode(), str(value))


_SHOWN = re.compile(r"[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069\ud800-\udfff]")


#: The longest hold message (characters): a sentence or two. It travels in the node command's argument list,
#: and one argument of execve(2) may hold at most 128 KiB (MAX_ARG_STRLEN).
HOLD_MESSAGE_MAX = 1000


def hold_message(value: str) -> str | None:
    """Why a hold message (``flatshare hold place -m``) cannot be used, or None: it must be one line of
    text, not empty, at most :data:`HOLD_MESSAGE_MAX` characters, with no control character, and UTF-8 (bytes
    that are not arrive from the command line as surrogate escapes, which the node's record cannot hold)."""
    if not value.strip():
        return "the message is empty; say why the node is held"
    if len(value) > HOLD_MESSAGE_MAX:
        return (f"the message is {len(value)} characters long, more than {HOLD_MESSAGE_MAX}; say why the node is "
                "held in a sentence or two")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return "the message is not UTF-8 text; give one line of text in UTF-8"
    bad = _SHOWN.search(value)  # what one_line would escape
    if bad is not None:
        return f"the message holds control character {bad.group()!r}; give one line of text"
    return None
