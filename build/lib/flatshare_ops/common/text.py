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
