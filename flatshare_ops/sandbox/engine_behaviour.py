"""What the stand-in engine does: chosen at start (its unit's environment) or while it runs (its control endpoint).

Standard library only. docs/reference/stand-ins.md#engine-behaviour describes each field; the
engine's module docstring says where a test changes it.

| field | environment variable | meaning |
| --- | --- | --- |
| ``ttft_s`` | ``FLATSHARE_STANDIN_TTFT_S`` | seconds from a request's start (a seat free) to its first token (0.02) |
| ``token_s`` | ``FLATSHARE_STANDIN_TOKEN_S`` | seconds between two tokens, read at every token (0.01) |
| ``error_share`` | ``FLATSHARE_STANDIN_ERROR_SHARE`` | share of requests that end in ``error`` (0) |
| ``abort_share`` | ``FLATSHARE_STANDIN_ABORT_SHARE`` | share of requests that end in ``abort`` (0) |
| ``metrics`` | ``FLATSHARE_STANDIN_METRICS`` | ``vllm`` (vLLM's series), ``empty`` or ``malformed`` |
| ``answer_shift`` | ``FLATSHARE_STANDIN_ANSWER_SHIFT`` | from this token position on (0 the first), answers' token ids differ from every other stand-in's (none: "") |
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any, Mapping

METRICS_MODES = ("vllm", "empty", "malformed")
#: field -> the environment variable that sets it at start.
ENVIRONMENT = {
    "ttft_s": "FLATSHARE_STANDIN_TTFT_S",
    "token_s": "FLATSHARE_STANDIN_TOKEN_S",
    "error_share": "FLATSHARE_STANDIN_ERROR_SHARE",
    "abort_share": "FLATSHARE_STANDIN_ABORT_SHARE",
    "metrics": "FLATSHARE_STANDIN_METRICS",
    "answer_shift": "FLATSHARE_STANDIN_ANSWER_SHIFT",
}
#: The longest time to first token or between tokens a behaviour may ask for (seconds).
MAX_DELAY_S = 600.0


class BehaviourError(ValueError):
    """A behaviour that cannot be: one line naming the field, the rule and the value."""


@dataclass(frozen=True)
class Behaviour:
    """The stand-in engine's chosen behaviour (see the module's table)."""

    ttft_s: float = 0.02
    token_s: float = 0.01
    error_share: Fraction = Fraction(0)
    abort_share: Fraction = Fraction(0)
    metrics: str = "vllm"
    answer_shift: int | None = None

    def as_dict(self) -> dict:
        """JSON-ready (shares as floats)."""
        return {"ttft_s": self.ttft_s, "token_s": self.token_s, "error_share": float(self.error_share),
                "abort_share": float(self.abort_share), "metrics": self.metrics, "answer_shift": self.answer_shift}


def _delay(name: str, value: Any) -> float:  # any JSON value: float() says whether it is a number
    try:
        number = float(value) if not isinstance(value, bool) else None
    except (TypeError, ValueError):
        number = None
    if number is None or not 0 <= number <= MAX_DELAY_S:
        raise BehaviourError(f"{name}: must be a number of seconds from 0 to {MAX_DELAY_S:g}, got {value!r}")
    return number


def _share(name: str, value: object) -> Fraction:
    try:
        share = Fraction(str(value)) if not isinstance(value, bool) else None
    except (TypeError, ValueError, ZeroDivisionError):
        share = None
    if share is None or not 0 <= share <= 1:
        raise BehaviourError(f"{name}: must be a share from 0 to 1 (0.25 is one request in four), got {value!r}")
    return share


def _mode(name: str, value: object) -> str:
    if value not in METRICS_MODES:
        raise BehaviourError(f"{name}: must be one of {', '.join(METRICS_MODES)}, got {value!r}")
    return str(value)


def _position(name: str, value: object) -> int | None:
    if value is None:
        return None
    try:
        number = int(str(value)) if not isinstance(value, bool) else None
    except ValueError:
        number = None
    if number is None or not 0 <= number <= 100_000:
        raise BehaviourError(f"{name}: must be a token position from 0 to 100000, got {value!r}")
    return number


_READERS = {"ttft_s": _delay, "token_s": _delay, "error_share": _share, "abort_share": _share, "metrics": _mode,
            "answer_shift": _position}


def changed(behaviour: Behaviour, document: Mapping[str, object], source: Mapping[str, str] | None = None) -> Behaviour:
    """``behaviour`` with the fields ``document`` gives; all of them or none.

    Args:
        source: field -> the name to use in messages (default the field's own name).

    Raises:
        BehaviourError: an unknown field, a value out of range, or shares that add up to more than 1.
    """
    names = source or {}
    unknown = sorted(set(document) - set(_READERS))
    if unknown:
        raise BehaviourError(f"{unknown[0]}: not a behaviour field; fields: {', '.join(_READERS)}")
    values: dict[str, Any] = {field: _READERS[field](names.get(field, field), value)  # each its field's type
                              for field, value in document.items()}
    result = replace(behaviour, **values)
    if result.error_share + result.abort_share > 1:
        raise BehaviourError(f"error_share + abort_share: must be at most 1, got "
                             f"{float(result.error_share):g} + {float(result.abort_share):g}")
    return result


def from_environment(environ: Mapping[str, str]) -> Behaviour:
    """The behaviour the engine starts with: the defaults, changed by the variables of :data:`ENVIRONMENT` set.

    Raises:
        BehaviourError: a variable with a value out of range (the message names the variable).
    """
    given = {field: environ[variable] for field, variable in ENVIRONMENT.items() if environ.get(variable, "") != ""}
    return changed(Behaviour(), given, ENVIRONMENT)


class Outcomes:
    """How each request ends, spread evenly and exactly: in every run of D requests since the shares
    were set (D the shares' common denominator: 4 for 0.25, 10 for 0.3), exactly ``share × D`` end in
    ``error`` and in ``abort``; the others end in ``length`` (they produce their ``max_tokens``).

    The order is nginx's smooth weighted round robin over the three weights, so no run of requests is
    all errors when the share is small.
    """

    def __init__(self, error_share: Fraction, abort_share: Fraction) -> None:
        denominator = math.lcm(error_share.denominator, abort_share.denominator)
        self.weights = {"error": int(error_share * denominator), "abort": int(abort_share * denominator)}
        self.weights["length"] = denominator - sum(self.weights.values())
        self.total = denominator
        self.current = dict.fromkeys(self.weights, 0)
        self.lock = threading.Lock()

    def next(self) -> str:
        """The next request's finish reason: ``length``, ``error`` or ``abort``."""
        with self.lock:
            for reason, weight in self.weights.items():
                self.current[reason] += weight
            chosen = max(self.current, key=lambda reason: self.current[reason])
            self.current[chosen] -= self.total
            return chosen
