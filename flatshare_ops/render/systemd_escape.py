"""Quoting values into unit files by systemd's rules.

Sources: systemd.syntax(7), systemd.service(5) "COMMAND LINES",
systemd.exec(5) ``Environment=``, systemd.unit(5) "SPECIFIERS":

- Specifiers (``%n``, ``%h``...) are expanded before anything else, in every
  setting that takes them: a literal ``%`` is written ``%%``.
- ``ExecStart=`` and friends split the value into words, honouring double
  quotes and C-style backslash escapes inside them; ``$NAME`` / ``${NAME}``
  are then replaced from the environment, so a literal ``$`` is ``$$``. A
  lone ``;`` separates commands, but only when it stands unquoted.
- ``Environment=`` takes whole assignments, quoted the same way; ``$`` is
  not expanded there.
- A newline or other control character can't be carried safely in any value:
  it would end the directive. Such values are refused, never escaped.
"""

from __future__ import annotations

import re

from ..common.text import control_character


class UnsafeValueError(ValueError):
    """A value holds a character no unit file can carry (a control character)."""


def _refuse_control(value: str) -> None:
    if found := control_character(value):
        raise UnsafeValueError(f"value {value!r} contains control character {found!r}")


def escape_specifiers(value: str) -> str:
    """Escape ``%`` for a setting that expands specifiers (``Description=`` and most others)."""
    _refuse_control(value)
    return value.replace("%", "%%")


def _quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def exec_argument(arg: str) -> str:
    """One argument of an ``ExecStart=`` line, double-quoted so systemd yields ``arg`` exactly.

    Raises:
        UnsafeValueError: ``arg`` contains a control character.
    """
    _refuse_control(arg)
    return _quote(arg).replace("%", "%%").replace("$", "$$")


def exec_command(argv: list[str]) -> str:
    """The value of an ``ExecStart=`` line that runs ``argv`` with no shell.

    Args:
        argv: the program (an absolute path) and its arguments.

    Returns:
        Space-separated double-quoted words; systemd's ``ExecStart`` property
        over D-Bus reports exactly ``argv`` back.

    Raises:
        UnsafeValueError: an argument contains a control character.
        ValueError: ``argv`` is empty.
    """
    if not argv:
        raise ValueError("empty command")
    return " ".join(exec_argument(arg) for arg in argv)


def environment_assignment(name: str, value: str) -> str:
    """The value of an ``Environment=`` line setting ``name`` to ``value`` exactly.

    Raises:
        UnsafeValueError: ``name`` or ``value`` contains a control character.
        ValueError: ``name`` is not a valid environment variable name.
    """
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise ValueError(f"invalid environment variable name {name!r}")
    _refuse_control(value)
    return _quote(f"{name}={value}").replace("%", "%%")


def number(value: float) -> str:
    """A number as decimal text, exactly as the profile holds it (Python's shortest round-trip form,
    never an exponent, no trailing ``.0``): ``0.12345678``, ``86399.99``, ``30``."""
    from decimal import Decimal

    text = format(Decimal(repr(float(value))), "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


def seconds(value: float) -> str:
    """A time span for ``TimeoutStartSec=`` and friends, in seconds, without exponent notation."""
    text = f"{value:.6f}".rstrip("0").rstrip(".")
    return f"{text}s"
