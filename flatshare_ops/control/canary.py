"""A rollout's canary analysis, carried out: scrape the canaries' and a baseline's engines through their nodes, every
``interval_s``, ``count`` times, and decide (the core's rules: :mod:`.analysis`).

After the first batch of a rollout (its canaries) switched, the rollout asks :func:`analyse` whether to go on.
Each canary's engine ``/metrics`` and the baseline's (a node still on the old release) are read through the
nodes (``flatshare-node metrics``: engines listen where only their node reaches them), with no Prometheus
server. Each measurement is one line; the analysis's summary and what the rollout does follow; the whole
analysis goes into each canary's history (``flatshare-node record-analysis``: the node writes its own
history) and into ``release --json``. docs/reference/canary-analysis.md has the rules.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from typing import Callable

from ..common import protocol
from ..common.clock import utc_stamp
from ..common.text import one_line
from ..errors import TransportError
from .connection import Lost
from . import commands
from .analysis import Action, AnalysisResult, AnalysisRun, FailedScrape, read_scrape, table_header
from .fanout import answer_of, not_an_answer
from .golden import GoldenCheck, answers_of, reference_of
from .targets import NodeTarget

#: What the rollout does after several canaries' analyses: the most cautious action wins.
_CAUTION = {Action.CONTINUE: 0, Action.MEASURE: 0, Action.PAUSE: 1, Action.ROLLBACK: 2}


@dataclass(frozen=True)
class Clock:
    """Where an analysis reads the time and how it waits between measurements: by default this machine's clocks
    and ``time.sleep`` (a signal to the operator interrupts it); a test's fake clock runs a whole analysis at
    once.

    Attributes:
        monotonic: seconds, only ever forward (the schedule of measurements).
        wall: Unix seconds (each scrape's time, the next measurement's time as printed).
        sleep: waits this many seconds.
    """

    monotonic: Callable[[], float] = field(default=time.monotonic)
    wall: Callable[[], float] = field(default=time.time)
    sleep: Callable[[float], None] = field(default=time.sleep)


@dataclass
class Verdict:
    """The analyses of one rollout's canaries: each canary's result, and what the rollout does."""

    results: dict[str, AnalysisResult]
    #: Why the analysis stopped before deciding (a canary or the baseline switched to another release while it
    #: was measured), else None: nothing is decided from it, the rollout stops.
    aborted: str | None = None

    @property
    def action(self) -> Action:
        """Stop if the analysis was aborted; else roll back if any canary's analysis says so, else pause if any
        does, else go on."""
        if self.aborted is not None:
            return Action.PAUSE
        actions = [r.rollout_action for r in self.results.values()] or [Action.CONTINUE]
        return max(actions, key=lambda a: _CAUTION[a])

    def documents(self) -> list[dict]:
        """Each canary's analysis document (:meth:`.analysis.AnalysisResult.document`)."""
        return [r.document() for r in self.results.values()]


def analyse(rollout, canaries: list[NodeTarget], baseline: NodeTarget | None, dry_run: bool,
            clock: Clock = Clock()) -> Verdict:
    """Analyse the canaries against ``baseline`` (None: no node is left on the old release) for the canaries'
    profile's ``[release.analysis]``: ``count`` measurements, one every ``interval_s`` seconds, stopping early
    when the result can no longer change.

    Args:
        rollout: the :class:`.rollout.Rollout` (its connections and its terminal).
        dry_run: ``--analysis dry-run``: measure and report, decide nothing.
        clock: where the time is read and how the loop waits (:class:`Clock`).
    """
    settings = canaries[0].loaded.profile.release.analysis
    runs = {c.name: AnalysisRun(settings, c.name, baseline.name if baseline else None, dry_run=dry_run)
            for c in canaries}
    out = rollout.out
    against = f"against baseline {baseline.name} (still on the old release)" if baseline else \
        "with no baseline (no node is left on the old release)"
    out.line(f"canary analysis of {', '.join(runs)} {against}: {settings.count} measurement(s), one every "
             f"{settings.interval_s:g} s" + (" (dry run: nothing is acted on)" if dry_run else ""))
    if settings.golden.prompts:
        for target in canaries:
            check = golden_answers(rollout, target, baseline)
            out.line(check.line())
            runs[target.name] = replace(runs[target.name], golden=check)
    out.line(table_header())
    # What is judged: each canary on the release its switch installed, against the baseline on the release it
    # ran at the first scrape. Another release or rollback may switch either while they are measured (a
    # rollback of the canary mid-analysis would make the old release's measurements "pass" the new one): the
    # analysis then stops, deciding nothing.
    judged = {c.name: getattr(rollout.outcomes.get(c.name), "release", None) for c in canaries}
    base_release: str | None = None
    deadline = clock.monotonic()
    while not all(run.result.done for run in runs.values()):
        base, running = scrape_with_release(rollout, baseline, clock) if baseline is not None else (None, None)
        base_release = base_release or running
        moved = [] if baseline is None or running is None or running == base_release else [
            f"baseline {baseline.name} now runs release {running}, not {base_release}"]
        for name, run in list(runs.items()):
            if run.result.done:
                continue
            target = next(c for c in canaries if c.name == name)
            before = len(run.measurements)
            measured, release = scrape_with_release(rollout, target, clock)
            if release is not None and judged[name] is not None and release != judged[name]:
                moved.append(f"canary {name} now runs release {release}, not {judged[name]}, the release judged")
            if moved:
                why = "; ".join(moved) + " (another release or rollback switched it)"
                out.line(f"the canary analysis stops: {why}; nothing is decided from it")
                return Verdict({n: r.result for n, r in runs.items()}, aborted=why)
            run = runs[name] = run.record(measured, base)
            if len(run.measurements) > before:
                out.line(run.measurements[-1].row())
        if all(run.result.done for run in runs.values()):
            break
        deadline += settings.interval_s
        wait = max(0.0, deadline - clock.monotonic())
        out.line(f"  next measurement at {utc_stamp(clock.wall() + wait)[11:19]}Z (in {wait:.0f} s)")
        clock.sleep(wait)
    verdict = Verdict({name: run.result for name, run in runs.items()})
    for result in verdict.results.values():
        out.line(result.summary())
    return verdict


def golden_answers(rollout, canary: NodeTarget, baseline: NodeTarget | None) -> GoldenCheck:
    """The canary's golden answers (its profile's ``[release.analysis.golden]``) compared with the baseline's,
    or with no baseline with the canary's reference from its history (:mod:`.golden`); asked through the
    nodes (``flatshare-node answers``). What a node could not answer is in the check's errors, never raised."""
    golden = canary.loaded.profile.release.analysis.golden
    prompts = list(golden.prompts)
    # The node answers within the command's bound, less a margin for the connection.
    budget = max(1.0, rollout.settings.transport.command_timeout_s - 5)
    asked = json.dumps(prompts).encode()
    mine, errors = answers_of(canary.name, _ask(rollout, canary, commands.answers(
        canary.spec, golden.max_tokens, budget), asked), len(prompts), golden.max_tokens)
    against: str | None
    if baseline is not None:
        against = baseline.name
        theirs, more = answers_of(baseline.name, _ask(rollout, baseline, commands.answers(
            baseline.spec, golden.max_tokens, budget), asked), len(prompts), golden.max_tokens)
        errors += more
    else:
        history = _ask(rollout, canary, commands.history(canary.spec))
        records = history.get("records") if isinstance(history, dict) else None
        reference = reference_of(records if isinstance(records, list) else [], prompts, golden.max_tokens)
        against, theirs = ("reference", reference) if reference is not None else (None, ())
    return GoldenCheck(canary.name, against, tuple(prompts), golden.max_tokens, mine, theirs, tuple(errors),
                       rollout.changes_answers)


def _ask(rollout, target: NodeTarget, argv: list[str], stdin: bytes = b"") -> dict:
    """A read-only node command's JSON answer (``stdin`` sent to it), or ``{"error"}`` saying why there is none."""
    try:
        result = rollout.run_command(target, argv, stdin)
    except TransportError as err:
        return {"error": f"the node could not be asked: {err}"}
    try:
        answer = answer_of(result)
    except ValueError as err:
        return {"error": not_an_answer(result.status, f"{result.output}\n{result.errors}", err)}
    return answer if isinstance(answer, dict) else {"error": "the node's answer is not a JSON object"}


def scrape(rollout, target: NodeTarget):
    """One scrape of ``target``'s engine through its node: a :class:`.analysis.Scrape`, or a
    :class:`.analysis.FailedScrape` saying why none could be read (unreachable, no engine answer, not JSON)."""
    return scrape_with_release(rollout, target)[0]


def scrape_with_release(rollout, target: NodeTarget, clock: Clock = Clock()):
    """:func:`scrape`, and the id of the release the node ran when it answered (None when it did not say); the
    scrape's time is ``clock``'s."""
    at = clock.wall()
    try:
        result = rollout.run_command(target, commands.metrics(target.spec))
        answer = answer_of(result)
    except TransportError as err:
        return FailedScrape(target.name, at, f"the node could not be asked: {err}"), None
    except ValueError as err:
        return FailedScrape(target.name, at, f"the node's metrics answer is not JSON ({err})"), None
    release = answer.get("release") if isinstance(answer, dict) and isinstance(answer.get("release"), str) else None
    return _scraped(target, at, answer), release


def _scraped(target: NodeTarget, at: float, answer):
    if not isinstance(answer, dict) or not isinstance(answer.get("text"), str):
        reason = answer.get("error") if isinstance(answer, dict) else None
        return FailedScrape(target.name, at, reason or "the node's metrics answer holds no /metrics text")
    return read_scrape(target.name, at, answer["text"])


def record(rollout, target: NodeTarget, switch_id: str, document: dict) -> None:
    """Put the analysis into the canary's history (the node writes it); a failure is said, never fatal."""
    bound = rollout.settings.transport.command_timeout_s
    said = b""
    try:
        session = rollout.start(target, commands.record_analysis(target.spec, switch_id, rollout.id))
        try:
            session.send((json.dumps(document) + "\n").encode())
            session.close_stdin()
            deadline = time.monotonic() + bound
            while time.monotonic() < deadline:  # what the node says, bounded (its one line on a failure)
                chunk = session.read(min(1.0, max(0.0, deadline - time.monotonic())))
                if chunk == b"":
                    break
                said = (said + (chunk or b""))[-4096:]
            status = session.exit_status(max(0.0, deadline - time.monotonic()))
        finally:
            session.close()
    except (TransportError, Lost) as err:
        rollout.out.line(f"{target.name}: note: the analysis could not be recorded in its history ({err})")
        return
    if status != 0:
        errors = [m for m in map(protocol.parse, said.decode(errors="replace").splitlines())
                  if isinstance(m, protocol.CommandError)]
        why = one_line(errors[-1].message) if errors else "it gave no reason"
        rollout.out.line(f"{target.name}: note: the analysis could not be recorded in its history "
                         f"({'no exit status' if status is None else f'exit {status}'}: {why})")
