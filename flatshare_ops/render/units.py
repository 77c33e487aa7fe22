"""The systemd units a profile renders to, from the jinja2 templates beside this file.

Every value from the profile passes through :mod:`.systemd_escape` filters
(``exec``, ``env``, ``spec``, ``seconds``); templates never splice raw text.
"""

from __future__ import annotations

import functools
from pathlib import PurePosixPath

import jinja2

from ..common.unit_output import output_file
from ..common.units import (CHECK_SERVICE, ENGINE_UNIT, GATEWAY_UNIT, GATEWAY_URL_VARIABLE, UNIT_NAMES, VOICE_DRAIN_NAME,
                             VOICE_DRAIN_VARIABLE, TURN_HINTS_VARIABLE, VOICE_STATUS_NAME, VOICE_STATUS_VARIABLE,
                             VOICE_UNIT)
from ..config.profile import Profile
from . import systemd_escape
from .engine import engine_argv

#: How much longer than the gateway's drain timeout systemd waits before SIGKILL (seconds).
GATEWAY_STOP_MARGIN_S = 10.0


@functools.cache
def _environment() -> jinja2.Environment:
    """The units' Jinja2 environment, made once per process: it keeps each template compiled (Jinja2's own
    cache, checked against the template file's mtime), so a release that renders several profiles (the
    checkout's outputs, each node's) compiles each template once; compiling is most of what rendering costs."""
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("flatshare_ops.render", "templates"),
        autoescape=False,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    env.filters["exec"] = systemd_escape.exec_command
    env.filters["env"] = systemd_escape.environment_assignment
    env.filters["spec"] = systemd_escape.escape_specifiers
    env.filters["seconds"] = systemd_escape.seconds
    return env


def drain_file(profile: Profile) -> str:
    """Path of the voice worker's drain file on a node (the release creates it to drain)."""
    return str(PurePosixPath(profile.layout.run_dir) / VOICE_DRAIN_NAME)


def drain_status_file(profile: Profile) -> str:
    """Path of the status file the voice worker writes while draining."""
    return str(PurePosixPath(profile.layout.run_dir) / VOICE_STATUS_NAME)


def engine_url(profile: Profile) -> str:
    """Base URL of the engine's API server, e.g. ``http://127.0.0.1:8000``."""
    host = profile.engine.host
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{profile.engine.port}"


def engine_wait_argv(profile: Profile) -> list[str]:
    """The gateway's pre-start step: flatshare-ops' Python (beside serving-check, ``OPS/.venv/bin``) waits for the
    engine's ``/health`` within the engine's start budget (common/engine_ready.py)."""
    python = str(PurePosixPath(profile.check.command[0]).parent / "python")
    return [python, "-m", "flatshare_ops.common.engine_ready", engine_url(profile) + "/health",
            systemd_escape.number(profile.engine.start_timeout_s)]


def check_argv(profile: Profile) -> list[str]:
    """serving-check's command on a node: the profile's command, told the node's state directory."""
    return [*profile.check.command, "--state-dir", profile.layout.state_dir]


#: The engine's home, below the node's state directory (:func:`engine_home`).
ENGINE_HOME_NAME = "engine"


def engine_home(profile: Profile) -> str:
    """The engine's ``HOME`` on a node: ``STATE_DIR/engine`` (``/var/lib/flatshare/engine`` in production).

    vLLM keeps its caches under ``$HOME/.cache/vllm`` (``VLLM_CACHE_ROOT``'s default, vllm/envs.py), its
    compile cache among them: what makes a restart with torch.compile fast. The service user made by
    bootstrap has no home of its own (``useradd --system --no-create-home``), and vLLM 0.32.0's engine
    core fails at start without a writable one (docs/reference/systemd.md, "The engine's home").
    """
    return str(PurePosixPath(profile.layout.state_dir) / ENGINE_HOME_NAME)


def engine_state_directory(profile: Profile) -> str | None:
    """The engine unit's ``StateDirectory=`` (relative to ``/var/lib``), or None.

    Only the system manager's state root is ``/var/lib`` (systemd.exec(5), ``StateDirectory=``): a
    system-scope node whose state directory lies below it gets the engine's home made by systemd at every
    start, owned by the unit's ``User=``, and kept across restarts and reboots. Elsewhere bootstrap makes it.
    """
    home = PurePosixPath(engine_home(profile))
    if profile.layout.scope != "system" or not home.is_relative_to("/var/lib"):
        return None
    return str(home.relative_to("/var/lib"))


def engine_private_tmp(profile: Profile) -> bool:
    """Whether the engine unit gets ``PrivateTmp=yes``: on a node whose system manager runs its units (system
    scope, its run directory under ``/run``, that manager's runtime root).

    vLLM 0.32.0 makes the sockets between its API server and engine core in ``$TMPDIR`` (``VLLM_RPC_BASE_PATH``,
    vllm/envs.py) and leaves them there when it stops, three a start; a ``/tmp`` of the unit's own is removed
    when it stops (systemd.exec(5)). A user manager cannot make the mount namespace (the sandbox's system-scope
    node runs one, with a runtime root of its own: its engine then fails to start), so it is left out there.
    """
    layout = profile.layout
    return layout.scope == "system" and PurePosixPath(layout.run_dir).parent == PurePosixPath("/run")


def service_user(profile: Profile) -> str | None:
    """The services' ``User=``: the layout's service user on a system-scope node, else None (the manager's)."""
    return profile.layout.service_user if profile.layout.scope == "system" else None


def engine_environment(profile: Profile) -> dict[str, str]:
    """The engine unit's ``Environment=``: ``HOME`` (:func:`engine_home`, unless the profile sets one), the
    profile's ``engine.environment`` and ``PYTHONPATH`` (the serve module's directory, where ``--scheduler-cls``
    is imported from), sorted by name. serving.json carries it, so the node's preflight runs vLLM with the
    environment the engine will have."""
    return dict(sorted({"HOME": engine_home(profile), **profile.engine.environment,
                        "PYTHONPATH": profile.module.directory}.items()))


def _context(profile: Profile) -> dict:
    engine = profile.engine
    engine_env = list(engine_environment(profile).items())
    common = [("FLATSHARE_ENGINE_URL", engine_url(profile)), ("FLATSHARE_RUN_DIR", profile.layout.run_dir)]
    gateway_env = [*common, (GATEWAY_URL_VARIABLE, profile.gateway.url),
                   ("FLATSHARE_DRAIN_TIMEOUT_S", systemd_escape.number(profile.gateway.drain_timeout_s))]
    voice_env = [
        *common,
        (GATEWAY_URL_VARIABLE, profile.gateway.url),  # a call's turns stream through the node's gateway
        (TURN_HINTS_VARIABLE, "1" if profile.voice.turn_hints else "0"),
        ("FLATSHARE_ENDPOINTING_MIN_S", systemd_escape.number(profile.voice.endpointing_min_s)),
        ("FLATSHARE_ENDPOINTING_MAX_S", systemd_escape.number(profile.voice.endpointing_max_s)),
        (VOICE_DRAIN_VARIABLE, drain_file(profile)),
        (VOICE_STATUS_VARIABLE, drain_status_file(profile)),
    ]
    user = service_user(profile)
    return {
        "profile": profile,
        "scope": profile.layout.scope,
        "user": systemd_escape.escape_specifiers(user) if user else None,
        "engine_env": engine_env,
        "gateway_env": gateway_env,
        "voice_env": voice_env,
        "engine_argv": engine_argv(engine),
        "engine_state_directory": engine_state_directory(profile),
        "engine_private_tmp": engine_private_tmp(profile),
        "module_build": profile.module.build_command,
        "gateway_stop_timeout_s": profile.gateway.drain_timeout_s + GATEWAY_STOP_MARGIN_S,
        "engine_wait": engine_wait_argv(profile),
        "check_argv": check_argv(profile),
        "run_dir_name": PurePosixPath(profile.layout.run_dir).name,
        # unit -> the file its output is appended to, or None for the journal (profile layout.output)
        "output": {unit: output_file(profile.layout.output, unit)
                   for unit in (ENGINE_UNIT, GATEWAY_UNIT, VOICE_UNIT, CHECK_SERVICE)},
    }


def commands(profile: Profile) -> dict[tuple[str, str], list[str]]:
    """(unit, key) -> the one argv each rendered command line runs (render.meaning reads them back)."""
    return {
        (ENGINE_UNIT, "ExecStart"): engine_argv(profile.engine),
        (ENGINE_UNIT, "ExecStartPre"): list(profile.module.build_command),
        (GATEWAY_UNIT, "ExecStartPre"): engine_wait_argv(profile),
        (GATEWAY_UNIT, "ExecStart"): list(profile.gateway.command),
        (VOICE_UNIT, "ExecStart"): list(profile.voice.command),
        (CHECK_SERVICE, "ExecStart"): check_argv(profile),
    }


def unit_programs(profile: Profile) -> list[str]:
    """Absolute paths of every program the units run (each ``Exec*=`` line's first word)."""
    return [
        engine_argv(profile.engine)[0],
        profile.module.build_command[0],
        profile.gateway.command[0],
        engine_wait_argv(profile)[0],
        profile.voice.command[0],
        profile.check.command[0],
    ]


def render_units(profile: Profile) -> dict[str, str]:
    """Render every unit of a profile.

    Args:
        profile: a validated profile.

    Returns:
        Unit name -> unit file text, in :data:`UNIT_NAMES` order.

    Raises:
        systemd_escape.UnsafeValueError: a value holds a control character
            (the profile schema refuses these first).
    """
    env = _environment()
    context = _context(profile)
    return {name: env.get_template(f"{name}.j2").render(context) for name in UNIT_NAMES}
