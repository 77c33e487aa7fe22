"""The step table: every step a switch can take, with what it does and what it touches.

One table (:data:`STEPS`) that the plan (which steps), the dry run (their
descriptions) and the switch (their functions) all read; a step's name
exists once, in common/protocol.py's ``StepName`` (the names cross to the
operator's side), and each name has one step here. Each function takes the :class:`Switch` in progress and is
idempotent, so that finishing an interrupted switch is simply running the
steps again (adr/0004-release-journal.md). Every wait is bounded and says
so, and prints a line at least every 10 s (common.poll).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ..common import durable
from ..common.files import Damaged, read_bytes
from ..common.protocol import DRAIN_STEPS, StepName
from ..common.units import CHECK_TIMER, ENGINE_UNIT, GATEWAY_UNIT, TARGET_UNIT, VOICE_UNIT
from ..errors import FlatshareError, Refused, SystemdError
from . import drain
from .context import NodeContext
from .output import ReleaseOutput
from ..common.text import clip, one_line

if TYPE_CHECKING:  # plan.py imports this module
    from .journal import Journal
    from .plan import Plan, ReleaseView

#: How long starting the gateway or the voice worker, or a unit's reload, may take (seconds).
UNIT_JOB_S = 60.0
#: Added to the gateway's drain timeout for its stop job (its unit's TimeoutStopSec is drain + 10 s).
GATEWAY_STOP_MARGIN_S = 30.0
#: The engine's stop budget when serving.json does not say (its ``engine.stop_timeout_s`` is optional).
DEFAULT_STOP_TIMEOUT_S = 90.0
#: How long the voice worker may take to say it serves again after the drain ends (seconds).
VOICE_SERVING_S = 30.0
#: How old an admission to drain may be when the gateway stops (seconds): older (the voice drain waited for
#: calls to end, up to ``voice.drain_timeout_s``), it is asked again, so that the drain every caller notices
#: is admitted on what the other nodes are now, not on what they were before the wait.
ADMISSION_FRESH_S = 5.0


class StepError(FlatshareError):
    """A step could not do its work; the switch ends early (the message says what and why).

    Attributes:
        engine_output: the engine's last lines of output, when they say why (a failed start).
    """

    def __init__(self, message: str, engine_output: list[str] | tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.engine_output = list(engine_output)


@dataclass
class Switch:
    """One switch in progress: what the steps share.

    Attributes:
        ctx: the node.
        plan: the plan being carried out (:class:`.plan.Plan`).
        new: the release switched to (:class:`.plan.ReleaseView`).
        out: where progress lines go.
        journal: the switch's journal (node/journal.py), which the last step records.
        drain: the voice drain this switch opened, if any.
        gateway_stopped: this switch stopped the gateway (the early end starts it again).
        engine_deadline: ``time.monotonic()`` at which the engine's start budget ends, once its
            start job began (the early end waits for an engine still loading until then); None again
            once the engine was seen exiting during that start (systemd would only run the same
            command line again: the early end does not wait for it).
        engine_stopped: this switch stopped (or was stopping) the engine and had not yet asked systemd to start it:
            the early end starts it again, within its start budget (a node is never left out of service by a
            switch ended between the engine's stop and its start).
        engine_output_mark: where the engine's output stood when this switch started it
            (:func:`common.unit_output.output_mark`): a failed start quotes only what came after.
        readmit: decides the admission to drain again (node/refusals.py ``admit_to_drain`` for this switch's
            plan; raises ``Refused``), None when the plan drains nothing.
        admitted_at: ``time.monotonic()`` when the admission was last decided.
        timings: step name -> (start, end) in ``time.monotonic()`` seconds, for each step that ran to its end.
    """

    ctx: NodeContext
    plan: Plan
    new: ReleaseView
    out: ReleaseOutput
    journal: Journal | None = None
    drain: drain.VoiceDrain | None = None
    gateway_stopped: bool = False
    engine_deadline: float | None = None
    engine_stopped: bool = False
    engine_output_mark: tuple[str, float] | None = None
    notes: list[str] = field(default_factory=list)
    readmit: Callable[[], None] | None = None
    admitted_at: float = 0.0
    timings: dict[str, tuple[float, float]] = field(default_factory=dict)

    @property
    def serving(self) -> dict:
        """The new release's serving.json."""
        return self.new.serving

    def progress(self, what: str, bound_s: float) -> Callable[[float], None]:
        """A progress callback for a wait (``waited`` seconds of ``bound_s``): :meth:`ReleaseOutput.waiting`."""
        return lambda waited: self.out.waiting(what, waited, bound_s)

    def job(self, verb: str, unit: str, timeout_s: float) -> None:
        """Run one systemd job and wait for it (bounded), with progress lines."""
        self.out.line(f"  {verb} {unit}: waiting for systemd's job (up to {timeout_s:g} s)")
        self.ctx.manager.job(verb, unit, timeout_s, self.progress(f"the {verb} job on {unit}", timeout_s))


class NotAdmitted(StepError):
    """The admission to drain, decided again during the drain (:func:`decide_again`), was refused."""


def decide_again(sw: Switch, when: str) -> None:
    """Decide the admission to drain again when it is older than :data:`ADMISSION_FRESH_S` (``when``: what is
    about to happen, for the line that says so).

    Raises:
        NotAdmitted: refused now (the operator's side's reason).
    """
    age = time.monotonic() - sw.admitted_at
    if sw.readmit is None or age <= ADMISSION_FRESH_S:
        return
    sw.out.line(f"  the admission to drain was decided {age:.0f} s ago (more than {ADMISSION_FRESH_S:g} s): "
                f"deciding it again {when}")
    try:
        sw.readmit()
    except Refused as err:
        raise NotAdmitted(f"not admitted {when}: {err}") from None
    sw.admitted_at = time.monotonic()


def drain_voice(sw: Switch) -> None:
    from .calls import loaded_voice_files

    voice = sw.serving["voice"]
    drain_file, status_file = Path(voice["drain_file"]), Path(voice["status_file"])
    state = sw.ctx.manager.properties([(VOICE_UNIT, "Unit", "ActiveState")])[f"{VOICE_UNIT}/ActiveState"]
    running = state in ("active", "reloading", "activating")
    loaded = loaded_voice_files(sw.ctx) if running else None
    if loaded is not None and loaded.drain_file != drain_file:
        # The worker systemd runs watches other files (its release set another layout.run_dir): drained there;
        # the new release's drain file is written too, so that its worker comes up drained after its restart.
        sw.out.line(f"  the running voice worker watches {loaded.drain_file} (its loaded unit's): draining it there")
        drain.begin(drain_file, status_file)
        drain_file, status_file = loaded.drain_file, loaded.status_file
    sw.drain = drain.begin(drain_file, status_file)
    if not running:
        # Not running (a first release, a repair): no calls to wait for; it starts drained, and the
        # drain ends once it runs again.
        sw.out.line(f"  {VOICE_UNIT} is {state}: no calls to drain")
        return
    timeout_s = float(voice["drain_timeout_s"])
    sw.out.line(f"  drain {sw.drain.drain_id}: waiting for the voice worker (up to {timeout_s:g} s)")
    status = drain.wait_drained(sw.drain, timeout_s, progress=lambda line: sw.out.line(f"  {line}"),
                                waiting=sw.progress("the voice worker to drain", timeout_s),
                                check=lambda: decide_again(sw, "while the voice worker drains"))
    sw.out.line(f"  voice worker drained (status written {time.time() - float(status['written_at']):.1f} s ago)")


def stop_gateway(sw: Switch) -> None:
    decide_again(sw, "before the gateway stops")
    sw.gateway_stopped = True  # from here on, an early end starts it again
    sw.job("stop", GATEWAY_UNIT, float(sw.serving["gateway"]["drain_timeout_s"]) + GATEWAY_STOP_MARGIN_S)


def install_units(sw: Switch) -> None:
    unit_dir = Path(sw.serving["layout"]["unit_dir"])
    unit_dir.mkdir(parents=True, exist_ok=True)
    for name, action in sw.plan.units.items():
        if action == "remove":
            sw.job("stop", name, UNIT_JOB_S)
            if durable.remove(unit_dir / name):
                sw.out.line(f"  removed {unit_dir / name}")
    for name, text in sw.new.units.items():
        path = unit_dir / name
        try:  # never blocking on what is there: a FIFO or a device is refused (and replacing it fails, named)
            same = read_bytes(path) == text.encode()
        except Damaged:
            same = False
        if not same:
            durable.write_atomic(path, text.encode())
            sw.out.line(f"  installed {path}")
    sw.ctx.manager.reload()  # always: mtimes can hide a change (docs/reference/systemd.md)
    sw.out.line("  daemon-reload done")


def restart_engine(sw: Switch) -> None:
    """Stop the engine within its stop budget, then start it within its start budget.

    The start budget (``start_timeout_s``) counts from the start job's
    beginning, including the module build in ``ExecStartPre``, as systemd's
    ``TimeoutStartSec`` does; stopping has its own budget and never shortens it.
    """
    engine = sw.serving["engine"]
    start_s = float(engine["start_timeout_s"])
    stop_s = float(engine.get("stop_timeout_s", DEFAULT_STOP_TIMEOUT_S))
    before = _invocation(sw)
    sw.engine_stopped = True  # from here until its start job is queued, an early end starts it again
    sw.job("stop", ENGINE_UNIT, stop_s + 10)
    old_engine_gone(sw, stop_s)
    from ..common.unit_output import output_mark

    sw.engine_output_mark = output_mark(sw.serving["layout"], ENGINE_UNIT)
    started = time.monotonic()
    sw.engine_deadline = started + start_s
    try:
        sw.job("start", ENGINE_UNIT, start_s)
    except SystemdError as err:
        sw.engine_stopped = False
        raise _failed_start(sw, str(err)) from None
    sw.engine_stopped = False
    if _invocation(sw) == before:
        raise StepError(f"{ENGINE_UNIT}: InvocationID did not change; the engine was not restarted")
    url = engine["url"] + "/health"
    remaining = max(1.0, start_s - (time.monotonic() - started))
    sw.out.line(f"  waiting for {url} to answer 200 (up to {remaining:.0f} s of the {start_s:g} s start budget)")
    status, exited = _wait_ready(sw, url, remaining, start_s)
    if exited:
        # Restart=on-failure would start the same command line again and again for the whole budget: nothing
        # is loading that the early end should wait for (runner.give_back).
        sw.engine_deadline = None
        raise _failed_start(sw, f"the engine exited during its start ({exited}) after "
                                f"{time.monotonic() - started:.0f} s")
    if status != 200:
        heard = f"last answer {status}" if status else "nothing answered"
        raise _failed_start(sw, f"{url} did not answer 200 within the engine's start budget of {start_s:g} s "
                                f"({heard})")
    sw.out.line(f"  engine ready in {time.monotonic() - started:.1f} s")


def old_engine_gone(sw: Switch, bound_s: float) -> None:
    """Wait (within ``bound_s``) until none of the stopped engine's processes remain in its control group
    (systemd's ``GetUnitProcesses``) and, on a node with ``nvidia-smi``, no process holds GPU memory: the new
    engine starts on a free card (vLLM issue 55510; node/gpu.py).

    Raises:
        StepError: processes or GPU memory still held at the bound, named (pid, command line or MiB).
    """
    from ..common.poll import poll_until
    from . import gpu

    left: list = []
    unanswered: list[str] = []

    def cgroup_empty() -> bool:
        try:  # a process that is exiting as systemd lists it can fail the whole call (seen: EIO): asked again
            left[:] = sw.ctx.manager.unit_processes(ENGINE_UNIT)
        except SystemdError as err:
            unanswered[:] = [str(err)]
            return False
        unanswered.clear()
        return not left

    if poll_until(cgroup_empty, bound_s, 0.2, sw.progress("the old engine's processes to end", bound_s)) is None:
        if unanswered:
            raise StepError(f"{ENGINE_UNIT}: systemd did not list the stopped engine's processes within {bound_s:g} s "
                            f"({unanswered[0]}); the new engine is not started")
        named = "; ".join(f"pid {pid} {cmd[:80]}" for pid, cmd in left[:4])
        raise StepError(f"{ENGINE_UNIT}: {len(left)} of the stopped engine's processes remain after {bound_s:g} s "
                        f"({named}); the new engine is not started on their memory")
    try:
        if gpu.compute_processes() is None:
            sw.out.line("  GPU memory: not checked (no nvidia-smi on this node)")
            return
        if poll_until(lambda: not gpu.compute_processes(), bound_s, 0.5,
                      sw.progress("the GPU's memory to be free", bound_s)) is None:
            held = gpu.compute_processes() or []
            named = ", ".join(f"pid {pid} {mib} MiB" for pid, mib in held[:4])
            raise StepError(f"the GPU's memory is still held after {bound_s:g} s ({named or 'by processes gone since'}); "
                            "the new engine is not started: it would run out of memory")
    except gpu.GpuUnreadable as err:
        raise StepError(f"the GPU's memory cannot be read: {err}") from None
    sw.out.line("  GPU memory: free (nvidia-smi lists no compute process)")


#: How often the start's wait asks systemd whether the engine's process is still the one started (seconds).
EXIT_CHECK_S = 1.0


def _wait_ready(sw: Switch, url: str, timeout_s: float, budget_s: float) -> tuple[int, str | None]:
    """Wait for ``url`` to answer 200, and stop as soon as the engine's process has exited.

    systemd says so (org.freedesktop.systemd1(5); docs/reference/systemd.md): the unit waits to be
    restarted (``SubState`` ``auto-restart``), has been restarted (``NRestarts`` above its value when
    the wait began: a start job does not always reset it) or failed or stopped (``ActiveState``).

    Returns:
        (the last /health status, 0 for no answer; why the engine is known to have exited, or None).
    """
    from ..common.http import HTTP_TIMEOUT_S, http_get
    from ..common.poll import poll_until

    queries = [(ENGINE_UNIT, "Service", "NRestarts"), (ENGINE_UNIT, "Unit", "ActiveState"),
               (ENGINE_UNIT, "Unit", "SubState")]
    deadline = time.monotonic() + timeout_s
    first = int(sw.ctx.manager.properties(queries[:1])[f"{ENGINE_UNIT}/NRestarts"])
    exited: list[str | None]
    last, exited, next_check = [0], [None], [time.monotonic() + EXIT_CHECK_S]

    def done() -> bool:
        last[0] = http_get(url, min(HTTP_TIMEOUT_S, max(0.1, deadline - time.monotonic())))[0]
        if last[0] == 200:
            return True
        if time.monotonic() >= next_check[0]:
            next_check[0] = time.monotonic() + EXIT_CHECK_S
            found = sw.ctx.manager.properties(queries)
            restarts = int(found[f"{ENGINE_UNIT}/NRestarts"])
            state, sub = found[f"{ENGINE_UNIT}/ActiveState"], found[f"{ENGINE_UNIT}/SubState"]
            if restarts > first or sub == "auto-restart" or state in ("failed", "inactive"):
                exited[0] = f"systemd: {ENGINE_UNIT} {state} ({sub}), restarted {restarts - first} time(s)"
                return True
        return False

    poll_until(done, timeout_s, 0.05, _engine_progress(sw, url, budget_s))
    return last[0], exited[0]


def _engine_progress(sw: Switch, url: str, budget_s: float) -> Callable[[float], None]:
    """The engine start's progress: how long of its budget, and what the engine is doing (its latest output
    line since this start, from wherever the node keeps its output: common/unit_output.py), so that a start of
    many minutes on the card says more than the time."""
    from ..common.unit_output import last_lines

    def progress(waited: float) -> None:
        tail = last_lines((sw.serving or {}).get("layout") or {}, ENGINE_UNIT, 1, since=sw.engine_output_mark)
        latest = tail.lines[-1].strip() if tail.lines and tail.lines[-1].strip() else None
        sw.out.waiting(f"{url} to answer 200", waited, budget_s, clip(latest, 200) if latest else None)

    return progress


def _failed_start(sw: Switch, what: str) -> StepError:
    """The restart-engine step's failure: ``what`` went wrong, and the engine's last lines, from wherever the node
    keeps its output (common/unit_output.py), quoted in the message and kept for the history record."""
    from ..common.unit_output import QUOTED_LINES, last_lines

    tail = last_lines(sw.serving["layout"], ENGINE_UNIT, since=sw.engine_output_mark)  # this start's lines only
    quoted = tail.quote("the engine's")
    return StepError(f"{what}; {quoted}", [line for line in tail.lines if line.strip()][-QUOTED_LINES:])


def _invocation(sw: Switch) -> object:
    return sw.ctx.manager.properties([(ENGINE_UNIT, "Unit", "InvocationID")])[f"{ENGINE_UNIT}/InvocationID"]


def restart_voice(sw: Switch) -> None:
    sw.job("restart", VOICE_UNIT, UNIT_JOB_S)


def start_gateway(sw: Switch) -> None:
    sw.job("start", GATEWAY_UNIT, UNIT_JOB_S)
    sw.gateway_stopped = False


def end_voice_drain(sw: Switch) -> None:
    voice = sw.serving["voice"]
    since = time.time()
    if sw.drain is not None and sw.drain.drain_file != Path(voice["drain_file"]):
        drain.end_if_present(sw.drain.drain_file)  # drained where the worker before this switch watched
    drain.end(Path(voice["drain_file"]))
    sw.drain = None
    drain.wait_serving(Path(voice["drain_file"]), Path(voice["status_file"]), since, VOICE_SERVING_S)
    sw.out.line("  voice worker takes calls again")


def apply_units(sw: Switch) -> None:
    for name, action in sw.plan.units.items():
        if name in (ENGINE_UNIT, GATEWAY_UNIT, VOICE_UNIT):
            continue  # the steps above handle the services
        if action == "restart":
            sw.job("restart", name, UNIT_JOB_S)
        elif action == "start" and name != TARGET_UNIT:
            sw.job("start", name, UNIT_JOB_S)
    sw.job("start", TARGET_UNIT, UNIT_JOB_S)
    if CHECK_TIMER in sw.new.units and sw.plan.units.get(CHECK_TIMER) not in ("restart", "start"):
        sw.job("start", CHECK_TIMER, UNIT_JOB_S)
    # Enabled, so that a reboot starts the node serving again (systemctl enable, over D-Bus).
    enable = [u for u in (TARGET_UNIT, CHECK_TIMER) if u in sw.new.units]
    changes = sw.ctx.manager.enable(enable)
    if changes:
        sw.out.line(f"  enabled {', '.join(enable)} (starts at boot)")


def keep_enabled(ctx: NodeContext, units: dict, out: ReleaseOutput, dry_run: bool = False) -> list[str]:
    """What a release with nothing to do still does: ``flatshare.target`` and the check timer start at boot.

    Someone may have disabled them since the release that enabled them (``apply_units``); a node then
    stays so until a real release. Their ``UnitFileState`` (org.freedesktop.systemd1(5)) is read, and each
    of the release's ``units`` among the two that is not ``enabled`` is enabled again over D-Bus, as
    ``apply_units`` does (``EnableUnitFiles``): no drain, no restart. A dry run only says what it would do.

    Returns:
        The units enabled again (or, in a dry run, that would be).

    Raises:
        SystemdError: the manager did not answer.
    """
    wanted = [u for u in (TARGET_UNIT, CHECK_TIMER) if u in units]
    if not wanted:
        return []
    states = ctx.manager.properties([(u, "Unit", "UnitFileState") for u in wanted])
    off = [u for u in wanted if states[f"{u}/UnitFileState"] != "enabled"]
    masked = [u for u in off if str(states[f"{u}/UnitFileState"]).startswith("masked")]
    for unit in masked:
        out.line(f"  note: {unit} is masked: left so (someone masked it on purpose; 'systemctl unmask {unit}' "
                 "and release again to have it start at boot)")
    off = [u for u in off if u not in masked]
    if not off:
        return []
    was = ", ".join(f"{u} was {states[f'{u}/UnitFileState'] or 'not enabled'}" for u in off)
    if dry_run:
        out.line(f"  would enable {', '.join(off)} again ({was}), with no drain")
        return off
    ctx.manager.enable(off)
    out.line(f"  enabled {', '.join(off)} again ({was}): it starts at boot; no drain")
    return off


def switch_current(sw: Switch) -> None:
    from .store import switch_current as point

    point(sw.ctx.state_dir, sw.new.id)
    sw.out.line(f"  releases/current -> {sw.new.id}")


#: How many times the switch's serving-check runs before a CRITICAL or UNKNOWN is its verdict, and the pause
#: between two (seconds): one health request that missed its 2 s bound on a loaded node is no verdict that
#: rolls a release back (a busy machine's /health can miss one bound right after the engine served).
VERDICT_CHECKS = 3
VERDICT_PAUSE_S = 2.0


def serving_check(sw: Switch) -> None:
    """Run serving-check against the new release, then place one call through the node's gateway as a caller
    would (node/calls.py ``call_problem``: a streamed one-token completion, read to ``[DONE]``): an engine whose
    ``/health`` answers 200 while it answers no call (a frozen engine core: serving-check alone says OK) is
    no engine that serves. CRITICAL or UNKNOWN, or a failed call, at each of :data:`VERDICT_CHECKS` attempts,
    :data:`VERDICT_PAUSE_S` apart, fails the step (the verdict an automatic rollback acts on)."""
    from ..common.serving_report import CRITICAL, UNKNOWN
    from .serving_check import DEADLINE_S, run_serving_check
    from .calls import SWITCH_CHECK_REQUEST_ID, call_problem

    gateway = sw.serving["gateway"].get("url")
    for attempt in range(1, VERDICT_CHECKS + 1):
        # NoReport (neither serving-check gave a report) is the check's own trouble, no verdict on the engine: the
        # switch ends early without an automatic rollback (the next release finishes it).
        report = run_serving_check(sw.ctx, sw.progress("serving-check's report", DEADLINE_S + 10),
                                   lambda said: sw.out.line(f"  note: {one_line(said)}"))
        for finding in report.findings:
            if finding.status != "OK":  # one line each: what a finding holds is never a line of its own
                sw.out.line(one_line(f"  {finding.status} {finding.check}: {finding.summary}"))
                for detail in finding.details:
                    sw.out.line(one_line(f"      {detail}"))
        problem = None
        if report.status not in (CRITICAL, UNKNOWN):
            problem = call_problem(gateway, request_id=SWITCH_CHECK_REQUEST_ID) if isinstance(gateway, str) else None
            if problem is None:
                break
            sw.out.line(f"  {problem}")
        verdict = problem or f"serving-check is {report.status}"
        if attempt == VERDICT_CHECKS:
            raise StepError(f"{verdict} after the switch ({VERDICT_CHECKS} checks {VERDICT_PAUSE_S:g} s apart)")
        sw.out.line(f"  {'the call failed' if problem else f'serving-check {report.status}'}: checking again in "
                    f"{VERDICT_PAUSE_S:g} s ({attempt + 1} of {VERDICT_CHECKS}: a verdict is never one measurement)")
        time.sleep(VERDICT_PAUSE_S)
    sw.out.line(f"  serving-check {report.status}" + (", and a call through the gateway streamed to [DONE]"
                                                        if isinstance(gateway, str) else ""))


def record_history(sw: Switch) -> None:
    """Append the success record (once per switch id); the runner removes the journal after this step."""
    from .records import append_success

    assert sw.journal is not None  # runner.run gives every switch its journal
    append_success(sw.ctx, sw.journal, sw.new.id)


@dataclass(frozen=True)
class Step:
    """One step of a switch.

    Attributes:
        name: its name in plans, journals and messages.
        description: one line for the dry run.
        touches: what it changes on the node.
        run: its function.
    """

    name: StepName
    description: str
    touches: tuple[str, ...]
    run: Callable[[Switch], None]

    @property
    def drains(self) -> bool:
        """It takes the node out of calls (admission to drain is needed first): common/protocol.py's
        ``DRAIN_STEPS``, which also time how long a switch kept its node out of calls."""
        return self.name in DRAIN_STEPS


STEPS: tuple[Step, ...] = (
    Step(StepName.DRAIN_VOICE, "drain the voice worker (drain file; wait for its status written after this drain "
         "began)", ("voice.drain", VOICE_UNIT), drain_voice),
    Step(StepName.STOP_GATEWAY, "stop the gateway (SIGTERM: it drains, answering 503 + Retry-After: 1)",
         (GATEWAY_UNIT,), stop_gateway),
    Step(StepName.INSTALL_UNITS, "install the release's changed units, remove dropped ones, daemon-reload",
         ("unit directory",), install_units),
    Step(StepName.RESTART_ENGINE, "stop the engine, start it (its pre-start step builds the serve module), wait "
         "for /health", (ENGINE_UNIT,), restart_engine),
    Step(StepName.RESTART_VOICE, "restart the voice worker (it comes up drained while the drain file stays)",
         (VOICE_UNIT,), restart_voice),
    Step(StepName.START_GATEWAY, "start the gateway", (GATEWAY_UNIT,), start_gateway),
    Step(StepName.END_VOICE_DRAIN, "end the voice drain and wait for the worker to take calls again",
         ("voice.drain",), end_voice_drain),
    Step(StepName.APPLY_UNITS, "restart or start the other changed units; start and enable flatshare.target and "
         "the check timer", (TARGET_UNIT, CHECK_TIMER), apply_units),
    Step(StepName.SWITCH_CURRENT, "point releases/current at the new release", ("releases/current",), switch_current),
    Step(StepName.SERVING_CHECK, "run serving-check against the new release, then place one call through the "
         "gateway", (), serving_check),
    Step(StepName.RECORD_HISTORY, "append to releases/history.jsonl (then the journal is removed)",
         ("releases/history.jsonl", "releases/switching.json"), record_history),
)
#: Step name -> step.
STEP_BY_NAME = {step.name: step for step in STEPS}
if tuple(STEP_BY_NAME) != tuple(StepName):  # each name has one step, in the names' order
    raise ImportError("node/steps.py's table and common/protocol.py's StepName do not name the same steps in the "
                      "same order (or two steps share a name)")
