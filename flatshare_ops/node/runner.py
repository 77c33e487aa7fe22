"""Carrying out one plan: every step journaled, and the one early-end rule for whatever stops it.

The plan is data (node/plan.py); this loop is the only place that acts on it
(docs/reference/engineering-style.md, "Plans are data"). Each step is journaled
``running`` before it runs and ``done`` after (adr/0004-release-journal.md), the
last step (``record-history``) included, and the journal is removed once the
switch is recorded: so a killed run leaves a journal that says exactly where it
stopped, and the next run finishes or replaces that switch.

The one early-end rule (:func:`early_end`): whatever ends a switch early (a
failed step, any OSError at any write, Ctrl-C, SIGTERM), the voice drain is
ended; the gateway is started again if this switch stopped it and the engine
answers /health (waiting, bounded by what is left of the start budget, for an
engine still loading, and starting one this switch stopped but had not started
again); the failure is recorded (or printed, if even that write
fails); and the journal stays as last written. The lock is released by the
caller's ``with``.

A switch whose engine did not come up, or whose serving-check is CRITICAL after
it, may instead be rolled back by the node itself (node/switch.py): then the
drain is kept, the failure is recorded, and :class:`RollbackNeeded` carries why.
"""

from __future__ import annotations

import errno
import getpass
import os
import signal
import socket
import time
from pathlib import Path

from ..common.protocol import SUCCEEDED, RefusedFor, StepName, StepState, SwitchKind, SwitchPhase
from ..common.http import HTTP_TIMEOUT_S, http_get, wait_for_200
from ..common.units import ENGINE_UNIT, GATEWAY_UNIT
from ..errors import FlatshareError, NodeStateError, Refused, SwitchFailed, SystemdError
from . import drain, journal as journals
from .records import append_abandoned, append_failure
from .context import NodeContext
from .output import ReleaseOutput
from .plan import Plan, ReleaseView
from .steps import DEFAULT_STOP_TIMEOUT_S, STEP_BY_NAME, NotAdmitted, StepError, Switch, old_engine_gone

#: Steps whose failure means the new engine does not serve: the ones a node may roll back by itself.
ENGINE_VERDICTS = (StepName.RESTART_ENGINE, StepName.SERVING_CHECK)


class Interrupted(BaseException):
    """SIGTERM (or SIGINT) ended the switch: handled by the early-end rule like any failure."""

    def __init__(self, signal_name: str) -> None:
        super().__init__(signal_name)
        self.signal_name = signal_name


class JournalNotWritten(Refused):
    """A switch's first journal write failed: the switch changed nothing. ``cause`` says why, without the
    advice the message gives the operator."""

    def __init__(self, cause: str, message: str) -> None:
        super().__init__(message)
        self.cause = cause


#: The signals a failed switch keeps blocked while it hands over to its automatic rollback (:class:`RollbackNeeded`).
HANDED_OVER = {signal.SIGINT, signal.SIGTERM}


class RollbackNeeded(Exception):
    """The new engine did not serve (``step`` failed with ``reason``); the failure is recorded and the node is
    still drained (``switch``: the failed switch, its drain and stopped gateway), for the caller to switch back.
    SIGINT and SIGTERM are blocked (:data:`HANDED_OVER`) when it is raised: the caller unblocks them once what a
    signal would end (the rollback, or this switch's early end) is in place."""

    def __init__(self, switch: Switch, step: str, reason: str, engine_output: list[str]) -> None:
        super().__init__(reason)
        self.switch, self.step, self.reason, self.engine_output = switch, step, reason, engine_output


def new_journal(ctx: NodeContext, p: Plan, switch_id: str, rollout: str | None, commit: str | None,
                began: float, forced: bool = False, resumed: int = 0, auto: str | None = None) -> journals.Journal:
    """The journal of a switch about to start (every step pending); ``began``: when its run took the lock."""
    return journals.Journal(
        from_=p.from_id, to=p.to_id, node=ctx.node, host=socket.gethostname(), pid=os.getpid(),
        user=getpass.getuser(), started_at=began, forced=forced, resumed=resumed, kind=p.kind,
        switch=switch_id, rollout=rollout, commit=commit, auto=auto,
        steps=[journals.StepRecord(name=s) for s in p.steps],
    )


def run(ctx: NodeContext, p: Plan, new: ReleaseView, out: ReleaseOutput, journal: journals.Journal,
        abandon: tuple[journals.Journal, str] | None = None, roll_back_on_failure: bool = False,
        drain_kept: drain.VoiceDrain | None = None, readmit=None,
        admitted_at: float = 0.0) -> dict[str, tuple[float, float]]:
    """Carry out plan ``p``: journal each step; on any early end apply the early-end rule.

    Args:
        abandon: an interrupted switch this one replaces, and why: its journal is superseded by
            this switch's first journal write, and only then recorded as abandoned.
        roll_back_on_failure: when the engine does not serve (:data:`ENGINE_VERDICTS`), record the
            failure, keep the drain, and raise :class:`RollbackNeeded` instead of ending early.
        drain_kept: the voice drain a switch this one continues left in place (an automatic rollback).
        readmit, admitted_at: the admission to drain decided again, and when it was decided
            (``time.monotonic()``): the gateway's stop decides it again when it is old (node/steps.py).

    Returns:
        Each step's (start, end), ``time.monotonic()`` seconds: what the outcome's durations are made of.

    Raises:
        JournalNotWritten: the journal could not be written at all (nothing was changed).
        RollbackNeeded: see ``roll_back_on_failure``.
        SwitchFailed: a step failed, a write failed, or a signal ended the switch.
    """
    sw = Switch(ctx, p, new, out, journal=journal, readmit=readmit, admitted_at=admitted_at)
    if drain_kept is not None:
        sw.drain, sw.gateway_stopped = drain_kept, True
    try:
        journals.write_journal(ctx.state_dir, journal)
    except OSError as err:
        raise JournalNotWritten(f"could not write the journal ({describe_failure(err)})",
                                f"{ctx.node}: could not write the journal ({describe_failure(err)}): nothing was "
                                "changed; free the space or fix the filesystem, then run the command again") from None
    step = "journal"
    phase = SwitchPhase.ROLLING_BACK if p.automatic else SwitchPhase.SWITCHING
    out.stage(phase)
    try:
        if abandon is not None:
            append_abandoned(ctx, abandon[0], out, abandon[1])
        for number, step in enumerate(p.steps, 1):
            out.stage(phase, step)
            out.line(f"step {number}/{len(p.steps)} {step}")
            journals.mark(ctx.state_dir, journal, step, StepState.RUNNING)
            started = time.monotonic()
            STEP_BY_NAME[step].run(sw)
            sw.timings[step] = (started, time.monotonic())
            journals.mark(ctx.state_dir, journal, step, StepState.DONE)
    except NotAdmitted as err:
        if abandon is None and drain_kept is None and not journal.resumed and not journal.auto \
                and all(s == StepName.DRAIN_VOICE for s in p.steps[:p.steps.index(StepName(step))]):
            _refused_midway(sw, str(err))
        _end_early(sw, step, str(err))
    except StepError as err:
        if roll_back_on_failure and step in ENGINE_VERDICTS:
            # SIGINT and SIGTERM wait (blocked, pending) from here until the automatic rollback is under way:
            # a signal between the failure's record and the rollback's start would end neither of them.
            signal.pthread_sigmask(signal.SIG_BLOCK, HANDED_OVER)
            _record_failure(sw, step, str(err), verdict=True)
            raise RollbackNeeded(sw, step, str(err), list(err.engine_output)) from None
        _end_early(sw, step, str(err), verdict=step in ENGINE_VERDICTS)
    except (Exception, KeyboardInterrupt, Interrupted) as err:
        _end_early(sw, step, describe_failure(err))
    try:
        journals.remove_journal(ctx.state_dir)
    except OSError as err:  # the switch is recorded: the next run finds it so and removes the journal
        out.line(f"  note: the switch is recorded, but its journal could not be removed ({describe_failure(err)}); "
                 "the next release removes it")
    sw.out.line(f"{ctx.node}: {SUCCEEDED[p.kind]} {p.to_id}" + (" (automatically)" if journal.auto else ""))
    return sw.timings


def _refused_midway(sw: Switch, reason: str) -> None:
    """The admission decided again during the drain was refused before anything but the voice drain happened
    (a switch of its own: not finishing, replacing or rolling back another, whose journal this one superseded):
    calls given back, the journal removed (nothing to finish), nothing recorded, and the switch refused like any
    refusal before it began.

    Raises:
        Refused: always (exit 3), saying what became of calls.
    """
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        sw.out.stage(SwitchPhase.ENDING_EARLY, sw.out.step)
        calls = give_back(sw)
        try:
            journals.remove_journal(sw.ctx.state_dir)
        except OSError as err:
            sw.out.line(f"  note: its journal could not be removed ({describe_failure(err)}); the next release "
                        "finishes or replaces it")
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    raise Refused(f"{sw.ctx.node}: {reason}; nothing was changed (calls: {calls}: its voice drain ended and its "
                  "gateway never stopped)", waits_for=RefusedFor.ADMISSION)


def _end_early(sw: Switch, step: str, reason: str, verdict: bool = False) -> None:
    ctx, p = sw.ctx, sw.plan
    early_end(sw, step, reason, verdict=verdict)
    number = p.steps.index(StepName(step)) + 1 if step in p.steps else 0
    where = f"step {number}/{len(p.steps)} {step}" if number else "writing the journal"
    if p.kind == SwitchKind.ROLLBACK:  # a rollback cut short goes on to where it was going (node/switch.py)
        then = (f"the next 'flatshare rollback' goes on to {p.to_id} once the cause is fixed, restarting every "
                "managed unit; 'flatshare release' switches to the checkout's release instead")
    else:
        then = (f"the next 'flatshare release' finishes the switch to {p.to_id} once the cause is fixed, "
                "restarting every managed unit (or switches to the checkout's release if that is another); "
                "'flatshare rollback' abandons it instead")
    raise SwitchFailed(f"{ctx.node}: {where} failed: {reason}. The journal ({ctx.journal_path}) is kept: {then}") from None


def describe_failure(err: BaseException) -> str:
    """One line for what ended a switch: the step's message, or the file and errno of a failed write."""
    if isinstance(err, Interrupted):
        return f"interrupted by {err.signal_name}"
    if isinstance(err, KeyboardInterrupt):
        return "interrupted by SIGINT (Ctrl-C)"
    if isinstance(err, OSError):
        where = f"{err.filename}: " if err.filename else ""
        if not err.errno and err.strerror:  # common.files.NotAFile: what is there, no errno to name
            return f"{where}{err.strerror}"
        name = errno.errorcode.get(err.errno, str(err.errno)) if err.errno else type(err).__name__
        return f"{where}{name} ({err.strerror or err})"
    if isinstance(err, FlatshareError):
        return str(err)
    return f"{type(err).__name__}: {err}"


def _record_failure(sw: Switch, step: str, reason: str, calls: str | None = None, verdict: bool = False) -> None:
    """Mark ``step`` failed in the journal and record the switch as failed (once per switch id). ``verdict``: the
    failure says the release does not serve (an engine verdict step's own failure, never a signal or a write),
    so that the release is no longer a rollback target (node/history.py ``served_releases``)."""
    ctx, journal, out = sw.ctx, sw.journal, sw.out
    assert journal is not None  # run() gives every switch its journal
    try:
        if step in [s.name for s in journal.steps]:
            journals.mark(ctx.state_dir, journal, step, StepState.FAILED, reason)
    except OSError as err:
        out.line(f"  could not write the journal ({describe_failure(err)}); it stays as last written")
    try:
        append_failure(ctx, journal, step, reason, verdict=verdict, **({"calls": calls} if calls else {}))
    except (OSError, NodeStateError, ValueError) as err:
        out.line(f"  could not record the failure in {ctx.history_path} ({describe_failure(err)}): "
                 f"switch {journal.switch} to {journal.to} failed at {step}: {reason}")


def early_end(sw: Switch, step: str, reason: str, recorded: bool = False, verdict: bool = False) -> str:
    """The one early-end rule. Never raises: each part is tried, and a part that fails is printed.

    Args:
        recorded: the failure is in the history already (a failed switch whose automatic rollback could not
            begin): calls are given back, nothing is recorded again.
        verdict: the failure says the release does not serve (:func:`_record_failure`).

    Returns:
        What became of calls, one line (:func:`give_back`).
    """
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        sw.out.stage(SwitchPhase.ENDING_EARLY, step)
        calls = give_back(sw)
        if not recorded:
            _record_failure(sw, step, reason, calls, verdict=verdict)
        return calls
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def give_back(sw: Switch) -> str:
    """End the voice drain, and start the gateway again if this switch stopped it and the engine answers
    (waiting for an engine still loading, bounded by what is left of its start budget; never for one seen
    exiting during its start, which systemd's Restart= only runs again); returns what became of calls, one
    line, for the record."""
    ctx, out = sw.ctx, sw.out
    voice = sw.serving.get("voice", {})
    files = [Path(voice.get("drain_file", "/nonexistent"))]
    if sw.drain is not None:  # where this switch drained (the running worker's own files)
        files.insert(0, sw.drain.drain_file)
    said = []
    for drain_file in dict.fromkeys(files):
        try:
            if drain.end_if_present(drain_file):
                out.line("  voice drain ended early: the worker takes calls again")
        except OSError as err:
            out.line(f"  could not remove {drain_file} ({describe_failure(err)}): the voice worker stays drained; "
                     f"remove it by hand (rm {drain_file})")
            said.append(f"{drain_file} left in place")
    if not sw.gateway_stopped:
        return "; ".join(said) or "given back"
    url = sw.serving["engine"]["url"] + "/health"
    status = http_get(url, HTTP_TIMEOUT_S)[0]
    if status != 200 and sw.engine_stopped and not _engine_starting(sw):
        _start_engine_again(sw)
    left = (sw.engine_deadline - time.monotonic()) if sw.engine_deadline is not None else 0.0
    if status != 200 and left > 0 and _engine_starting(sw):
        out.line(f"  the engine is still starting: waiting for {url} (up to {left:.0f} s, what is left of its "
                 "start budget) before starting the gateway again")
        status = wait_for_200(url, left, sw.progress(f"{url} to answer 200", left))
    if status == 200:
        try:
            ctx.manager.job("start", GATEWAY_UNIT, 60, sw.progress(f"{GATEWAY_UNIT} to start", 60))
            out.line(f"  {GATEWAY_UNIT} started again (the engine answers /health)")
            sw.gateway_stopped = False
            return "; ".join(said) or "given back"
        except SystemdError as err:
            out.line(f"  could not start {GATEWAY_UNIT} again: {err}")
            return "; ".join([*said, f"{GATEWAY_UNIT} could not be started again: {err}"])
    out.line(f"  {GATEWAY_UNIT} left stopped: the engine does not answer {url}")
    return "; ".join([*said, f"{GATEWAY_UNIT} left stopped: the engine did not answer {url}"])


def _start_engine_again(sw: Switch) -> None:
    """The switch ended between the engine's stop and its start (a signal, a stop that failed): start the engine
    as its unit now stands, its start budget counted from now, so that the early end can wait for it and give
    calls back; a start systemd refuses is said, and the gateway then stays stopped. Started only once none of
    the old engine's processes remain in its control group (and, where the node has ``nvidia-smi``, the GPU's
    memory is free: :func:`.steps.old_engine_gone`, within the engine's stop budget); otherwise it is left
    stopped and the line says what remains."""
    engine = sw.serving["engine"]
    start_s = float(engine["start_timeout_s"])
    sw.out.line(f"  {ENGINE_UNIT} was stopped by this switch and is not running: starting it again (up to "
                f"{start_s:g} s, its start budget) so that calls can be given back")
    sw.engine_stopped = False
    try:  # never beside what is left of the old engine (two engine cores on one card: vLLM issue 55510)
        old_engine_gone(sw, float(engine.get("stop_timeout_s", DEFAULT_STOP_TIMEOUT_S)))
    except StepError as err:
        sw.out.line(f"  {ENGINE_UNIT} left stopped: {err}")
        return
    sw.engine_deadline = time.monotonic() + start_s
    try:
        sw.ctx.manager.job("start", ENGINE_UNIT, start_s, sw.progress(f"the start job on {ENGINE_UNIT}", start_s))
    except SystemdError as err:
        sw.engine_deadline = None
        sw.out.line(f"  could not start {ENGINE_UNIT} again: {err}")


def _engine_starting(sw: Switch) -> bool:
    try:
        state = sw.ctx.manager.properties([(ENGINE_UNIT, "Unit", "ActiveState")])[f"{ENGINE_UNIT}/ActiveState"]
    except SystemdError:
        return False
    return state in ("active", "activating", "reloading")
