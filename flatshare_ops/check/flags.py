"""The engine's argv compared by meaning (standard library only).

Temporary home: issue 10 replaces this with the engine command-line module
that mirrors vLLM's own parser (common/engine_argv.py).
"""

from __future__ import annotations

import json

def _parse_dotted_value(text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _merge_into(target: dict, path: list[str], value: object) -> None:
    for part in path[:-1]:
        target = target.setdefault(part, {})
    target[path[-1]] = value


def _flatten(prefix: str, value: object, out: dict[str, object]) -> None:
    if isinstance(value, dict):
        for key, inner in value.items():
            _flatten(f"{prefix}.{key}", inner, out)
    else:
        out[prefix] = value


def normalize_argv(argv: list[str]) -> tuple[str | None, dict[str, object]]:
    """Read a ``vllm serve`` command line into (model, {flag: value}) by meaning.

    ``--flag=value`` and ``--flag value`` are the same; ``--x`` is ``x: True``
    and ``--no-x`` is ``x: False``; flag order does not matter; the JSON form
    ``--additional-config '{"a": {"b": 1}}'`` and the dotted form
    ``--additional-config.a.b 1`` both become ``--additional-config.a.b: 1``
    (vLLM reads dotted values with ``json.loads``; docs/reference/vllm.md#dotted-value-typing). The interpreter
    and script in front of ``serve`` are ignored.

    Returns:
        (the model, or None if there is no ``serve``; flag name -> value).
    """
    if "serve" not in argv:
        return None, {}
    words = argv[argv.index("serve") + 1 :]
    model = words[0] if words and not words[0].startswith("--") else None
    words = words[1:] if model is not None else words
    flags: dict[str, object] = {}
    additional: dict = {}
    i = 0
    while i < len(words):
        word = words[i]
        name, eq, inline = word.partition("=")
        if eq:
            value: object = inline
            i += 1
        elif i + 1 < len(words) and not words[i + 1].startswith("--"):
            value = words[i + 1]
            i += 2
        else:
            value = None
            i += 1
        if name == "--additional-config" and isinstance(value, str):
            parsed = _parse_dotted_value(value)
            if isinstance(parsed, dict):
                for key, inner in parsed.items():
                    _merge_into(additional, [key], inner)
            continue
        if name.startswith("--additional-config."):
            _merge_into(additional, name.removeprefix("--additional-config.").split("."),
                        _parse_dotted_value(value) if isinstance(value, str) else True)
            continue
        if value is None:
            if name.startswith("--no-"):
                flags["--" + name.removeprefix("--no-")] = False
            else:
                flags[name] = True
        else:
            flags[name] = value
    _flatten("--additional-config", additional, flags) if additional else None
    return model, flags


def _same(a: object, b: object) -> bool:
    if a == b:
        return True
    try:
        return float(a) == float(b)  # "0.9" and "0.90", "24" and "24.0"
    except (TypeError, ValueError):
        return False


def show_flag_value(value: object) -> str:
    """A flag's value for people: ``on``/``off`` for booleans, ``(absent)`` for None, else its text."""
    if value is True:
        return "on"
    if value is False:
        return "off"
    if value is None:
        return "(absent)"
    return json.dumps(value) if not isinstance(value, str) else value


def compare_argv(running: list[str], expected: list[str]) -> list[str]:
    """Differences between a running engine's argv and the release's, one line each.

    Returns:
        Lines like ``--additional-config.make_room.decode_hold_tokens: running 0, profile 48``,
        ``--max-num-seqs: missing (profile 32)``, ``--enforce-eager: extra (running on)``; empty when equal.
    """
    run_model, run_flags = normalize_argv(running)
    exp_model, exp_flags = normalize_argv(expected)
    lines = []
    if run_model != exp_model:
        lines.append(f"model: running {run_model}, profile {exp_model}")
    for name in sorted(set(run_flags) | set(exp_flags)):
        if name not in run_flags:
            lines.append(f"{name}: missing (profile {show_flag_value(exp_flags[name])})")
        elif name not in exp_flags:
            lines.append(f"{name}: extra (running {show_flag_value(run_flags[name])})")
        elif not _same(run_flags[name], exp_flags[name]):
            lines.append(f"{name}: running {show_flag_value(run_flags[name])}, profile {show_flag_value(exp_flags[name])}")
    return lines


def flag_changes(old_argv: list[str] | None, new_argv: list[str]) -> list[str]:
    """Engine flags that differ between two releases, compared by meaning: ``--flag: OLD -> NEW``."""
    old_model, old_flags = normalize_argv(old_argv or [])
    new_model, new_flags = normalize_argv(new_argv)
    changes = [f"model: {show_flag_value(old_model)} -> {show_flag_value(new_model)}"] if old_argv and old_model != new_model else []
    for name in sorted(set(old_flags) | set(new_flags)):
        if old_flags.get(name) != new_flags.get(name):
            changes.append(f"{name}: {show_flag_value(old_flags.get(name))} -> {show_flag_value(new_flags.get(name))}")
    return changes
