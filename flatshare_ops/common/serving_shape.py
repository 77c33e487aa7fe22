"""The shape of a release's serving.json, checked as untrusted input (standard library only).

serving.json is read by the node's switch and by serving-check every minute
(releases/README.md, "serving.json"); a file of the wrong shape or types
must be one line naming the key, never a TypeError deep in a check. One
table of the keys both read, with their types; pydantic is not used here
because serving-check may not import it (adr/0006-serving-check-cost.md).
"""

from __future__ import annotations

import math
import re

#: A unit name the node may install (systemd.unit(5): a name, a dot, the type; no path).
UNIT_NAME = re.compile(r"^[A-Za-z0-9@._-]+\.(service|target|timer)$")
SHA256 = re.compile(r"^[0-9a-f]{64}$")
#: Bounds (seconds) the node waits for: each a finite number above zero (NaN or infinity would be no bound).
BOUNDS = ("engine.start_timeout_s", "engine.stop_timeout_s", "voice.drain_timeout_s", "gateway.drain_timeout_s")

NUMBER = (int, float)
#: dotted key -> the type(s) its value must have (bool is not a number here).
KEYS: dict[str, tuple] = {
    "vllm_release": (str,),
    "engine": (dict,),
    "engine.unit": (str,),
    "engine.argv": (list,),
    "engine.url": (str,),
    "engine.venv": (str,),
    "engine.start_timeout_s": NUMBER,
    "module": (dict,),
    "module.path": (str,),
    "module.sha256": (str,),
    "units": (dict,),
    "services": (list,),
    "layout": (dict,),
    "layout.scope": (str,),
    "layout.unit_dir": (str,),
    "layout.state_dir": (str,),
    "layout.run_dir": (str,),
    "voice": (dict,),
    "voice.drain_file": (str,),
    "voice.status_file": (str,),
    "voice.drain_timeout_s": NUMBER,
    "gateway": (dict,),
    "gateway.drain_timeout_s": NUMBER,
}
#: Keys a newer serving.json may lack in an older schema, or an older one may have without.
OPTIONAL = {"engine.stop_timeout_s": NUMBER, "module.build_command": (list,), "gateway.url": (str,),
            "engine.environment": (dict,), "layout.output": (str,)}


def _get(document: dict, dotted: str):
    value = document
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


_MISSING = object()


def _type_name(value) -> str:
    return "null" if value is None else type(value).__name__


def problem(document: dict) -> str | None:
    """The first thing wrong with a serving.json's shape (``engine.argv: must be a list of strings, got
    int``), or None when the keys the node and serving-check read have the right types."""
    for key, types in {**KEYS, **OPTIONAL}.items():
        value = _get(document, key)
        if value is _MISSING:
            if key in OPTIONAL:
                continue
            return f"{key}: missing"
        if isinstance(value, bool) or not isinstance(value, types):
            return f"{key}: must be {' or '.join(t.__name__ for t in types)}, got {_type_name(value)}"
    for key in ("engine.argv", "services", "module.build_command"):
        value = _get(document, key)
        if value is not _MISSING and not all(isinstance(w, str) for w in value):
            return f"{key}: must be a list of strings"
    environment = _get(document, "engine.environment")
    if environment is not _MISSING and not all(isinstance(k, str) and isinstance(v, str) for k, v in environment.items()):
        return "engine.environment: must map variable names to strings"
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in document["units"].items()):
        return "units: must map unit names to sha256 strings"
    for name, digest in document["units"].items():
        if not UNIT_NAME.match(name):
            return f"units: {name!r} is not a unit name (NAME.service, .target or .timer; no path)"
        if not SHA256.match(digest):
            return f"units: {name}: {digest!r} is not a sha256"
    named = [("engine.unit", document["engine"]["unit"]),
             *((f"services[{i}]", name) for i, name in enumerate(document["services"]))]
    for key, name in named:
        if not UNIT_NAME.match(name):
            return f"{key}: {name!r} is not a unit name"
    for key in BOUNDS:
        value = _get(document, key)
        if value is not _MISSING and not (_finite(value) and value > 0):
            return f"{key}: must be a finite number of seconds above 0, got {value}"
    return None


def _finite(value) -> bool:
    """Whether a number is finite, totally: an integer too large for a float is not."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False
