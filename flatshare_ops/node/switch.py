"""A node switch, carried out on the node: what to do, whether it may, then doing it.

This is the only module that decides what a release does to a node. It runs
on the node itself (``flatshare-node switch``, started by the operator's side
locally or over SSH), so that a dropped SSH session cannot stop it halfway:
its output goes to ``releases/release.log`` whatever happens to the terminal
(:mod:`.output`), and every step is journaled (:mod:`.runner`,
adr/0004-release-journal.md) so a killed run is finished by the next one.

One run is at most one switch, decided before anything changes, as NixOS'
switch-to-configuration computes its actions, then acts:

1. take the node's lock (:mod:`.lock`); read its state as untrusted input: an
   operator's hold, the active release, an interrupted switch (its journal),
   the history;
2. decide the one switch (:func:`decide`): finish the interrupted switch when
   the checkout renders its release, else replace it with the checkout's release
   in one whole switch (never finish a broken release first); repair a release
   that does not serve; a release; a rollback;
3. every refusal (:mod:`.refusals`): E2 drop-ins, the engine venv, the
   preflight, and the admission to drain, asked once for the switch's drain;
4. store the release, and run the plan (:mod:`.runner`). A release whose new
   engine does not serve goes back to the release that served before it, by
   the node itself (``auto_rollback``), still drained and holding the lock.

Whatever refuses gives calls back (:func:`.calls.give_calls_back`: a drain
file left behind is removed, a stopped gateway with a healthy engine started)
and changes nothing else.
"""

from __future__ import annotations

import os
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

from ..common import protocol
from ..common.protocol import (SUCCEEDED, AnalysisPhase, Mode, OutcomeResult, RecordKind, RecordResult, StepName,
                               SwitchKind, SwitchPhase)
from ..errors import Exit, FlatshareError, NodeStateError, Refused, SwitchFailed, SystemdError
from . import hold, journal as journals
from .bundle import bundle_view, load_view, stored_matches, validate_bundle  # noqa: F401  (validate_bundle: cli)
from .calls import active_serving, give_calls_back, services_down
from .context import NodeContext
from .lock import node_lock
from .output import ReleaseOutput
from .plan import Plan, ReleaseView, compact, describe, plan, plan_document, title
from .prune import prune
from .records import read_history
from .refusals import Admission, admit_to_drain, refuse_node_state, refuse_what_cannot_start
from .runner import RollbackNeeded, describe_failure, new_journal, run
from .store import current_release, ensure_releases_dir, is_stored, store_release
from . import history as histories

#: The operator's side's go-ahead (node/cli.py ``confirm``): called with whether to say that it asks; None to go
#: on, else why not.
GoAhead = Callable[[bool], str | None]


@dataclass
class Request:
    """What the operator's side asked of the node.

    Attributes:
        mode: a release (to ``bundle``), a rollback (the node's rollback rule) or an undo of rollout ``undo``
            (back to what ran before it).
        bundle: ``{"id", "files", "commit"?}`` for a release, else None.
        force: release even with E2 drop-ins linked (recorded).
        dry_run: decide and print everything; change nothing.
        switch: this switch's id (the operator's, so it can ask about it after a lost connection).
        rollout: the rollout this switch belongs to, recorded in history.
        undo: the rollout to undo (mode ``undo-rollout``).
        auto_rollback: a release whose new engine does not serve goes back by itself.
        full_plan: print the whole plan (:func:`.plan.describe`); else a compact one (:func:`.plan.compact`),
            the whole plan going to release.log only.
        preflight_only: (with ``dry_run``) the fleet's preflight before a rollout: the refusals and the preflight
            only, no plan printed, no admission asked; a passing preflight is kept for the switch to reuse
            (node/refusals.py), and the engine's missing home is made as the switch would make it.
    """

    mode: Mode = Mode.RELEASE
    bundle: dict | None = None
    force: bool = False
    dry_run: bool = False
    switch: str = ""
    rollout: str | None = None
    undo: str | None = None
    auto_rollback: bool = True
    full_plan: bool = True
    preflight_only: bool = False

    def __post_init__(self) -> None:
        self.switch = self.switch or uuid.uuid4().hex[:16]

    @property
    def action(self) -> Mode:
        """``release`` or ``rollback`` (an undo of a rollout is one), for messages."""
        return Mode.RELEASE if self.mode == Mode.RELEASE else Mode.ROLLBACK


@dataclass
class Done:
    """What a run did: the exit code, the result word (:mod:`common.protocol`), the release the node is on,
    and what else the outcome says (an automatic rollback's cause)."""

    code: int
    result: OutcomeResult
    release: str | None = None
    message: str | None = None
    detail: dict = field(default_factory=dict)
    first: bool = False  # the node's first release: it had none before this switch
    unjudged: str | None = None  # nothing to do: the switch that installed the release, never judged (protocol)
    before: str | None = None  # the release before the switch (protocol.Outcome: these four, and plan)
    commit: str | None = None
    drained_s: float | None = None
    engine_start_s: float | None = None
    plan: dict = field(default_factory=dict)


@dataclass
class State:
    """The node's state when the run began (read under its lock)."""

    current: str | None
    pending: journals.Journal | None
    hist: histories.History


@dataclass
class Work:
    """The one switch to carry out: its plan, its release, its journal's resume count, what it replaces."""

    plan: Plan
    new: ReleaseView
    resumed: int = 0
    abandon: tuple[journals.Journal, str] | None = None
    forced: bool = False
    admitted_at: float = 0.0


def switch_node(ctx: NodeContext, request: Request, out: ReleaseOutput, admit: Admission,
                confirm: GoAhead | None = None) -> Done:
    """Carry out one request on this node: at most one switch.

    Args:
        ctx: the node.
        request: what the operator's side asked.
        out: where progress lines go (terminal and release.log).
        admit: the admission to drain (asked only when the switch drains a node that takes calls).
        confirm: when the operator's side asked for it (the bundle's ``confirm``), its go-ahead, asked after the
            refusals and the preflight, before the admission to drain and any change (also when there is nothing
            to switch): None to go on, else why not (the switch is refused with it).

    Returns:
        A :class:`Done` (``Exit.OK``, ``Exit.NOTHING_TO_DO`` or ``Exit.ROLLED_BACK``).

    Raises:
        Refused, SwitchFailed, NodeStateError, SystemdError, FlatshareError.
    """
    if request.bundle is not None:
        validate_bundle(request.bundle)
    if request.mode == Mode.RELEASE and request.bundle is None:
        raise FlatshareError("node switch: a release needs its bundle on stdin")
    ensure_releases_dir(ctx.state_dir)
    began = time.time()
    if request.dry_run:
        return _run(ctx, request, out, admit, began, confirm=confirm)
    with node_lock(ctx, (request.bundle or {}).get("id"), action=request.action, mode=request.mode) as holder:
        return _run(ctx, request, out, admit, began, holder, confirm)


def _analyses(hist, switch: str | None):
    """The ``analysed`` records of ``switch`` in the history, oldest first, each with its analysis document
    (``{}`` when the record holds none that is an object)."""
    for r in hist.records:
        if switch is not None and r.get("switch") == switch and r.get("result") == RecordResult.ANALYSED:
            yield r, r.get("analysis") if isinstance(r.get("analysis"), dict) else {}


def unjudged_switch(hist, current: str | None) -> str | None:
    """The id of the release switch that installed ``current`` when no canary analysis of it passed or was
    skipped (history's ``analysed`` records), else None; None too when the history does not say (no such
    switch recorded) or it was the node's first release."""
    if current is None:
        return None
    installed = next((r for r in reversed(hist.records) if r.get("kind") != RecordKind.ANALYSIS
                      and r.get("after") == current and r.get("result") == RecordResult.RELEASED
                      and isinstance(r.get("switch"), str)), None)
    if installed is None or installed.get("before") is None:
        return None  # a node's first release is never analysed, whichever run finishes its rollout
    if any(a.get("skipped") is True or a.get("phase") == AnalysisPhase.PASSED
           for _, a in _analyses(hist, installed["switch"])):
        return None
    return installed["switch"]


def failed_analysis(hist, switch: str | None) -> str | None:
    """The rollout whose canary analysis of ``switch`` failed (not a dry run), or None: a failed analysis decides
    a rollback, which is owed until the node leaves that release (the rollout that finds it carries it out)."""
    failed = [r for r, a in _analyses(hist, switch)
              if a.get("phase") == AnalysisPhase.FAILED and a.get("dry_run") is not True]
    if not failed:
        return None
    return failed[-1].get("rollout") if isinstance(failed[-1].get("rollout"), str) else "an earlier rollout"


def _go_on(request: Request, confirm: GoAhead | None, say: bool = True) -> None:
    """Ask the operator's side whether to go on (``confirm``), when it asked to be asked; ``say``: with a line
    saying so (none where the node has just said it has nothing to do: the ask is then only for the operator's
    retry guard, and a refusal says itself).

    Raises:
        Refused: it said not to (its reason).
    """
    reason = confirm(say) if confirm is not None else None
    if reason is not None:
        raise Refused(f"{request.action} refused: {reason}")


def _run(ctx: NodeContext, request: Request, out: ReleaseOutput, admit: Admission, began: float,
         holder=lambda _target: None, confirm: GoAhead | None = None) -> Done:
    state = None
    with _calls_given_back_on_refusal(ctx, request, out, lambda: state):
        hold.refuse_if_held(ctx, request.action)
        state = State(current_release(ctx.state_dir), journals.read_journal(ctx.state_dir, ctx.node), read_history(ctx))
        for note in state.hist.skipped:
            out.line(f"note: {ctx.history_path.parent / note}")
        work = decide(ctx, request, out, state)
        if work is None:
            _go_on(request, confirm, say=False)
            if request.mode == Mode.RELEASE:  # nothing to switch, but what the release enables stays enabled
                from .steps import keep_enabled

                assert request.bundle is not None  # a release has its bundle (switch() refuses one without)
                keep_enabled(ctx, bundle_view(request.bundle).units, out, request.dry_run)
            unjudged = unjudged_switch(state.hist, state.current)
            owed = failed_analysis(state.hist, unjudged)
            return Done(Exit.NOTHING_TO_DO, OutcomeResult.NOTHING_TO_DO, state.current, unjudged=unjudged,
                        detail={"analysis_failed_in": owed} if owed else {}, before=state.current)
        if request.mode != Mode.RELEASE:  # a rollback's target is decided just now: lock.json names it from here on
            holder(work.new.id)
        _refuse(ctx, request, out, work, admit, confirm)
        if request.preflight_only:
            return Done(Exit.OK, OutcomeResult.PLANNED, state.current, before=state.current,
                        commit=(request.bundle or {}).get("commit"), plan=plan_document(work.plan))
        if request.dry_run:
            out.line("dry run: nothing changed")
            return Done(Exit.OK, OutcomeResult.PLANNED, state.current, before=state.current,
                        commit=(request.bundle or {}).get("commit"), plan=plan_document(work.plan))
        if request.bundle is not None:
            _store(ctx, request, out)
        journal = new_journal(ctx, work.plan, request.switch, request.rollout,
                              (request.bundle or {}).get("commit"), began, work.forced, work.resumed)
        return _carry_out(ctx, request, out, work, state, journal, admit)  # a Refused here: the journal was never written


@contextmanager
def _calls_given_back_on_refusal(ctx: NodeContext, request: Request, out: ReleaseOutput, state) -> Iterator[None]:
    """Whatever refuses before the switch starts gives calls back (never in a dry run), then is raised."""
    try:
        yield
    except (Refused, NodeStateError, SystemdError):
        if not request.dry_run:
            current = state().current if state() is not None else None
            bundle_serving = bundle_view(request.bundle).serving if request.bundle else None
            give_calls_back(ctx, active_serving(ctx, current) or bundle_serving, out)
        raise


def decide(ctx: NodeContext, request: Request, out: ReleaseOutput, state: State) -> Work | None:
    """The one switch this request needs (None: nothing to do); prints why."""
    pending, hist = state.pending, state.hist
    if pending is not None and pending.switch and pending.switch in {
            r.get("switch") for r in hist.records if r.get("served") and r.get("target") == pending.to}:
        out.line(f"note: the journal's switch {pending.switch} is already recorded as finished; removing the journal")
        if not request.dry_run:
            journals.remove_journal(ctx.state_dir)
        pending = None
    if request.mode in (Mode.ROLLBACK, Mode.UNDO_ROLLOUT):
        return _rollback_work(ctx, request, out, state.current, pending, hist)
    assert request.bundle is not None  # a release has its bundle (switch() refuses one without)
    target = request.bundle["id"]
    new = bundle_view(request.bundle)  # the bundle is the release itself (a damaged stored copy is replaced)
    if pending is not None and pending.to == target:
        out.line(f"an interrupted {journals.journal_summary(pending)} is finished first (the checkout renders it)")
        old = _old_view(ctx, pending.from_, out)
        return Work(plan(ctx.node, old, new, pending.kind, _flag_changes, resume=True, from_id=pending.from_), new,
                    pending.resumed + 1,
                    forced=pending.forced)
    if pending is not None:
        out.line(f"an interrupted {journals.journal_summary(pending)} is replaced: the checkout renders {target}, "
                 "so the node switches straight to it (the interrupted release is not started again)")
        old = _old_view(ctx, pending.to, out)
        return Work(plan(ctx.node, old, new, SwitchKind.RELEASE, _flag_changes, replaces=pending.to,
                         from_id=pending.to), new,
                    abandon=(pending, f"replaced by the switch to {target}"))
    if state.current == target:
        problems = _unhealthy(ctx, out)
        if not problems:
            out.stage(SwitchPhase.NOTHING_TO_DO)  # before it says so: the operator knows it when it reads the line
            out.line(f"{ctx.node}: already on {target}; nothing to do")
            return None
        out.line(f"{ctx.node}: already on {target}, but it does not serve ({'; '.join(problems)}): "
                 "switching again to repair it")
        return Work(plan(ctx.node, new, new, SwitchKind.REPAIR, _flag_changes), new)
    old = _old_view(ctx, state.current, out)
    return Work(plan(ctx.node, old, new, SwitchKind.RELEASE, _flag_changes, from_id=state.current,
                     not_running=_services_not_running(ctx) if old is not None else ()), new)


def _services_not_running(ctx: NodeContext) -> tuple[str, ...]:
    """The managed services that are not active now (node/calls.py ``services_down``), for a plan of changes
    only: none such plan would start them (node/plan.py ``not_running``)."""
    try:
        return tuple(services_down(ctx))
    except SystemdError:
        return ()  # the switch's own systemd calls name the trouble


def _intact(ctx: NodeContext, rid: str, out: ReleaseOutput) -> bool:
    """Whether release ``rid`` is stored and its files make its id: an automatic rollback (the node drained, its
    new engine not serving) goes to the newest release that served of which this holds, never to a damaged
    copy; one passed over is named. (An operator's rollback to a damaged one is refused, naming the damage.)"""
    if not is_stored(ctx.state_dir, rid):
        return False
    try:
        load_view(ctx, rid)
    except NodeStateError as err:
        out.line(f"note: release {rid} served, but is passed over as a rollback target: {err}")
        return False
    return True


def _rollback_work(ctx, request: Request, out, current, pending, hist) -> Work | None:
    stored = lambda rid: is_stored(ctx.state_dir, rid)  # noqa: E731  (a damaged target is refused, named)
    # What the rollback leaves: the current release, or an interrupted switch's target; but an interrupted
    # rollback (an automatic one cut short by a signal or a full disk included) was leaving its own "from": a
    # rollback now goes on to where it was going (excluding its target, the release that served, would leave
    # the node "no earlier release that served" to return to).
    leaving = (pending.from_ if pending is not None and pending.kind == SwitchKind.ROLLBACK else
               pending.to if pending is not None else current)
    hist.in_order()  # which switch came last decides both rollbacks: never guessed from a history out of order
    if request.mode == Mode.UNDO_ROLLOUT:
        target = _before_rollout(hist, pending, request.undo)
        if target is None:
            out.stage(SwitchPhase.NOTHING_TO_DO)  # before it says so: the operator knows it when it reads the line
            out.line(f"{ctx.node}: its last switch is not part of rollout {request.undo}; nothing to do")
            return None
        if target == current and pending is None:
            out.stage(SwitchPhase.NOTHING_TO_DO)  # before it says so: the operator knows it when it reads the line
            out.line(f"{ctx.node}: already on {target}, what it ran before rollout {request.undo}; nothing to do")
            return None
        if not stored(target):
            raise Refused(f"rollback refused: {ctx.node}'s release before rollout {request.undo} ({target}) is no "
                          "longer stored")
    else:
        target = histories.rollback_target(hist, leaving, stored)
        if target is None:
            raise Refused(f"rollback refused: {ctx.node} has no earlier release that served still stored to "
                          f"return to (it is leaving {leaving or 'no release'})")
    if pending is not None:
        out.line(f"the interrupted {journals.journal_summary(pending)} will be abandoned")
    new = load_view(ctx, target)
    old_id = pending.to if pending is not None else current
    return Work(plan(ctx.node, _old_view(ctx, old_id, out), new, SwitchKind.ROLLBACK, _flag_changes,
                     resume=pending is not None, from_id=old_id), new,
                abandon=(pending, "abandoned by rollback") if pending is not None else None)


def _before_rollout(hist: histories.History, pending, rollout: str | None) -> str | None:
    """What the node ran before rollout ``rollout``: the ``before`` of its first switch in that rollout,
    provided the node's last switch (or its interrupted one) belongs to it."""
    switches = [r for r in hist.records if r.get("kind") != RecordKind.ANALYSIS]  # an analysis is no switch
    last_rollout = pending.rollout if pending is not None else (switches[-1] if switches else {}).get("rollout")
    if not rollout or last_rollout != rollout:
        return None
    firsts = [r for r in switches if r.get("rollout") == rollout]
    if firsts:
        return firsts[0].get("before")
    return pending.from_ if pending is not None else None


def _old_view(ctx: NodeContext, rid: str | None, out: ReleaseOutput) -> ReleaseView | None:
    """The release being replaced, for the plan; a damaged or missing one makes it a whole switch."""
    if not rid:
        return None
    try:
        return load_view(ctx, rid)
    except NodeStateError as err:
        out.line(f"note: {err}; planning a whole switch")
        return None


def _unhealthy(ctx: NodeContext, out: ReleaseOutput) -> list[str]:
    """serving-check's CRITICAL and UNKNOWN findings for the active release (empty when it serves, and when
    serving-check gives no report: that is said, and no unit is restarted for the check's own trouble)."""
    from ..common.serving_report import CRITICAL, UNKNOWN
    from .serving_check import NoReport, run_serving_check

    try:
        report = run_serving_check(ctx, note=lambda said: out.line(f"note: {said}"))
    except NoReport as err:
        out.line(f"note: {err}: whether {ctx.node} serves is not known here; the timer's serving-check says")
        return []
    return [f"{f.check}: {f.summary}" for f in report.findings if f.status in (CRITICAL, UNKNOWN)]


def _flag_changes(old: ReleaseView | None, new: ReleaseView) -> list[str]:
    """The engine flags a switch changes, read as the new release's vLLM reads them."""
    from ..common import vllm_argv

    release = str(new.serving.get("vllm_release", vllm_argv.DEFAULT_RELEASE))
    try:
        before = vllm_argv.read_argv(old.argv, release) if old is not None else None
        return vllm_argv.changes(before, vllm_argv.read_argv(new.argv, release))
    except (ValueError, TypeError) as err:
        return [f"(flags not compared: {err})"]


def _refuse(ctx: NodeContext, request: Request, out: ReleaseOutput, work: Work, admit: Admission,
            confirm: GoAhead | None = None) -> None:
    """Every refusal, decided before any change: foreign drop-ins, the engine venv, the preflight, the operator's
    go-ahead when it asked to be asked (``confirm``), the admission (a preflight-only run: no plan printed, no
    admission)."""
    if request.preflight_only:
        pass
    elif request.full_plan or request.dry_run:
        for line in describe(work.plan):
            out.line(line)
    else:
        for line in describe(work.plan):
            out.log_only(line)
        for line in compact(work.plan):
            out.line(line)
    work.forced = refuse_node_state(ctx, work.new.serving, request.force, out, request.action) or work.forced
    histories.refuse_unwritable(ctx.history_path)  # its last step records it: found there, the node was drained for nothing
    if StepName.RESTART_ENGINE in work.plan.steps:
        refuse_what_cannot_start(ctx, work.new, out, request.action, request.dry_run and not request.preflight_only)
    _go_on(request, confirm)
    if work.plan.drains and not request.preflight_only:
        admit_to_drain(ctx, work.plan, work.new, out, admit, request.action)
        work.admitted_at = time.monotonic()


def _store(ctx: NodeContext, request: Request, out: ReleaseOutput) -> None:
    """Store the bundle's release before anything else changes (a copy found damaged is stored again).

    Raises:
        Refused: it could not be stored (a full or read-only disk): nothing was changed.
    """
    bundle = request.bundle
    assert bundle is not None  # stored only when there is one
    stored = is_stored(ctx.state_dir, bundle["id"])
    damaged = stored and not stored_matches(ctx, bundle)
    if stored and not damaged:
        return
    if damaged:
        out.line(f"note: the stored copy of release {bundle['id']} differs from the bundle (damaged): storing it again")
    running = os.environ.get("FLATSHARE_SWITCHER")  # the shipped switcher running this (node/entry.py)
    files = {**bundle["files"], **({"switcher": running + "\n"} if running else {})}
    try:
        store_release(ctx.state_dir, bundle["id"], files, replace=damaged)
    except OSError as err:
        raise Refused(f"release refused: {ctx.node} could not store release {bundle['id']} "
                      f"({describe_failure(err)}): nothing was changed; free the space or fix the filesystem, "
                      "then release again") from None


def _carry_out(ctx: NodeContext, request: Request, out: ReleaseOutput, work: Work, state: State,
               journal: journals.Journal, admit: Admission) -> Done:
    p = work.plan
    back_to = _auto_rollback_target(ctx, request, p, state, out)
    out.line(f"{ctx.node}: switching {p.from_id or '(no release)'} -> {p.to_id}{title(p)}")
    try:
        timings = run(ctx, p, work.new, out, journal, abandon=work.abandon, roll_back_on_failure=back_to is not None,
                      readmit=_readmission(ctx, p, work.new, out, admit, request.action), admitted_at=work.admitted_at)
    except RollbackNeeded as failure:
        assert back_to is not None  # raised only with roll_back_on_failure
        return _roll_back_automatically(ctx, request, out, work, failure, back_to, admit)
    _prune(ctx, out)
    # The outcome says what the history records of the switch (node/records.py ``append_success``).
    return Done(Exit.OK, OutcomeResult(SUCCEEDED[p.kind]), p.to_id, first=p.from_id is None, before=p.from_id,
                commit=(request.bundle or {}).get("commit"), **_durations(timings), plan=plan_document(p))


def _durations(timings: dict[str, tuple[float, float]]) -> dict:
    """The outcome's ``drained_s`` and ``engine_start_s`` from a run's step timings (seconds; None when the
    switch did not drain, or did not restart the engine)."""
    engine = timings.get(StepName.RESTART_ENGINE)
    return {"drained_s": protocol.drain_window(timings),
            "engine_start_s": round(engine[1] - engine[0], 3) if engine else None}


def _readmission(ctx: NodeContext, p: Plan, new: ReleaseView, out: ReleaseOutput, admit: Admission, action: str):
    """The admission to drain of plan ``p``, to be decided again by its gateway's stop (node/steps.py
    ``stop_gateway``); None when the plan drains nothing. Raises ``Refused`` when not admitted."""
    if not p.drains:
        return None
    return lambda: admit_to_drain(ctx, p, new, out, admit, action, again=True)


def _auto_rollback_target(ctx: NodeContext, request: Request, p: Plan, state: State, out: ReleaseOutput) -> str | None:
    """The release a failed release or repair goes back to by itself: the newest that served, other than the
    new one, still stored (the node's rollback rule); None when off or there is none (it then says so)."""
    if not request.auto_rollback or p.kind not in (SwitchKind.RELEASE, SwitchKind.REPAIR) \
            or StepName.RESTART_ENGINE not in p.steps:
        return None
    try:
        target = histories.rollback_target(state.hist, p.to_id, lambda rid: _intact(ctx, rid, out))
    except histories.HistoryOrderError as err:
        out.line(f"{ctx.node}: automatic rollback: none possible ({err}): if the new engine does not serve, the "
                 "switch ends early and the node stays failed")
        return None
    if target is None:
        out.line(f"{ctx.node}: automatic rollback: none possible (no earlier release that served is stored): "
                 "if the new engine does not serve, the switch ends early and the node stays failed")
    return target


def _roll_back_automatically(ctx: NodeContext, request: Request, out: ReleaseOutput, work: Work,
                             failure: RollbackNeeded, back_to: str, admit: Admission) -> Done:
    """The new engine did not serve: switch back to ``back_to`` (still holding the lock), with the same steps,
    journaled like any switch, recorded as an automatic rollback saying why.

    A failure found after the switch gave calls back (serving-check CRITICAL, its gateway answering again) makes
    the rollback's drain a new drain of a node callers are served at: it is admitted on its own, as every drain
    is (node/refusals.py ``admit_to_drain``); a refusal ends the failed switch by the early-end rule, the node
    serving the new release, and says why.

    Whatever keeps the rollback from beginning (its stored release damaged, its journal not written on a full or
    read-only disk, a signal before its first step) ends the failed switch by the early-end rule, its journal
    kept; once the rollback has begun, its own early-end rule holds.

    Raises:
        SwitchFailed: the rollback could not begin, or began and ended early (the message says which, and why).
    """
    import signal

    from .runner import HANDED_OVER, Interrupted, JournalNotWritten, early_end

    why = f"{failure.step} failed: {failure.reason}"
    try:
        out.line(f"{ctx.node}: the new release does not serve ({why}); rolling back to {back_to} by itself")
        out.stage(SwitchPhase.ROLLING_BACK)  # before its admission: an ask unanswered now leaves the failed release
        detail = {"failed_release": work.plan.to_id, "failed_step": failure.step, "reason": failure.reason,
                  "engine_output": failure.engine_output, "rolled_back_to": back_to}
        new = load_view(ctx, back_to)
        p = plan(ctx.node, work.new, new, SwitchKind.ROLLBACK, _flag_changes, automatic=True)
        for line in describe(p):
            out.line(line)
        admit_to_drain(ctx, p, new, out, admit, "automatic rollback")
        admitted_at = time.monotonic()
        journal = new_journal(ctx, p, request.switch, request.rollout, None, time.time(), auto=why)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, HANDED_OVER)  # the rollback's own early-end rule holds now
        timings = run(ctx, p, new, out, journal, drain_kept=failure.switch.drain,
                      readmit=_readmission(ctx, p, new, out, admit, "automatic rollback"), admitted_at=admitted_at)
    except SwitchFailed as err:
        raise SwitchFailed(f"{ctx.node}: {why}; the automatic rollback to {back_to} failed too: {err}") from None
    except (Exception, KeyboardInterrupt, Interrupted) as err:
        signal.pthread_sigmask(signal.SIG_BLOCK, HANDED_OVER)
        try:
            cause = (err.cause if isinstance(err, JournalNotWritten) else str(err)
                     if isinstance(err, (Refused, NodeStateError)) else describe_failure(err))
            failure.switch.out.line(f"  cannot roll back: {cause}")
            calls = early_end(failure.switch, failure.step, failure.reason, recorded=True)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, HANDED_OVER)
        raise SwitchFailed(
            f"{ctx.node}: {why}; the automatic rollback to {back_to} could not begin ({cause}); calls: {calls}; "
            "the journal of the failed "
            "switch is kept: fix the cause and release again, or 'flatshare rollback'") from None
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, HANDED_OVER)
    _prune(ctx, out)
    # The drain began in the failed switch and ended in its rollback: both runs' steps make its window.
    drained = {**timings, **{k: v for k, v in failure.switch.timings.items() if k in protocol.DRAIN_STEPS}}
    return Done(Exit.ROLLED_BACK, OutcomeResult.AUTO_ROLLED_BACK, back_to, why, detail, before=work.plan.from_id,
                commit=(request.bundle or {}).get("commit"), **_durations(drained), plan=plan_document(work.plan))


def _prune(ctx: NodeContext, out: ReleaseOutput) -> None:
    from .runner import Interrupted

    try:
        for removed in prune(ctx, read_history(ctx)):
            out.line(f"removed old release {removed}")
    except (OSError, FlatshareError, Interrupted, KeyboardInterrupt) as err:
        out.line(f"note: old releases were not pruned ({describe_failure(err)}); the switch itself is done")
