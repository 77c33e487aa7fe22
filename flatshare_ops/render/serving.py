"""``serving.json``: the resolved profile that releases and serving-check read.

A contract with other programs (docs/reference/engineering-style.md#files-other-programs-read-are-contracts): ``schema`` is bumped on
any incompatible change; the fields are described in ``releases/README.md``.
"""

from __future__ import annotations

import json

from ..common.hashing import sha256_text
from ..common.units import ENGINE_UNIT, SERVICE_UNITS
from ..config.profile import LoadedProfile
from .engine import engine_argv
from .units import drain_file, drain_status_file, engine_environment, engine_url, service_user

SERVING_SCHEMA = 1


def render_serving(loaded: LoadedProfile, units: dict[str, str]) -> str:
    """The ``serving.json`` text for a profile and its rendered units.

    Args:
        loaded: the loaded profile.
        units: unit name -> rendered text (from :func:`.units.render_units`).

    Returns:
        Pretty-printed JSON with sorted keys and a final newline: byte-identical
        for the same inputs.
    """
    profile = loaded.profile
    document = {
        "schema": SERVING_SCHEMA,
        "profile": {"name": profile.name, "sha256": loaded.sha256()},
        "vllm_release": profile.engine.vllm_release,
        "engine": {
            "unit": ENGINE_UNIT,
            "argv": engine_argv(profile.engine),
            "url": engine_url(profile),
            "venv": profile.engine.venv,
            "environment": engine_environment(profile),
            "user": service_user(profile),
            "start_timeout_s": profile.engine.start_timeout_s,
            "stop_timeout_s": profile.engine.stop_timeout_s,
        },
        "module": {"name": profile.module.name, "path": profile.module.path, "sha256": profile.module.sha256,
                   "build_command": list(profile.module.build_command)},
        "units": {name: sha256_text(text) for name, text in units.items()},
        "services": list(SERVICE_UNITS),
        "layout": profile.layout.model_dump(),
        "gateway": {"url": profile.gateway.url, "drain_timeout_s": profile.gateway.drain_timeout_s},
        "voice": {"drain_file": drain_file(profile), "status_file": drain_status_file(profile),
                  "drain_timeout_s": profile.voice.drain_timeout_s},
    }
    return json.dumps(document, indent=2, sort_keys=True, allow_nan=False) + "\n"
