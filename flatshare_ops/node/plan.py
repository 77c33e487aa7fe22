"""The plan of a node switch: a pure function of the old and the new release.

As NixOS's switch-to-configuration does (docs/reference/engineering-style.md):
the two releases' units are compared by meaning (:mod:`common.unit_file`:
parsed as systemd parses them, ``Description=`` and friends ignored, an
``ExecStart`` re-quoted to the same argv equal), and what a changed unit
costs is read from the unit itself (``X-Flatshare-Change=``), not from name
lists here:

============== ============================================================
class          what the switch does when a unit of this class changes
============== ============================================================
switch         the whole switch: drain voice and gateway, restart the engine
drain-gateway  the gateway's own drain (stop, 503 + Retry-After) and start
drain-voice    voice drain, restart the worker, end the drain
restart        restart that unit; no drain
start          start that unit; no drain
none           install the file and daemon-reload; nothing restarts
============== ============================================================

The engine's vLLM release, venv and module pin live in serving.json, not in
a unit: a change there is a ``switch`` too. Finishing an interrupted switch,
a repair and a node's first release are whole switches that restart every
managed service. ``--dry-run`` prints :func:`describe`; :mod:`.switch` is
the only place that carries a plan out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..common import unit_file
from ..common.protocol import StepName, SwitchKind
from ..common.units import ENGINE_UNIT, GATEWAY_UNIT, VOICE_UNIT
from .steps import STEPS, STEP_BY_NAME

#: Change classes, cheapest last; a unit without ``X-Flatshare-Change=`` is a ``switch``.
CHANGE_CLASSES = ("switch", "drain-gateway", "drain-voice", "restart", "start", "none")
#: serving.json fields whose change means restarting the engine (the whole switch).
ENGINE_FIELDS = (("vllm_release",), ("module", "sha256"), ("module", "path"), ("engine", "venv"),
                 ("engine", "argv"), ("engine", "url"))
#: The steps each class needs (besides the ones every switch runs: see :data:`ALWAYS`).
_CLASS_STEPS: dict[str, tuple[StepName, ...]] = {
    "switch": (StepName.DRAIN_VOICE, StepName.STOP_GATEWAY, StepName.RESTART_ENGINE, StepName.START_GATEWAY,
               StepName.END_VOICE_DRAIN),
    "drain-gateway": (StepName.STOP_GATEWAY, StepName.START_GATEWAY),
    "drain-voice": (StepName.DRAIN_VOICE, StepName.RESTART_VOICE, StepName.END_VOICE_DRAIN),
    "restart": (),
    "start": (),
    "none": (),
}
#: Steps every switch runs.
ALWAYS = (StepName.INSTALL_UNITS, StepName.APPLY_UNITS, StepName.SWITCH_CURRENT, StepName.SERVING_CHECK,
          StepName.RECORD_HISTORY)


@dataclass(frozen=True)
class ReleaseView:
    """What a plan needs of a release.

    Attributes:
        id: the release id.
        units: unit name -> unit file text.
        serving: the release's serving.json (a dict).
    """

    id: str
    units: dict[str, str]
    serving: dict

    @property
    def argv(self) -> list[str]:
        """The engine's command line."""
        return list(self.serving.get("engine", {}).get("argv", []))


@dataclass
class Plan:
    """A switch of one node, ready to print or to carry out.

    Attributes:
        node: the node's name.
        from_id: the active release's id (None on a node's first release).
        to_id: the new release's id.
        kind: what the switch is (what the history will call it).
        resume: finishing (or, for a rollback, abandoning) an interrupted switch.
        replaces: the target of an interrupted switch this one replaces (a release of another release).
        automatic: the node started this switch by itself (an automatic rollback).
        steps: the step names, in table order.
        units: unit name -> action (``restart``, ``start``, ``stop``, ``update`` (file only),
            ``remove``, ``unchanged``).
        reasons: why the engine restarts or what changed, one line each.
        flag_changes: engine flags that change, ``--flag: old -> new``.
    """

    node: str
    from_id: str | None
    to_id: str
    kind: SwitchKind
    steps: list[StepName]
    units: dict[str, str]
    reasons: list[str] = field(default_factory=list)
    flag_changes: list[str] = field(default_factory=list)
    resume: bool = False
    replaces: str | None = None
    automatic: bool = False

    @property
    def drains(self) -> bool:
        """Whether the switch takes the node out of calls (a voice drain or a gateway stop)."""
        return any(STEP_BY_NAME[s].drains for s in self.steps)


def _field(document: dict, path: tuple[str, ...]) -> object:
    for key in path:
        document = document.get(key, {}) if isinstance(document, dict) else {}
    return document


def unit_changes(old: dict[str, str], new: dict[str, str]) -> dict[str, str]:
    """Per unit: ``changed`` (by meaning), ``text`` (only the text: comments, Description=...),
    ``added``, ``removed`` or ``same``.

    A unit that cannot be read as systemd would counts as ``changed``.
    """
    result: dict[str, str] = {}
    for name, text in new.items():
        if name not in old:
            result[name] = "added"
        elif old[name] == text:
            result[name] = "same"
        else:
            try:
                same = unit_file.meaning(old[name]) == unit_file.meaning(text)
            except unit_file.UnitSyntaxError:
                same = False
            result[name] = "text" if same else "changed"
    for name in old:
        if name not in new:
            result[name] = "removed"
    return result


def _whole_switch_actions(new: dict[str, str]) -> dict[str, str]:
    actions = {}
    for name, text in new.items():
        cls = unit_file.change_class(text)
        actions[name] = {"switch": "restart", "drain-gateway": "restart", "drain-voice": "restart",
                         "restart": "restart", "start": "start", "none": "update"}.get(cls, "restart")
    return actions


def plan(node: str, old: ReleaseView | None, new: ReleaseView, kind: SwitchKind = SwitchKind.RELEASE,
         flag_changes=None, resume: bool = False, replaces: str | None = None, automatic: bool = False,
         from_id: str | None = None, not_running: tuple[str, ...] = ()) -> Plan:
    """The plan to switch ``node`` from ``old`` (None: no release yet) to ``new``.

    Args:
        kind: what the switch is; a repair is a whole switch.
        flag_changes: a function ``(old view or None, new view) -> lines`` naming the engine
            flags that change (:func:`common.vllm_argv.changes`); None to list none.
        resume: finishing or abandoning an interrupted switch: a whole switch (its
            units may be half installed).
        replaces: the target of an interrupted switch that this one replaces instead of finishing
            it (the checkout renders another release): a whole switch, straight to ``new``.
        automatic: an automatic rollback from a switch whose engine did not serve: a whole switch.
        from_id: the id of the release being left when ``old`` is None because its stored copy could not be
            read (damaged): a whole switch from it, never the node's first release.
        not_running: the managed services that are not running now (``UNIT is STATE``, systemd's
            ActiveState): a whole switch, since a plan of changes only would leave them down (and its
            end-voice-drain would wait for a voice worker nobody starts).
    """
    flags = flag_changes(old, new) if flag_changes else []
    if old is None or resume or replaces or automatic or kind == SwitchKind.REPAIR or not_running:
        reason = (f"the new engine did not serve: back to {new.id}, the release that served before it, "
                  "by the node itself; every managed service restarts" if automatic
                  else f"replacing the interrupted switch to {replaces} (never finished) with this release, "
                  "instead of finishing it first: every managed service restarts" if replaces
                  else "finishing an interrupted switch: every managed service restarts"
                  if resume and kind == SwitchKind.RELEASE
                  else "abandoning an interrupted switch: every managed service restarts" if resume
                  else "the node does not serve: every managed service restarts" if kind == SwitchKind.REPAIR
                  else f"{', '.join(not_running)}, not running now: every managed service restarts" if not_running
                  else f"the stored copy of {from_id}, the release it leaves, is damaged: every managed service "
                  "restarts" if from_id
                  else "the node's first release: every unit starts")
        return Plan(node, old.id if old else from_id, new.id, kind, [s.name for s in STEPS],
                    _whole_switch_actions(new.units), [reason], flags, resume, replaces, automatic)

    changes = unit_changes(old.units, new.units)
    classes: set[str] = set()
    actions: dict[str, str] = {}
    reasons: list[str] = []
    for name, change in changes.items():
        if change == "removed":
            actions[name] = "remove"
            reasons.append(f"{name}: removed")
            continue
        cls = unit_file.change_class(new.units[name])
        cls = cls if cls in CHANGE_CLASSES else "switch"
        if change in ("changed", "added"):
            classes.add(cls)
            actions[name] = {"none": "update", "start": "start"}.get(cls, "restart")
            reasons.append(f"{name}: {'added' if change == 'added' else 'changed'} ({cls})")
        else:
            actions[name] = "update" if change == "text" else "unchanged"
            if change == "text":
                reasons.append(name)  # its words follow the final actions (below)
    for path in ENGINE_FIELDS:
        if _field(old.serving, path) != _field(new.serving, path):
            classes.add("switch")
            reasons.append(f"serving.json {'.'.join(path)} changed: the engine restarts")
    if "switch" in classes:
        actions[ENGINE_UNIT] = "restart"
        actions[GATEWAY_UNIT] = "restart"
    reasons = [f"{r}: text only (comments or ignored keys); "
               + ("it restarts with the engine's switch all the same" if actions.get(r) == "restart"
                  else "nothing restarts") if r in changes else r for r in reasons]
    steps = set(ALWAYS)
    for cls in classes:
        steps.update(_CLASS_STEPS[cls])
    if actions.get(VOICE_UNIT) == "restart":
        steps.add(StepName.RESTART_VOICE)
    ordered = [s.name for s in STEPS if s.name in steps]
    return Plan(node, old.id, new.id, kind, ordered, actions, reasons, flags)


def plan_document(p: Plan) -> dict:
    """The plan as JSON-ready data, for the outcome (common/protocol.py ``Outcome.plan``) and ``--json``:
    every :class:`Plan` field, ``drains``, and each step's description."""
    from dataclasses import asdict

    return {**asdict(p), "drains": p.drains,
            "step_descriptions": {name: STEP_BY_NAME[name].description for name in p.steps}}


def compact(p: Plan) -> list[str]:
    """The plan in a few lines, for a release that goes ahead (the whole plan, :func:`describe`, is in
    release.log, and on the terminal with ``--dry-run`` or ``-v``): what it switches, whether it drains, which
    units restart, and each engine flag that changes."""
    acting = [f"{name} {action}" for name, action in p.units.items() if action not in ("unchanged",)]
    untouched = sum(1 for action in p.units.values() if action == "unchanged")
    lines = [f"plan for {p.node}: {p.from_id or '(no release)'} -> {p.to_id}{title(p)}: {len(p.steps)} steps, "
             + ("drains the node" if p.drains else "no drain") + "; units: "
             + (", ".join(acting) or "none change") + (f" ({untouched} unchanged)" if untouched and acting else "")]
    lines += [f"  flag {change}" for change in p.flag_changes]
    return lines


def title(p: Plan) -> str:
    """`` (rollback)``, `` (finishing an interrupted switch)``... after a switch's from -> to."""
    if p.automatic:
        return " (automatic rollback)"
    if p.replaces:
        return f" (replacing the interrupted switch to {p.replaces})"
    if p.resume:
        return (" (finishing an interrupted switch)" if p.kind == SwitchKind.RELEASE
                else " (abandoning an interrupted switch)")
    return {SwitchKind.ROLLBACK: " (rollback)", SwitchKind.REPAIR: " (repair)"}.get(p.kind, "")


def describe(p: Plan) -> list[str]:
    """The plan as lines for ``--dry-run`` and the release log."""
    lines = [
        f"plan for {p.node}: {p.from_id or '(no release)'} -> {p.to_id}{title(p)}",
        "drains the node: " + ("yes (voice worker and/or gateway)" if p.drains else "no"),
        "steps:",
    ]
    lines += [f"  {i}. {name}: {STEP_BY_NAME[name].description}" for i, name in enumerate(p.steps, 1)]
    lines.append("units:")
    lines += [f"  {name}: {action}" for name, action in p.units.items()]
    if p.reasons:
        lines.append("why:")
        lines += [f"  {reason}" for reason in p.reasons]
    if p.from_id is None and not p.flag_changes:
        lines.append("engine flags: the first release's (nothing ran before to compare with)")
    else:
        lines.append("engine flags that change:" if p.flag_changes else "engine flags: unchanged")
    lines += [f"  {change}" for change in p.flag_changes]
    return lines
