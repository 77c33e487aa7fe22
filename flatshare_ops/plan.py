"""The plan of a node switch: a pure function of the old and the new release.

``plan(node, old, new)`` decides the steps and, per unit, whether it is
restarted, reloaded, started, removed or left unchanged, with the rules
written out as data (after NixOS's switch-to-configuration). ``--dry-run``
prints it; :mod:`.release` is the only place that carries it out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .check import normalize_argv, show_flag_value
from .render.units import ENGINE_UNIT, GATEWAY_UNIT, SERVICE_UNITS, VOICE_UNIT

#: The steps of a switch, in order (FACTS.md, "What a release does on a node").
STEPS = (
    "drain-voice",
    "stop-gateway",
    "install-units",
    "restart-engine",
    "start-gateway",
    "end-voice-drain",
    "switch-current",
    "serving-check",
    "record-history",
)

STEP_DESCRIPTIONS = {
    "drain-voice": "drain the voice worker (drain file; wait for its status written after this drain began)",
    "stop-gateway": "stop the gateway (SIGTERM: it drains, answering 503 + Retry-After: 1)",
    "install-units": "install the release's units and daemon-reload",
    "restart-engine": "restart the engine (its pre-start step builds the serve module) and wait for /health",
    "start-gateway": "start the gateway",
    "end-voice-drain": "restart the voice worker if its unit changed, then end the voice drain",
    "switch-current": "point releases/current at the new release",
    "serving-check": "run serving-check against the new release",
    "record-history": "append to releases/history.jsonl and remove the journal",
}

#: A release drains and restarts these whatever changed (the engine rebuilds its module at start).
ALWAYS_RESTARTED = (ENGINE_UNIT, GATEWAY_UNIT)
#: Unit suffixes whose change means restarting the unit; any other changed unit is only reloaded.
RESTART_ON_CHANGE = (".service", ".timer")


@dataclass(frozen=True)
class ReleaseView:
    """What a plan needs of a release.

    Attributes:
        id: the release id.
        units: unit name -> unit file text.
        argv: the engine's command line (from serving.json).
    """

    id: str
    units: dict[str, str]
    argv: list[str]


@dataclass
class Plan:
    """A switch of one node, ready to print or to carry out.

    Attributes:
        node: the node's name.
        from_id: the active release's id (None on a node's first release).
        to_id: the new release's id.
        steps: the step names, in order.
        units: unit name -> action (``restart``, ``reload``, ``start``, ``remove``, ``unchanged``).
        flag_changes: engine flags that change, ``--flag: old -> new``.
        resume: finishing an interrupted switch (every active managed unit restarts).
    """

    node: str
    from_id: str | None
    to_id: str
    steps: list[str]
    units: dict[str, str]
    flag_changes: list[str] = field(default_factory=list)
    resume: bool = False


def classify_units(old: dict[str, str] | None, new: dict[str, str], resume: bool = False) -> dict[str, str]:
    """Per unit: what the switch does to it.

    Rules, in order: units in :data:`ALWAYS_RESTARTED` restart; when resuming an
    interrupted switch every managed service restarts; a unit the old release
    did not have is started; a changed ``.service``/``.timer`` restarts; another
    changed unit (the target) is reloaded; an unchanged one is left alone; a
    unit only the old release had is removed.
    """
    actions: dict[str, str] = {}
    for name, text in new.items():
        if name in ALWAYS_RESTARTED or (resume and name in SERVICE_UNITS):
            actions[name] = "restart"
        elif old is None or name not in old:
            actions[name] = "start"
        elif old[name] != text:
            actions[name] = "restart" if name.endswith(RESTART_ON_CHANGE) else "reload"
        else:
            actions[name] = "unchanged"
    for name in sorted(set(old or {}) - set(new)):
        actions[name] = "remove"
    return actions


def flag_changes(old_argv: list[str] | None, new_argv: list[str]) -> list[str]:
    """Engine flags that differ, compared by meaning: ``--flag: OLD -> NEW``."""
    old_model, old_flags = normalize_argv(old_argv or [])
    new_model, new_flags = normalize_argv(new_argv)
    changes = [f"model: {show_flag_value(old_model)} -> {show_flag_value(new_model)}"] if old_argv and old_model != new_model else []
    for name in sorted(set(old_flags) | set(new_flags)):
        if old_flags.get(name) != new_flags.get(name):
            changes.append(f"{name}: {show_flag_value(old_flags.get(name))} -> {show_flag_value(new_flags.get(name))}")
    return changes


def plan(node: str, old: ReleaseView | None, new: ReleaseView, resume: bool = False) -> Plan:
    """The plan to switch ``node`` from ``old`` (None: no release yet) to ``new``."""
    return Plan(
        node=node,
        from_id=old.id if old else None,
        to_id=new.id,
        steps=list(STEPS),
        units=classify_units(old.units if old else None, new.units, resume),
        flag_changes=flag_changes(old.argv if old else None, new.argv),
        resume=resume,
    )


def voice_restarts(p: Plan) -> bool:
    """Whether the plan restarts the voice worker (its unit changed, or an interrupted switch is finished)."""
    return p.units.get(VOICE_UNIT) in ("restart", "start")


def describe(p: Plan) -> list[str]:
    """The plan as lines for ``--dry-run``."""
    lines = [
        f"plan for {p.node}: {p.from_id or '(no release)'} -> {p.to_id}"
        + (" (finishing an interrupted switch)" if p.resume else ""),
        "steps:",
    ]
    lines += [f"  {i}. {name}: {STEP_DESCRIPTIONS[name]}" for i, name in enumerate(p.steps, 1)]
    lines.append("units:")
    lines += [f"  {name}: {action}" for name, action in p.units.items()]
    lines.append("engine flags that change:" if p.flag_changes else "engine flags: unchanged")
    lines += [f"  {change}" for change in p.flag_changes]
    return lines
