"""YAML text for the rendered Prometheus rules: block mappings and sequences of strings and numbers.

Prometheus reads rule files as YAML (docs/reference/monitoring.md, "Prometheus rules"). The
documents written here have one shape (mappings with plain word keys, sequences, strings,
numbers), so a writer of that shape is a few lines, and no YAML library joins the node's lock
(the renderer ships in the same package as the node's side; tests read the output back with PyYAML
and promtool). Every one-line string is written double-quoted as a JSON string, which YAML 1.2
reads as the same string (YAML 1.2, "Double-Quoted Style": its escapes include all of JSON's); a
string of several lines as a literal block (``|-``), which keeps every character but the last newline.
"""

from __future__ import annotations

import json
import re

_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _scalar(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    raise TypeError(f"cannot write {type(value).__name__} as YAML here")


def _literal(text: str, pad: str) -> list[str]:
    if any(line != line.rstrip() or "\t" in line for line in text.split("\n")) or text != text.strip():
        raise ValueError(f"a literal block keeps no leading or trailing blanks: {text!r}")
    return ["|-"] + [f"{pad}{line}" if line else "" for line in text.split("\n")]


def _lines(value, indent: int) -> list[str]:
    pad = " " * indent
    out: list[str] = []
    if isinstance(value, dict):
        for key, item in value.items():
            if not _KEY.match(key):
                raise ValueError(f"YAML key {key!r} is not a plain word")
            if isinstance(item, (dict, list)) and item:
                out.append(f"{pad}{key}:")
                out += _lines(item, indent + 2)
            elif isinstance(item, str) and "\n" in item:
                head, *rest = _literal(item, pad + "  ")
                out += [f"{pad}{key}: {head}", *rest]
            else:
                out.append(f"{pad}{key}: {'{}' if item == {} else '[]' if item == [] else _scalar(item)}")
    elif isinstance(value, list):
        for item in value:
            if isinstance(item, dict) and item:
                first, *rest = _lines(item, indent + 2)
                out += [f"{pad}- {first[indent + 2:]}", *rest]
            else:
                out.append(f"{pad}- {_scalar(item)}")
    else:
        out.append(f"{pad}{_scalar(value)}")
    return out


def yaml_text(document: dict, header: str = "") -> str:
    """``document`` as block-style YAML text, after ``header`` (comment lines, each starting with ``#``).

    Raises:
        TypeError, ValueError: a value outside the shape (not a word key, not a string, number or bool,
            a several-line string with blanks at its ends).
    """
    return header + "\n".join(_lines(document, 0)) + "\n"
