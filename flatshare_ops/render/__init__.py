"""Pure rendering: a profile in, the text of every file the fleet runs from out.

Nothing here reads the clock, the environment or the network: the same
profile always renders byte-identical files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..config.profile import LoadedProfile
from .engine import engine_argv
from .serving import render_serving
from .units import render_units


@dataclass(frozen=True)
class Rendered:
    """Everything one profile renders to.

    Attributes:
        units: unit name -> unit file text.
        serving: the ``serving.json`` text.
        argv: the engine's command line.
        profile_json: the resolved profile as JSON (the release's record of it).
    """

    units: dict[str, str]
    serving: str
    argv: list[str]
    profile_json: str

    def release_files(self) -> dict[str, str]:
        """Files of a release directory: ``serving.json``, ``profile.json`` and ``units/NAME``."""
        files = {"serving.json": self.serving, "profile.json": self.profile_json}
        files.update({f"units/{name}": text for name, text in self.units.items()})
        return files


def render_profile(loaded: LoadedProfile) -> Rendered:
    """Render a loaded profile's units, serving.json and engine argv.

    Raises:
        ProfileError: a value would not mean to vLLM or systemd what the profile says (render.meaning).
        systemd_escape.UnsafeValueError: only if the schema let a control character through.
    """
    from . import meaning
    from .units import commands

    profile = loaded.profile
    units = render_units(profile)
    argv = engine_argv(profile.engine)
    meaning.check_engine(loaded, argv)
    meaning.check_units(loaded, units, commands(profile))
    return Rendered(
        units=units,
        serving=render_serving(loaded, units),
        argv=argv,
        profile_json=json.dumps(loaded.data, indent=2, sort_keys=True, allow_nan=False) + "\n",
    )
