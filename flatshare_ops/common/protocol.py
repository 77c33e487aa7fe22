"""The one protocol between the operator's side and a node's: message kinds, version, outcome (standard library only).

Both sides import this module, and only this module decides what crosses
between them (docs/reference/engineering-style.md, "Two processes speak one
typed protocol"). Text written for people is never parsed:

- **The bundle header** (the first line of a switch's stdin): the release
  bundle, headed by ``protocol`` (:data:`VERSION`: what a node's entry point
  must be able to run) and ``lock_sha256``; the node's small entry point
  (node/entry.py) refuses what it cannot run.
- **Protocol lines** on the node's stdout, among the progress lines for
  people: :data:`PREFIX` + kind + one JSON object. The node sends
  :class:`Progress` (where its switch stands, and its long waits),
  :class:`AdmitRequest` (it holds its lock and asks whether it may drain) and,
  last, :class:`Outcome` (what it did); the operator answers an admission
  request with one :class:`AdmitAnswer` line on the node's stdin. The node's other commands answer one JSON
  document on stdout, or, when they cannot, one :class:`CommandError` line.

A line that does not start with :data:`PREFIX` is for people; a protocol line
of an unknown kind or a damaged one is ignored by :func:`parse` (an older
operator meeting a newer node), never guessed at.

The words both sides read (every kind, mode, phase, step, result, state and
refusal, in messages or in the node's files: its journal, history, lock.json)
are the values of the enums below, each a ``StrEnum`` whose members are those
strings, so that the messages and files read and write exactly the words they
always did; no other module spells one (tests/test_layout.py).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum

#: The bundle protocol a node's entry point runs; raise it only for a change an older entry point cannot run.
VERSION = 1
#: The switcher's generation: raised when a switcher's rules change so that an older one would break a
#: promise if it ran again. A node's entry point runs no switcher older than its own generation (node/entry.py):
#: not a bundle's from an older checkout, nor an active release's stored one for a rollback or a probe (the
#: installed code runs those instead). 1: every switcher before it was written down. 2: admission to drain
#: that sees what callers see (gateway, systemd's restarts, a call through the gateway, asked again before the
#: gateway stops, one node counted once by the id it reports). The operator's side writes the shipped code's own
#: value into the switcher's zip as data (control/bundle.py ``DESCRIPTION``), where the entry point reads it.
GENERATION = 2
#: The member of a switcher's zip that describes it, as JSON: ``{"generation": N}`` (the shipped code's own
#: :data:`GENERATION`; control/bundle.py writes it, node/entry.py reads it).
SWITCHER_DESCRIPTION = "flatshare_ops/switcher.json"
#: How long a node waits for the answer to its :class:`AdmitRequest` before it refuses (seconds). The operator's
#: follow-up after a lost session keeps asking a node that is still before its journal (deciding, not yet
#: switching) until past this bound, so that it reports the node's refusal, never "still switching".
ADMISSION_WAIT_S = 60.0
#: Protocol lines start with this (the operator's side reads them; people never see them).
PREFIX = "::flatshare:"


class OutcomeResult(StrEnum):
    """What a switch command did, as its :class:`Outcome` says (``result``): the node's switch command (node/cli.py,
    node/switch.py; node/entry.py for what it refuses before the switch runs) writes it, and keeps it
    (node/outcomes.py); the operator's side reads it for its summaries and the rollout's decisions
    (control/rollout.py)."""

    RELEASED = "released"
    ROLLED_BACK = "rolled back"
    REPAIRED = "repaired"
    AUTO_ROLLED_BACK = "rolled back automatically"
    NOTHING_TO_DO = "nothing to do"
    PLANNED = "planned"
    REFUSED = "refused"
    FAILED = "failed"
    INTERRUPTED = "interrupted"


class RecordResult(StrEnum):
    """What a record of ``releases/history.jsonl`` says became of its switch (``result``; releases/README.md): the
    node writes it (node/records.py, the history's one writer) and reads it back for its rollback rule
    (node/history.py); the operator's side reads it in the node's ``history`` and ``status`` answers
    (control/answers.py, cli/). ``analysed``: a canary analysis of the node's release, not a switch."""

    RELEASED = "released"
    ROLLED_BACK = "rolled back"
    REPAIRED = "repaired"
    FAILED = "failed"
    ABANDONED = "abandoned"
    ANALYSED = "analysed"


class SwitchKind(StrEnum):
    """What a switch is: the plan's ``kind`` (node/plan.py), its journal's (``releases/switching.json``,
    node/journal.py) and its history record's (node/records.py). The node decides it; the operator's side reads it
    in the plan an outcome carries and in the history."""

    RELEASE = "release"
    ROLLBACK = "rollback"
    REPAIR = "repair"


class RecordKind(StrEnum):
    """What a history record is (``kind``): a switch (each :class:`SwitchKind`'s value) or a canary analysis of
    the node's release (``analysis``, node/records.py ``append_analysis``). The node writes and reads it; the
    operator's side reads it in the node's ``history`` answer."""

    RELEASE = SwitchKind.RELEASE.value
    ROLLBACK = SwitchKind.ROLLBACK.value
    REPAIR = SwitchKind.REPAIR.value
    ANALYSIS = "analysis"


class Mode(StrEnum):
    """What the operator's side asks of a node's switch: a release (of the bundle it sends), a rollback (the
    node's rollback rule) or the undo of a rollout (back to what the node ran before it). The operator's side
    (control/rollout.py) asks it with ``flatshare-node switch``'s options (control/commands.py); the node
    (node/cli.py, node/switch.py ``Request``) writes it in ``lock.json`` (node/lock.py), which both sides read
    for people (common/wording.py)."""

    RELEASE = "release"
    ROLLBACK = "rollback"
    UNDO_ROLLOUT = "undo-rollout"


class PlanForm(StrEnum):
    """How a switch prints its plan on the operator's terminal (the bundle header's ``plan``): whole, or in a few
    lines (the whole plan then goes to the node's release.log only). The operator's side writes it
    (control/rollout.py); the node reads it (node/cli.py), a header without it meaning ``full``."""

    FULL = "full"
    COMPACT = "compact"


class SwitchPhase(StrEnum):
    """Where a switch stands (:attr:`Progress.phase`): before any change (its refusals, preflight and admission:
    a node that ends here changed nothing), found nothing to switch (it runs what was asked already: it may still
    ask the go-ahead, and ends changing nothing), carrying out its plan's steps, ending early (giving calls back),
    or carrying out the steps of the automatic rollback its failed switch began. The node sends it
    (node/output.py, node/switch.py, node/runner.py); the operator's side reads it (control/rollout.py)."""

    DECIDING = "deciding"
    NOTHING_TO_DO = "nothing to do"
    SWITCHING = "switching"
    ENDING_EARLY = "ending early"
    ROLLING_BACK = "rolling back"


class RefusedFor(StrEnum):
    """Why a switch was refused, where waiting may end it (:attr:`Outcome.refused_for`): its admission to drain
    (too few other nodes take calls now, or they lack the headroom), or another release holds the node. The node
    sends it (``Refused.waits_for``: node/refusals.py, node/runner.py, node/lock.py); the operator's ``--wait``
    reads it (control/rollout.py)."""

    ADMISSION = "admission"
    BUSY = "busy"


class StepState(StrEnum):
    """How far one step of a switch got, in its journal (``releases/switching.json`` ``steps[].state``;
    releases/README.md): the node writes it (node/runner.py) and reads it to finish or describe an interrupted
    switch (node/journal.py)."""

    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


class SwitchState(StrEnum):
    """What became of one switch, as a node's ``status --switch ID`` answer says (``state``): recorded in its
    history, still switching (its journal there and its lock held), interrupted (its journal there, nobody
    holding the lock), ended with no switch run (its kept outcome), or unknown there. The node answers it
    (node/status.py ``switch_state``); the operator's follow-up after a lost session reads it
    (control/answers.py ``follow_up_report``)."""

    RECORDED = "recorded"
    SWITCHING = "switching"
    INTERRUPTED = "interrupted"
    ENDED = "ended"
    UNKNOWN = "unknown"


class JournalState(StrEnum):
    """Whether a node has a switch in its journal (``releases/switching.json``), as its ``status`` answer says
    (``journal_state``): none, one there (in progress, or interrupted and not yet finished), or a journal that
    cannot be read (the answer's ``damaged`` names it). The node answers it (node/status.py ``node_status``); the
    operator's side decides from it (control/answers.py ``journal_state``), never from the journal's summary,
    which is for people."""

    NONE = "no-journal"
    PRESENT = "journal-present"
    UNREADABLE = "journal-unreadable"


class AnalysisPhase(StrEnum):
    """Where a canary analysis is (Argo Rollouts' phases): measuring, or its outcome. The operator's side decides
    it (control/analysis.py) and records it in the node's history (``analysis.phase`` of an ``analysed`` record,
    through ``flatshare-node record-analysis``); the node reads it (node/history.py, node/switch.py) to know a
    release whose analysis failed, or a switch whose analysis passed."""

    RUNNING = "running"
    PASSED = "passed"
    FAILED = "failed"
    INCONCLUSIVE = "inconclusive"


class StepName(StrEnum):
    """The steps a switch can take, in the step table's order (node/steps.py ``STEPS``, which gives each its
    description and function): the plan lists them, the journal records them, :attr:`Progress.step` and history
    records (``step``) name them, and the operator's side reads them there."""

    DRAIN_VOICE = "drain-voice"
    STOP_GATEWAY = "stop-gateway"
    INSTALL_UNITS = "install-units"
    RESTART_ENGINE = "restart-engine"
    RESTART_VOICE = "restart-voice"
    START_GATEWAY = "start-gateway"
    END_VOICE_DRAIN = "end-voice-drain"
    APPLY_UNITS = "apply-units"
    SWITCH_CURRENT = "switch-current"
    SERVING_CHECK = "serving-check"
    RECORD_HISTORY = "record-history"


#: What a successful switch of each kind is recorded as in the history (and, so, what its outcome says).
SUCCEEDED: dict[SwitchKind, RecordResult] = {SwitchKind.RELEASE: RecordResult.RELEASED,
                                              SwitchKind.ROLLBACK: RecordResult.ROLLED_BACK,
                                              SwitchKind.REPAIR: RecordResult.REPAIRED}
#: The history results of a switch that left its node on the release asked for, serving.
SUCCESS = frozenset(SUCCEEDED.values())
#: The history results of a switch that ended with its release active and serving-check passed: the releases a
#: rollback may return to (node/history.py ``served_releases``).
SERVED = frozenset({RecordResult.RELEASED, RecordResult.ROLLED_BACK})
#: The history results of a switch that did not end serving its target: it failed, or another switch replaced it.
UNFINISHED = frozenset({RecordResult.FAILED, RecordResult.ABANDONED})


@dataclass(frozen=True)
class AdmitRequest:
    """The node asks, holding its release lock, whether it may drain now.

    Attributes:
        node: the node's name.
        switch: the switch's id (the operator's).
        dry_run: a dry run asks too, so that the plan shows what the admission would say.
        node_id: what tells this node from every other whatever name reached it (node/probe.py
            ``node_identity``), so that the operator's side never counts it among the others; None when unknown.
        load: what the node's engine carries now, which draining moves onto the others (node/probe.py
            ``engine_load``: running, waiting, max_num_seqs, kv_cache_usage; or an error), None when not read.
        drains: False when the node asks only whether to go on (the bundle's ``confirm``: asked after its
            refusals and preflight, before its admission to drain and any change); the operator's side then
            answers for its own checks (control/rollout.py, the retry guard) and counts no nodes.
        history: the mark of the node's newest history record, read holding the lock at the switch's first ask
            (node/history.py ``newest_mark``; None for an empty or unreadable history), the same in each later
            ask of the switch (its own records are not news): the retry guard read before the lock was taken is
            read again when its mark differs (a release that failed and was rolled back meanwhile).
    """

    node: str
    switch: str
    dry_run: bool = False
    node_id: str | None = None
    load: dict | None = None
    drains: bool = True
    history: str | None = None
    kind = "admit"


@dataclass(frozen=True)
class AdmitAnswer:
    """The operator's answer to an :class:`AdmitRequest`: ``admit``, else ``reason`` (one line)."""

    admit: bool
    reason: str | None = None
    kind = "answer"


@dataclass(frozen=True)
class Outcome:
    """What the node did, sent last.

    Attributes:
        switch: the switch's id.
        code: the exit code (:class:`flatshare_ops.errors.Exit`).
        result: an :class:`OutcomeResult` (``released``, ``rolled back automatically``, ``refused``...); read as
            text, so that a newer node's word is shown as it is, never a damaged line.
        release: the release the node is on afterwards, when known.
        message: the one-line reason of a failure or refusal, else None.
        detail: a JSON-ready document of what else the node has to say (an automatic rollback's
            cause, the engine's last lines).
        first: the switch was the node's first release (it had none before): there is nothing to compare
            it with or roll it back to (a node that does not send it: False).
        unjudged: with nothing to do, the id of the switch that installed the release the node runs when no
            canary analysis passed it or was skipped for it (a rollout interrupted during its analysis, a
            paused one, a release of the node alone), else None.
        before: the release the node was on before the switch, when known (None: none, or not known).
        commit: the checkout commit the release was made from, when the bundle said.
        drained_s: seconds from the switch's first drain step to its last step giving calls back, when it drained
            and gave them back (:func:`drain_window`).
        engine_start_s: seconds the ``restart-engine`` step took (stop, start, /health 200), when it ran.
        plan: the switch's plan as data (node/plan.py ``Plan``: ``node``, ``from_id``, ``to_id``, ``kind``,
            ``steps``, ``units``, ``reasons``, ``flag_changes``, ``drains``...), when one was made.
        refused_for: a refusal that may end by waiting: a :class:`RefusedFor`; None for any other result or
            refusal (a preflight's, a hold's).
    """

    switch: str
    code: int
    result: str
    release: str | None = None
    message: str | None = None
    detail: dict = field(default_factory=dict)
    first: bool = False
    unjudged: str | None = None
    before: str | None = None
    commit: str | None = None
    drained_s: float | None = None
    engine_start_s: float | None = None
    plan: dict = field(default_factory=dict)
    refused_for: str | None = None
    kind = "outcome"


@dataclass(frozen=True)
class Progress:
    """Where the node's switch stands, sent as it moves on: when its phase or step changes, and every few
    seconds of a long wait (the operator's side shows a wait as one live status line on a terminal).

    Attributes:
        switch: the switch's id.
        phase: a :class:`SwitchPhase`.
        step: the step under way (a :class:`StepName`), ``""`` before the first.
        waiting_for: what a wait waits for (``"http://127.0.0.2:8000/health to answer 200"``), ``""`` when none.
        waited_s: how long the wait has lasted (seconds), when waiting.
        bound_s: the wait's bound (seconds), when waiting.
        engine_says: the engine's latest output line during its start, when it printed one.
    """

    switch: str
    phase: str
    step: str = ""
    waiting_for: str = ""
    waited_s: float | None = None
    bound_s: float | None = None
    engine_says: str | None = None
    kind = "progress"


def waiting_words(message: Progress) -> str:
    """A wait's progress for people (both sides print it: the node in release.log, the operator on its
    terminal): ``still waiting for WHAT (N s of BOUND s)``, then the engine's latest line when there is one."""
    waited = f"{message.waited_s:.0f} s" if message.waited_s is not None else "some time"
    bound = f" of {message.bound_s:g} s" if message.bound_s is not None else ""
    said = f"; the engine's latest line: {message.engine_says}" if message.engine_says else ""
    return f"still waiting for {message.waiting_for} ({waited}{bound}){said}"


#: The steps that take a node out of calls (node/steps.py: a plan with one of them asks for admission to drain),
#: and those that give calls back.
DRAIN_STEPS = (StepName.DRAIN_VOICE, StepName.STOP_GATEWAY)
GIVE_BACK_STEPS = (StepName.START_GATEWAY, StepName.END_VOICE_DRAIN)


def drain_window(timings: dict[str, tuple[float, float]]) -> float | None:
    """How long a switch kept its node out of calls (seconds): from the start of its first drain step to the end
    of its last step giving calls back, from ``timings`` (step name -> (start, end), one clock's seconds); None
    when it drained nothing or never gave calls back."""
    starts = [timings[s][0] for s in DRAIN_STEPS if s in timings]
    ends = [timings[s][1] for s in GIVE_BACK_STEPS if s in timings]
    return round(max(ends) - min(starts), 3) if starts and ends else None


@dataclass(frozen=True)
class CommandError:
    """A node command other than ``switch`` (status, history, probe, metrics, answers, record-analysis, hold,
    lock-check, module) that could not answer: sent last on its stdout, in place of its JSON answer, so that the
    operator's side reads the reason and the exit code as fields (never a line of the node's stderr).

    Attributes:
        code: the exit code (:class:`flatshare_ops.errors.Exit`).
        message: the one-line reason, for people.
    """

    code: int
    message: str
    kind = "error"


_KINDS = {cls.kind: cls for cls in (AdmitRequest, AdmitAnswer, Outcome, Progress, CommandError)}


def line(message: AdmitRequest | AdmitAnswer | Outcome | Progress | CommandError) -> str:
    """The message as one protocol line (with its newline): ``::flatshare:KIND {json}``."""
    return f"{PREFIX}{message.kind} {json.dumps(asdict(message), sort_keys=True, allow_nan=False)}\n"


def answer_line(message: AdmitAnswer) -> str:
    """An :class:`AdmitAnswer` as the node reads it on stdin: one JSON object and a newline."""
    return json.dumps(asdict(message), sort_keys=True, allow_nan=False) + "\n"


def is_protocol(text: str) -> bool:
    """Whether a line of the node's output is a protocol line (not for people)."""
    return text.startswith(PREFIX)


def parse(text: str) -> AdmitRequest | Outcome | Progress | CommandError | None:
    """A protocol line read back; None for a line of an unknown kind or a damaged one."""
    if not text.startswith(PREFIX):
        return None
    kind, _, rest = text[len(PREFIX):].strip().partition(" ")
    cls = _KINDS.get(kind)
    if cls is None or cls is AdmitAnswer:
        return None
    return _build(cls, rest)


def parse_answer(text: str) -> AdmitAnswer | None:
    """An admission answer read from the node's stdin; None when it is not one."""
    return _build(AdmitAnswer, text)


def _build(cls, text: str):
    from .files import loads

    try:  # bounded, and RFC 8259's numbers: a NaN or an infinity is a damaged line, never half-believed
        document = loads(text)
    except ValueError:
        return None
    if not isinstance(document, dict):
        return None
    names = {f.name for f in fields(cls)}
    try:
        message = cls(**{k: v for k, v in document.items() if k in names})
    except TypeError:
        return None
    for f in fields(cls):  # the types each field must have, so that a damaged line is never half-believed
        value = getattr(message, f.name)
        if not _fits(value, str(f.type)):  # a str: annotations are not evaluated here
            return None
    return message


def _fits(value, annotation: str) -> bool:
    allowed = {"str": (str,), "int": (int,), "bool": (bool,), "dict": (dict,), "str | None": (str, type(None)),
               "dict | None": (dict, type(None)),
               "float | None": (int, float, type(None))}
    types = allowed.get(annotation, (object,))
    if annotation in ("int", "float | None") and isinstance(value, bool):
        return False
    return isinstance(value, types)
