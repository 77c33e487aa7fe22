"""The operator's side of a release or rollback: which nodes, in what order, and what each node says.

The checkout renders each node's release (:mod:`.bundle`); the switch itself
runs on the node (:mod:`flatshare_ops.node.switch`), reached through one
connection per node for the whole command (:mod:`.targets`). This module:

- streams each node's output, bounded by the silence bound (the node prints
  a line at least every 10 s during any wait);
- answers the node's admission request (it asks while holding its own lock,
  so two racing releases cannot both pass): the other nodes are probed, and
  the node may drain only while at least ``min_serving`` of them take calls
  and are not being released (docs/reference/release-protocol.md, "Admission to drain");
- when the connection is lost or stalls, reconnects (bounded) and reports
  what the node's journal and history say, never what the transport guessed;
- on Ctrl-C or SIGTERM, leaves every node to finish what it does, prints
  each node's state in one line and exits 130 or 143.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import uuid
from concurrent.futures import Future
from pathlib import Path
from typing import Callable, TypeGuard, cast

from ..common import protocol
from ..common.protocol import Mode, PlanForm, RecordKind, RefusedFor, SwitchPhase, SwitchState
from ..config.profile import Admission
from ..common.poll import PROGRESS_EVERY_S, poll_until
from ..errors import Exit, FlatshareError, OperatorInterrupted, Refused, TransportError
from .summary import EXIT_NAMES
from ..node.output import ReleaseOutput
from . import commands
from .answers import admission_line, follow_up_report, followed_releases, operator_code, owed_rollback_words
from .connection import CommandResult, Connection, Lost, Session, Silence
from .fanout import answer_of, at_once, not_an_answer
from .interrupts import hold_signals
from .targets import NodeTarget
from ..common.text import clip

#: The retry guard's mark of a node whose history it did not reach (never equal to a node's mark).
_NOT_READ = object()


def _tried(outcome: protocol.Outcome | None) -> str | None:
    """The release a switch that the node rolled back by itself went to (its plan's ``to_id``), else None."""
    if outcome is None or outcome.result != protocol.OutcomeResult.AUTO_ROLLED_BACK or not isinstance(outcome.plan, dict):
        return None
    tried = outcome.plan.get("to_id")
    return tried if isinstance(tried, str) else None


def _read(load: object) -> TypeGuard[dict]:
    """Whether a probe's ``load`` says its engine's running and waiting requests (node/probe.py ``engine_load``)."""
    return isinstance(load, dict) and isinstance(load.get("running"), int) and isinstance(load.get("waiting"), int)


def _unread(load: object) -> str:
    """Why a probe's ``load`` says no requests: its own error, or that it said nothing."""
    why = load.get("error") if isinstance(load, dict) else None
    return why or "its probe did not say"


def headroom(draining: str, moved: object, loads: dict[str, object], settings,
             also_moving: dict[str, object] | None = None) -> tuple[list[str], str | None]:
    """Whether the nodes that would carry ``draining``'s calls have the room (``[release.admission]``,
    config/profile.py ``Admission``): their running + waiting requests with ``draining``'s moved onto them, and
    those of every other node that may drain meanwhile, within ``seats_share`` of their ``max_num_seqs``, and none
    with its KV cache used above ``kv_cache_max``.

    Args:
        moved: the draining node's load (its admission request's ``load``: node/probe.py ``engine_load``).
        loads: each node counted as serving -> its probe's ``load``.
        also_moving: each other node that takes calls now but is being released (it may drain while
            ``draining`` does: another release, or the same batch) -> its probe's ``load``; its calls would move
            onto the same nodes. A load not read counts as 0 and is said.

    Returns:
        (lines saying what was read, one a node; the refusal with the numbers, or None to admit). A load not
        read (an older node, its /metrics down) is said and not judged: whether the node takes calls was.
    """
    lines: list[str] = []
    known = {name: load for name, load in loads.items() if _read(load)}
    for name, load in loads.items():
        if name not in known:
            lines.append(f"{name}'s engine load not read ({_unread(load)}): its room is not judged")
    hot = [(name, load["kv_cache_usage"]) for name, load in known.items()
           if isinstance(load.get("kv_cache_usage"), (int, float)) and load["kv_cache_usage"] > settings.kv_cache_max]
    if hot:
        return lines, "; ".join(f"{name}'s KV cache is {usage:.0%} used, above [release.admission] kv_cache_max "
                                f"{settings.kv_cache_max:.0%}" for name, usage in hot) + f": it cannot take {draining}'s calls"
    seats = {name: load for name, load in known.items() if isinstance(load.get("max_num_seqs"), int)}
    if not seats:
        return lines, None
    extra = 0
    if _read(moved):
        extra = moved["running"] + moved["waiting"]
        said = f"{draining} moves {moved['running']} running + {moved['waiting']} waiting"
    else:
        said = f"{draining}'s own load not read ({moved.get('error') if isinstance(moved, dict) else 'not sent'}): counted as 0"
    for name, load in (also_moving or {}).items():
        if _read(load):
            extra += load["running"] + load["waiting"]
            said += f"; {name}, which may drain too, moves {load['running']} running + {load['waiting']} waiting"
        else:
            said += f"; {name}, which may drain too: its load not read ({_unread(load)}), counted as 0"
    demand = extra + sum(load["running"] + load["waiting"] for load in seats.values())
    room = sum(int(settings.seats_share * load["max_num_seqs"]) for load in seats.values())
    carried = ", ".join(f"{name} {load['running']} running + {load['waiting']} waiting of max_num_seqs "
                        f"{load['max_num_seqs']}" for name, load in seats.items())
    lines.append(f"room: {carried}; {said}: {demand} of {room} seats ([release.admission] seats_share "
                 f"{settings.seats_share:g})")
    if demand > room:
        return lines, (f"the nodes that would carry {draining}'s calls lack the room: {carried}; {said}: {demand} "
                       f"requests for {room} seats ([release.admission] seats_share {settings.seats_share:g})")
    return lines, None


class Rollout:
    """One ``flatshare release`` or ``rollback`` run over the chosen nodes.

    Args:
        root: the checkout (releases are rendered from it).
        chosen: the nodes to switch, in order.
        everyone: every inventory node (the admission probes the others).
        out: the operator's terminal.
        mode: what each node's switch is asked to do.
        undo: the rollout to undo (mode ``undo-rollout``).
        inventory: the inventory file in use, named in the commands this run suggests (:meth:`command`).
        verbose: each node prints its whole plan (else a compact one; the whole plan is in its release.log).
        quiet: the nodes' progress lines are not shown (their errors, this side's lines and the summary are).
        plain: never a live status line or colour, even on a terminal (control/live.py).
        retry: release even what failed and was taken back on some node (without it, such a release is refused
            on every node: :meth:`_failed_before`).
        wait_s: ``--wait``: how long (seconds, from the node's first attempt: a canary analysis before it does
            not count) a node refused for its admission to drain or because another release holds it is asked
            again (:meth:`_wait_again`); None refuses at once.
        changes_answers: ``--changes-answers``: golden answers that differ do not fail the canary analysis.
    """

    def __init__(self, root: Path, chosen: list[NodeTarget], everyone: list[NodeTarget], out: ReleaseOutput,
                 mode: Mode = Mode.RELEASE, force: bool = False, dry_run: bool = False, batch_size: int | None = None,
                 undo: str | None = None, auto_rollback: bool = True, analysis: str = "on",
                 inventory: Path | None = None, verbose: bool = False, quiet: bool = False,
                 plain: bool = False, retry: bool = False, wait_s: float | None = None,
                 changes_answers: bool = False) -> None:
        from .live import StatusLine, is_live

        self.root, self.chosen, self.everyone = root, chosen, everyone
        # Every line of this run goes through the status line: on a live terminal, waits are drawn in place.
        self.out = StatusLine(out.line, out.stream, is_live(out.stream, plain))
        self.verbose, self.quiet, self.retry = verbose, quiet, retry
        self.changes_answers = changes_answers
        #: With --wait: when (time.monotonic()) waiting for a node's admission or lock ends.
        self.wait_s = wait_s
        self.began = time.monotonic()
        self.code: int | None = None  # the run's exit code, once it ended
        self.node_times: dict[str, list] = {}  # node -> [its first switch's start, its last one's end] (monotonic s)
        self.inventory = inventory
        self.mode, self.force, self.dry_run, self.undo = mode, force, dry_run, undo
        self.auto_rollback, self.analysis = auto_rollback, analysis
        self.settings = chosen[0].settings
        self.batch_size = batch_size or self.settings.rollout.batch_size(len(everyone))
        self.id = uuid.uuid4().hex[:12]
        self._connections: dict[str, Connection] = {}
        self._opening: dict[str, Future] = {}
        self._closed = False
        self._lock = threading.Lock()
        self.switching: set[str] = set()
        self.asking: dict[str, bool] = {}  # nodes waiting for our answer right now -> whether to drain (else a go-ahead)
        self.waiting: dict[str, str] = {}  # node -> the refusal it waits (--wait) to ask again after, right now
        self.progress: dict[str, protocol.Progress] = {}  # node -> where its switch last said it stands
        self.refused: dict[str, str] = {}  # node -> why this side refused it before it was asked (the retry guard)
        self.outcomes: dict[str, protocol.Outcome] = {}  # node -> what it said it did (its outcome message)
        self.followed_up: dict[str, str] = {}  # node -> what it said of its switch when asked after a lost session
        self._ended = False  # the run's result is decided: other threads say nothing more
        self.followed_answers: dict[str, dict] = {}  # node -> its answer then (node/status.py ``switch_state``)
        self.switch_ids: dict[str, str] = {}  # node -> the id of its switch in this run
        self.analyses: list[dict] = []  # the canary analyses' documents (release --json)
        self.analysed: dict[str, str] = {}  # canary -> what its analysis made of it, for the summary
        self.taking_back: set[str] = set()  # canaries whose rollback after a failed analysis is under way
        self._guard_notes: list[str] = []  # what the guard beside a switch found to say (_end_guard says it)
        #: The retry guard (:meth:`_failed_before`), read beside a single node's switch (:meth:`_start_guard`) or
        #: before a fleet's: ``(its refusal or None, {node: the mark of its newest history record read})``, or
        #: the exception it raised, once it ended. A switch's node asks before its first change holding its lock,
        #: sending its mark: the guard is read again when they differ (:meth:`guard_refusal`).
        self._guard: Future | None = None
        self._guard_carries: list[NodeTarget] = []  # the canaries whose owed rollback this rollout carries out

    # --- connections, one per node, shared by every command of this run ------------------------------

    def prefetch(self, targets: list[NodeTarget]) -> None:
        """Start opening these nodes' connections in the background (each bounded by the connect bound).

        A release waits for two connections in turn (its node's, then the others' for the
        admission probe); opened at once, the second costs nothing by the time it is needed.
        Opening a connection runs nothing on the node. A failure is kept for the first use.
        """
        for target in targets:
            with self._lock:
                if self._closed or target.name in self._connections or target.name in self._opening:
                    continue
                future: Future = Future()
                self._opening[target.name] = future
            threading.Thread(target=self._open, args=(target, future), daemon=True,
                             name=f"connect-{target.name}").start()

    def _open(self, target: NodeTarget, future: Future) -> None:
        try:
            conn = target.connect()
        except BaseException as err:
            future.set_exception(err)
            return
        with self._lock:
            closed = self._closed
        if closed:
            conn.close()
            future.set_exception(TransportError(f"{target.name}: the run ended while connecting"))
        else:
            future.set_result(conn)

    def connection(self, target: NodeTarget) -> Connection:
        """The node's connection (opened on first use, or taken from :meth:`prefetch`).

        Raises:
            TransportError: the node could not be reached within the connect bound (a
                background attempt's failure is raised once; the next use tries again).
        """
        mine = False
        with self._lock:
            conn = self._connections.get(target.name)
            opening = self._opening.get(target.name) if conn is None else None
            if conn is None and opening is None:  # the first use, and none being opened: this thread opens it
                opening, mine = Future(), True
                self._opening[target.name] = opening
        if conn is not None:
            return conn
        assert opening is not None
        if mine:
            self._open(target, opening)
        try:  # two threads asking at once (the retry guard beside a switch) share one connection
            conn = opening.result()
        except BaseException:
            with self._lock:
                if self._opening.get(target.name) is opening:
                    del self._opening[target.name]  # raised once: the next use tries again
            raise
        with self._lock:
            if self._opening.get(target.name) is opening:
                del self._opening[target.name]
            return self._connections.setdefault(target.name, conn)

    def start(self, target: NodeTarget, argv: list[str]) -> Session:
        """Start ``argv`` on the node over its kept connection; a kept connection found dead is reopened
        (bounded by the reconnect bound) before anything is reported or decided from it.

        Raises:
            TransportError: the node could not be reached again within the reconnect bound.
        """
        try:
            return self.connection(target).start(argv)
        except Lost:
            pass  # nothing ran: the connection was dead before the command started
        return self.reopen(target).start(argv)

    def run_command(self, target: NodeTarget, argv: list[str], stdin: bytes = b"") -> CommandResult:
        """Run a read-only node-side command to its end (``command_timeout_s``; ``stdin`` sent to it), over a kept
        connection that is reopened (within the reconnect bound) when it is found dead or drops while it runs.

        Raises:
            TransportError: the node could not be reached, or did not answer within the bound.
        """
        bound = self.settings.transport.command_timeout_s
        try:
            return self.connection(target).run(argv, stdin=stdin, timeout_s=bound)
        except Lost:
            pass  # read-only: running it again on a new connection changes nothing
        return self.reopen(target).run(argv, stdin=stdin, timeout_s=bound)

    def reopen(self, target: NodeTarget) -> Connection:
        """Drop the node's connection and open a new one, trying for at most the reconnect bound (``reconnect_s``).

        Raises:
            TransportError: no connection within the bound (the last error says why).
        """
        self.drop(target)
        bound = self.settings.transport.reconnect_s
        seen: dict = {}

        def opened() -> bool:
            try:
                seen["connection"] = self.connection(target)
                return True
            except TransportError as err:
                seen["error"] = err
                self.drop(target)
                return False

        if poll_until(opened, bound, 1.0):
            return seen["connection"]
        raise TransportError(f"{target.name}: its connection dropped and it could not be reached again within "
                             f"{bound:g} s (the reconnect bound): {seen.get('error')}")

    def drop(self, target: NodeTarget) -> None:
        """Forget a node's connection (lost or stalled); the next use reconnects."""
        with self._lock:
            conn = self._connections.pop(target.name, None)
        if conn is not None:
            try:
                conn.close()
            except Exception:
                pass

    def close(self, opening_s: float | None = None) -> None:
        """Close every connection; one still being opened is closed when it opens, and waited for (within the
        connect bound, or ``opening_s`` seconds when given: an interrupted run, whose operator waits for nothing):
        a connection's transport thread still negotiating when the process exits can abort the interpreter's exit
        ("FATAL: exception not rethrown"; cli/__init__.py ``main`` then ends the process at once)."""
        from concurrent.futures import TimeoutError as FutureTimeout

        with self._lock:
            self._closed = True
            opening, self._opening = list(self._opening.values()), {}
        for target in list(self.everyone):
            self.drop(target)
        bound = self.settings.transport.connect_timeout_s + 5 if opening_s is None else opening_s
        for future in opening:
            try:
                if future.exception(timeout=bound) is None:
                    future.result().close()
            except FutureTimeout:
                pass  # still connecting past its own bound: nothing more to wait for

    def command(self, words: str) -> str:
        """A command this run suggests, quoted for the message: ``'flatshare WORDS'``, with ``--inventory PATH``
        when the inventory in use is neither the default nor ``$FLATSHARE_INVENTORY`` (copied as printed, the
        command then reaches these nodes, never production's)."""
        import os
        import shlex

        from ..config.inventory import DEFAULT_INVENTORY

        inventory = self.inventory
        argv = ["flatshare", *words.split()]
        if not (inventory is None or inventory == DEFAULT_INVENTORY
                or os.environ.get("FLATSHARE_INVENTORY") == str(inventory)):
            argv += ["--inventory", shlex.quote(str(inventory))]
        return "'" + " ".join(argv) + "'"

    # --- the run ------------------------------------------------------------------------------------

    def run(self) -> int:
        """Switch the chosen nodes batch by batch (canaries first, analysed), stopping once more nodes failed
        than the strategy's ``max_failed``, or when the canaries' analysis says so.

        Returns:
            The exit code: the analysis's (``ANALYSIS_FAILED``, ``PAUSED``), else the first failing node's (the
            rollout stopped, or went on within ``max_failed``: those nodes do not run the release), else
            ``Exit.OK`` if any node switched, else ``Exit.NOTHING_TO_DO``.
        """
        worst: int | None = None
        failures: list[NodeTarget] = []
        interrupted = False
        try:  # from here an interrupt ends with each node's line (before the first batch: not started)
            total, floor, strategy = len(self.everyone), self.settings.serving_floor, self.settings.rollout
            if total > 1 and self.batch_size > total - floor:
                raise FlatshareError(
                    f"batches of {self.batch_size} would drain more than {total - floor} of {total} nodes at once "
                    f"(min_serving {self.settings.min_serving}); use at most {max(1, total - floor)} "
                    "(--batch-size, or the inventory's rollout.batch)")
            canaries = min(strategy.canaries, len(self.chosen) - 1) if len(self.chosen) > 1 else 0
            batches = plan_batches(self.chosen, canaries, self.batch_size)
            if len(self.chosen) > 1 or self.mode != Mode.RELEASE:
                self.out.line(f"rollout {self.id}: {self.mode} of {', '.join(t.name for t in self.chosen)}"
                              + (f" (of rollout {self.undo}: its nodes' history records these switches under that id)"
                                 if self.mode == Mode.UNDO_ROLLOUT and self.undo else "")
                              + (" (dry run)" if self.dry_run else "")
                              + (f"; batches {' | '.join(', '.join(t.name for t in b) for b in batches)}"
                                 + (f" (the first: the canar{'y' if canaries == 1 else 'ies'})" if canaries else "")
                                 if len(batches) > 1 else ""))
            if floor == 0 and total > 1:
                self.out.line(f"note: min_serving 0 (the inventory's): no node of these {total} need take calls while "
                              "this runs, so every node may drain at once")
            if len(self.chosen) > 1 and strategy.canaries > canaries:
                self.out.line(f"rollout.canaries {strategy.canaries} is more than this rollout of {len(self.chosen)} "
                              f"nodes can have: {canaries}, so that a node follows the canaries' analysis")
            # The first batch, and the nodes its admission probes (and whose history the retry guard reads).
            self.prefetch(batches[0] + [t for t in self.everyone if t not in self.chosen])
            # A canary whose rollback is owed is rolled back by this rollout's canary step (not refused).
            carries = batches[0] if canaries and not self.dry_run and self.analysis != "skip" else []
            refusal = None
            if self.mode == Mode.RELEASE and not self.retry:
                self._guard_carries = carries
                if len(self.chosen) == 1:
                    self._start_guard()  # beside the switch: its node asks before its first change
                else:
                    refusal = self._read_guard()
            # A release or an undo (rollback --all) of several nodes; a rollback of chosen nodes goes straight.
            if refusal is None and self.mode != Mode.ROLLBACK and len(self.chosen) > 1 and not self.dry_run:
                refusal = self._preflight_fleet()
            if refusal is not None:
                self.out.line(f"flatshare: release refused: {refusal}")
                for t in self.chosen:
                    t.result = Exit.REFUSED
                    self.refused[t.name] = refusal
                batches, worst = [], Exit.REFUSED
            for number, batch in enumerate(batches):
                self._run_batch(batch)
                failures += [t for t in batch if t.result not in (Exit.OK, Exit.NOTHING_TO_DO)]
                if number == 0 and canaries and failures and number + 1 < len(batches):
                    # A canary that failed (or rolled itself back) stops the rollout whatever max_failed
                    # tolerates: the canaries are there to keep a bad release from the rest (adr/0012).
                    worst = failures[0].result
                    self.out.line(f"rollout {self.id} stops: the canar{'y' if canaries == 1 else 'ies'} "
                                  f"{', '.join(t.name for t in failures)} "
                                  + ("would not switch to the release in this dry run" if self.dry_run
                                     else "did not switch to the release")
                                  + " (a canary that does not switch stops the rollout, whatever max_failed allows "
                                  "after the canaries)")
                    break
                if len(failures) > strategy.max_failed:
                    worst = failures[0].result
                    if len(failures) > 1 or strategy.max_failed:
                        self.out.line(f"rollout {self.id} stops: {len(failures)} node(s) failed, more than "
                                      f"max_failed {strategy.max_failed}")
                    break
                if number == 0 and canaries and number + 1 < len(batches) \
                        and self.mode in (Mode.RELEASE, Mode.UNDO_ROLLOUT):
                    code = self._canary_analysis(batch, batches[number + 1:])
                    if code is not None:
                        worst = code
                        break
            self._end_guard()
        except OperatorInterrupted as stop:
            hold_signals()  # the summary says it whole: a second signal is only noted
            interrupted = True
            self.out.line(f"interrupted: {'Ctrl-C' if stop.code == Exit.INTERRUPTED else 'SIGTERM'} stops the "
                          "operator's side only; a node that was switching carries on and records its outcome")
            self.code = stop.code
            self._summary(interrupted=True)
            return stop.code
        finally:
            # The run's result is decided (its table, summary and --json document follow): a signal from here on
            # is only noted, and the run ends with its own code; nothing more is said from other threads.
            hold_signals()
            self._ended = True
            self.close(1.0 if interrupted else None)
            self.out.finish()
        if worst is None and failures:  # tolerated (max_failed), but those nodes do not run the release
            worst = failures[0].result
        self.code = worst if worst is not None else (
            Exit.OK if any(t.result == Exit.OK for t in self.chosen) else Exit.NOTHING_TO_DO)
        if not self.dry_run:
            from .summary import table_lines

            for line in table_lines(self.document()):
                self.out.line(line)
        if len(self.chosen) > 1 or worst is not None:  # a line a node: what became of it, and why
            self._summary()
        return self.code

    def _preflight_fleet(self) -> str | None:
        """Every chosen node's preflight at once, before any node drains (each node's switcher, in a
        preflight-only dry run: its refusals and its preflight, kept for its switch to reuse; for an undo
        (``rollback --all``), of the target each node decides, as its switch will); why the rollout is
        refused, naming each node that cannot take the release or could not be asked (asked twice, the second
        time on a fresh connection: a preflight changes nothing), or None. A node refused for what waiting may
        end (its lock) is said and left to its switch."""
        from .bundle import bundle

        def preflight(target: NodeTarget) -> tuple[int | None, protocol.Outcome | None, str]:
            code, outcome, said = attempt(target)
            if outcome is None:  # a dropped session, a node that did not answer: once more, on a fresh connection
                self.drop(target)
                code, outcome, again = attempt(target)
                if outcome is None:
                    said = f"{said}; asked again: {again}"
            return code, outcome, said

        def attempt(target: NodeTarget) -> tuple[int | None, protocol.Outcome | None, str]:
            switch_id = uuid.uuid4().hex[:16]
            try:
                # A rollback's target is decided by each node from its history, as its switch will decide it.
                payload = bundle(self.root, target, ship=not target.local) if self.mode == Mode.RELEASE else {}
                payload.update(progress_every_s=progress_cadence(self.settings.transport.silence_s),
                               plan=PlanForm.COMPACT, preflight_only=True)
                session = self.start(target, commands.switch(
                    target.spec, switch_id,
                    rollout=self.undo if self.mode == Mode.UNDO_ROLLOUT and self.undo else self.id,
                    force=self.force, dry_run=True, rollback=self.mode == Mode.ROLLBACK,
                    undo_rollout=self.undo if self.mode == Mode.UNDO_ROLLOUT else None))
            except TransportError as err:
                return None, None, str(err)
            outcome, said = None, []
            try:
                session.send((json.dumps(payload) + "\n").encode())
                for line in session.lines(self.settings.transport.silence_s):
                    if not protocol.is_protocol(line):
                        said.append(line)
                        continue
                    message = protocol.parse(line)
                    if isinstance(message, protocol.AdmitRequest):  # never asked in a preflight: refused if it is
                        session.send(protocol.answer_line(protocol.AdmitAnswer(False, "a preflight drains nothing")).encode())
                    elif isinstance(message, protocol.Outcome):
                        outcome = message
                status = session.exit_status(10.0)
            except (Silence, Lost) as err:
                return None, None, str(err)
            finally:
                session.close()
            if outcome is None:
                why = ("the connection ended with neither the node's outcome nor an exit status (dropped?)"
                       if status is None else f"exit {status} without an outcome"
                       + (f": {clip(said[-1], 300)}" if said else ""))
                return None, None, why
            return outcome.code, outcome, (said[-1] if said else "")

        started = time.monotonic()
        self.out.line(f"rollout {self.id}: the preflight of {', '.join(t.name for t in self.chosen)} at once, "
                      "before any node drains")
        answers = list(zip(self.chosen, at_once(preflight, self.chosen)))
        cannot = []
        for target, (code, outcome, said) in answers:
            if outcome is None:
                cannot.append((target.name, f"could not be asked ({clip(said, 600)})"))
                self.out.line(f"preflight of {target.name}: could not be asked ({clip(said, 600)})")
            elif code in (Exit.OK, Exit.NOTHING_TO_DO):
                self.out.line(f"preflight of {target.name}: "
                              + ("nothing to switch" if code == Exit.NOTHING_TO_DO else "passed"))
            elif code == Exit.REFUSED and outcome.refused_for is None:
                cannot.append((target.name, outcome.message or "refused, with no reason given"))
                self.out.line(f"preflight of {target.name}: {outcome.message}")
            else:
                self.out.line(f"preflight of {target.name}: {outcome.result} ({clip(outcome.message or '', 300)}); "
                              "its switch decides again")
        self.out.line(f"rollout {self.id}: the fleet's preflight took {time.monotonic() - started:.1f} s")
        if not cannot:
            return None
        what = Mode.RELEASE if self.mode == Mode.RELEASE else Mode.ROLLBACK
        others = ("; the others can be released with --node" if self.mode == Mode.RELEASE else
                  "; each other node can be rolled back with 'flatshare rollback --node NAME'")
        return (f"the fleet's preflight found {' and '.join(n for n, _ in cannot)} cannot take this {what}, so "
                f"no node was drained: " + "; ".join(f"{n}: {m}" for n, m in cannot) + others)

    def _failed_before(self, carries: list[NodeTarget] | tuple = (), say: Callable[[str], None] | None = None,
                       seen: dict[str, str | None] | None = None,
                       nodes: list[NodeTarget] | None = None) -> str | None:
        """Why this checkout's release is refused, or None: on some node of the inventory, the release this
        checkout renders for it failed (rolled back automatically, or its canary analysis failed: node/history.py
        ``failed_releases``), taken back or, for a canary whose rollback is owed, not yet. Release ids are per
        node, so each node's history is read for its own; a failure anywhere refuses the whole fleet until
        ``--retry``, except an owed rollback on one of ``carries`` (this rollout's canaries, whose canary step
        carries it out first). A node whose history cannot be read is said (by ``say``, a line at a time: the
        operator's output unless given), and does not refuse. ``seen``, when given, gets each node's newest
        history mark as read (node/history.py ``newest_mark``; None for a history the node could not read; no
        entry for a node not reached). ``nodes``: the nodes whose histories are read (every inventory node unless
        given)."""
        from ..common.clock import utc_stamp
        from ..node.history import failed_releases
        from .bundle import bundle

        say = say or self.out.line

        def failed_on(target: NodeTarget) -> tuple[str, dict] | None:
            try:
                release = bundle(self.root, target, ship=False)["id"]
            except FlatshareError as err:
                if target in self.chosen:
                    raise
                # Another node's profile that does not render stops nothing here: its own release would say it.
                say(f"{target.name}: its profile does not render ({err}): whether this release failed "
                    "there is not known")
                return None
            try:
                result = self.run_command(target, commands.history(target.spec))
            except TransportError as err:
                say(f"{target.name}: its history could not be read ({err}): whether this release "
                    "failed there is not known")
                return None
            try:
                answer = answer_of(result)
            except ValueError as err:  # the node's own one line (a damaged history: exit 5), said as it said it
                said = not_an_answer(result.status, f"{result.output}\n{result.errors}", err)
                say(f"{target.name}: its history could not be read ({said}): whether this release "
                    "failed there is not known")
                if seen is not None:
                    seen[target.name] = None
                return None
            records = answer.get("records") if isinstance(answer, dict) else None
            if seen is not None:
                mark = answer.get("newest") if isinstance(answer, dict) else None
                seen[target.name] = mark if isinstance(mark, str) else None
            found = failed_releases(records if isinstance(records, list) else []).get(release)
            return (release, found) if found else None

        reading = self.everyone if nodes is None else nodes
        found = list(zip(reading, at_once(failed_on, reading)))
        for target, failure in found:
            if failure is None:
                continue
            release, how = failure
            when = utc_stamp(how["at"]) if isinstance(how.get("at"), (int, float)) else "at a time not recorded"
            if how.get("owed"):
                if target in carries:
                    continue
                return (f"this checkout's release for {target.name} ({release}) failed there ({how['how']}, {when}: "
                        f"{clip(str(how['why']), 300)}) and {target.name} still runs it: "
                        f"{owed_rollback_words(target.name)}; it is refused on every node until asked for again with "
                        "--retry")
            return (f"this checkout's release for {target.name} ({release}) failed there and was taken back "
                    f"({how['how']}, {when}: {clip(str(how['why']), 300)}); it is refused on every node until asked "
                    "for again with --retry")
        return None

    def _start_guard(self) -> None:
        """Read the retry guard (:meth:`_failed_before`) in a thread of its own while the single chosen node's
        switch starts, so that its history reads cost the release nothing: the switch's bundle says ``confirm``,
        and its node asks for a go-ahead after its preflight, before its admission to drain and any change (also
        with nothing to switch), when :meth:`guard_refusal` waits for the verdict."""

        guard: Future = Future()

        def read() -> None:
            seen: dict[str, str | None] = {}
            try:  # its notes said by _end_guard, in the main thread, once the verdict is in
                guard.set_result((self._failed_before(self._guard_carries, self._guard_notes.append, seen), seen))
            except BaseException as err:  # raised where the verdict is awaited
                guard.set_exception(err)

        threading.Thread(target=read, daemon=True, name="retry-guard").start()
        self._guard = guard

    def _end_guard(self) -> None:
        """Wait for the guard (:meth:`_start_guard`) to end, in small steps (a signal reaches the main thread
        between them), then say its notes (a history that could not be read), once. An interrupted release
        never gets here: what the guard would have said is not said after the summary."""
        from concurrent.futures import wait

        while self._guard is not None and not self._guard.done():
            wait([self._guard], 0.2)
        while self._guard_notes:
            self.out.line(self._guard_notes.pop(0))

    def _say_while_running(self, line: str) -> None:
        """A line from another thread (a history read's note), said only until the run has ended: after an
        interrupted run's summary it would read as the run going on."""
        if not self._ended:
            self.out.line(line)

    def _read_guard(self, only: NodeTarget | None = None) -> str | None:
        """Read the retry guard now, in this thread, and keep it (with the history marks it read) for the go-ahead
        each switch's node asks (:meth:`guard_refusal`); its refusal or None. With ``only``, that node's history
        alone is read again, the others' marks kept from the guard's last read (which found no failure).

        Raises:
            FlatshareError: a chosen node's profile that does not render.
        """
        seen: dict[str, str | None] = {}
        if only is not None and self._guard is not None and self._guard.done():
            seen = dict(self._guard.result()[1])
        verdict = self._failed_before(self._guard_carries, self._say_while_running, seen=seen,
                                      nodes=None if only is None else [only])
        guard: Future = Future()
        guard.set_result((verdict, seen))
        self._guard = guard
        return verdict

    def guard_refusal(self, target: NodeTarget, mark: str | None) -> str | None:
        """Why the retry guard refuses this release (kept as ``target``'s refusal, for the summary), or None.

        ``mark`` is the node's newest history record's mark, sent holding its release lock
        (``AdmitRequest.history``). The guard may have been read before the node took its lock, while another
        release of the node was still under way: when the mark differs from the one the guard read, the node's
        history changed since (that release failed and was rolled back, say), and its history is read again,
        now that no other switch of the node can write it (the others' verdict stands: nothing failed there).

        Raises:
            FlatshareError: what the guard raised (a chosen node's profile that does not render).
        """
        self._end_guard()
        if self._guard is None:
            return None
        verdict, seen = self._guard.result()
        if verdict is None and seen.get(target.name, _NOT_READ) != mark:
            verdict = self._read_guard(only=target)
        if verdict is not None:
            self.refused[target.name] = verdict
        return verdict

    def _canary_analysis(self, canaries: list[NodeTarget], later: list[list[NodeTarget]]) -> int | None:
        """Analyse the canaries that switched; None to go on with the next batch, else the rollout's exit code
        (the canaries rolled back: ``ANALYSIS_FAILED``; left in place: ``PAUSED``)."""
        from .analysis import Action
        from .canary import analyse, record

        switched = [t for t in canaries if t.result == Exit.OK]
        # A canary with nothing to do is judged again only in a release: an undo goes back to releases that served.
        unjudged = [t for t in canaries if t.result == Exit.NOTHING_TO_DO and t.name in self.outcomes
                    and self.outcomes[t.name].unjudged and self.mode == Mode.RELEASE]
        owed = [t for t in unjudged if (self.outcomes[t.name].detail or {}).get("analysis_failed_in")]
        if owed and not self.dry_run and self.analysis != "skip":
            # Its analysis failed, and the rollback that decided never happened (the operator's side stopped,
            # the rollback was refused): carried out now, before anything else; never analysed again instead.
            for target in owed:
                self.switch_ids[target.name] = cast(str, self.outcomes[target.name].unjudged)  # unjudged: has one
                self.out.line(f"{target.name}: its canary analysis failed in rollout "
                              f"{self.outcomes[target.name].detail['analysis_failed_in']} and it was not rolled back: "
                              "rolling it back now; the rollout stops")
            return self._roll_back_canaries(owed, "analysis failed earlier")
        for target in unjudged:
            # It runs this release already, but no analysis passed it (an interrupted or paused rollout, a
            # release of it alone): judged now, before any other node switches; recorded against its switch.
            self.switch_ids[target.name] = cast(str, self.outcomes[target.name].unjudged)  # unjudged: has one
            self.out.line(f"{target.name} runs this release, but no canary analysis passed it (its switch "
                          f"{self.outcomes[target.name].unjudged}): it is analysed before the next batch")
        switched += unjudged
        if self.dry_run or not switched:
            return None
        firsts = [t for t in switched if self.outcomes.get(t.name) is not None and self.outcomes[t.name].first]
        if firsts and len(firsts) == len(switched):
            # Each canary's first release: nothing ran there before to compare with or go back to (as Argo
            # Rollouts' first rollout of a new Rollout skips its steps). The next batches' nodes, if they had a
            # release, are judged by their own switch's checks.
            why = "the canary analysis was skipped: its first release (the node had none before)"
            for target in switched:
                self.analysed[target.name] = "analysis skipped: its first release"
                record(self, target, self.switch_ids[target.name],
                       {"schema": 1, "skipped": True, "summary": why, "canary": target.name, "measurements": []})
            whose = "its" if len(switched) == 1 else "each one's"
            self.out.line(f"canary analysis skipped: {', '.join(t.name for t in switched)} had no release before "
                          f"(a node's first release has nothing to compare with or roll back to); recorded in {whose} "
                          "history")
            return None
        if self.analysis == "skip":
            for target in switched:
                self.analysed[target.name] = "analysis skipped (--analysis skip)"
                record(self, target, self.switch_ids[target.name],
                       {"schema": 1, "skipped": True, "summary": "the canary analysis was skipped (--analysis skip)",
                        "canary": target.name, "measurements": []})
            self.out.line("canary analysis skipped (--analysis skip): recorded in the canaries' history")
            return None
        waiting = [t for batch in later for t in batch] + [t for t in self.everyone if t not in self.chosen]
        baseline = next((t for t in waiting if t not in switched), None)
        for target in switched:  # what the summary says if the analysis is interrupted (replaced by its result)
            self.analysed[target.name] = (f"its analysis was under way when interrupted: it is unjudged, and "
                                          f"{self.command('release --all')} analyses it first")
        verdict = analyse(self, switched, baseline, dry_run=self.analysis == "dry-run")
        if verdict.aborted is not None:  # nothing judged: nothing recorded, decided or acted on
            for target in switched:
                self.analysed[target.name] = "analysis stopped: another switch moved a node it measured"
            self.out.line(f"the rollout stops: its canary analysis could not judge the release ({verdict.aborted}); "
                          f"{self.command('status')} shows where each node is, and {self.command('release --all')} "
                          "analyses the canary again")
            return Exit.PAUSED
        self.analyses += verdict.documents()
        for name, result in verdict.results.items():
            self.analysed[name] = f"analysis {result.phase}" + (" (dry run)" if result.dry_run else "")
            record(self, next(t for t in switched if t.name == name), self.switch_ids[name], result.document())
        if verdict.action == Action.ROLLBACK:
            self.out.line(f"the canary analysis failed: rolling back {', '.join(t.name for t in switched)}; the "
                          "rollout stops")
            return self._roll_back_canaries(switched)
        if verdict.action == Action.PAUSE:
            names = ", ".join(t.name for t in switched)
            if self.mode == Mode.UNDO_ROLLOUT:
                self.out.line(f"the canary analysis was inconclusive and the profile says pause: the undo of rollout "
                              f"{self.undo} stops with {names} back on what it ran before. To go on: "
                              f"{self.command('rollback --all --analysis skip')} (recorded), or again with calls to "
                              "measure")
            else:
                self.out.line(f"the canary analysis was inconclusive and the profile says pause: the rollout stops "
                              f"with {names} on the new release. To go on: "
                              f"{self.command('release --all --analysis skip')} (recorded), or again with calls to "
                              f"measure; to undo it: {self.command('rollback --all')}")
            return Exit.PAUSED
        return None

    def _roll_back_canaries(self, canaries: list[NodeTarget], why: str | None = None) -> int:
        """Roll back canaries whose analysis failed; ``ANALYSIS_FAILED`` when every one was rolled back, else the
        first rollback's own exit code (the canary still runs the release the analysis failed: the next
        rollout finds its rollback owed and carries it out)."""
        for target in canaries:
            if why is not None:
                self.analysed[target.name] = why
            # What the release did no longer stands: the rollback decides (an interrupt says it was under way).
            target.result = None
            self.taking_back.add(target.name)
            target.result = self.switch(target, mode=Mode.ROLLBACK)
            self.taking_back.discard(target.name)
            self.analysed[target.name] += (", rolled back" if target.result == Exit.OK
                                           else f", its rollback ended with exit {target.result}")
        failed = [t for t in canaries if t.result != Exit.OK]
        return cast(int, failed[0].result) if failed else Exit.ANALYSIS_FAILED  # each set by self.switch above

    def _run_batch(self, batch: list[NodeTarget]) -> None:
        if len(batch) == 1:
            batch[0].result = self.switch(batch[0])
            return
        threads = [threading.Thread(target=lambda t=t: setattr(t, "result", self.switch(t)), daemon=True)
                   for t in batch]
        for thread in threads:
            thread.start()
        for thread in threads:
            while thread.is_alive():
                thread.join(0.2)  # in small steps: a signal reaches the main thread between them

    def _result(self, t: NodeTarget) -> tuple[str, str | None]:
        """(what became of node ``t`` in a few words, the reason or what to do when there is one)."""
        outcome = self.outcomes.get(t.name)
        if t.name in self.refused:
            return EXIT_NAMES[Exit.REFUSED], self.refused[t.name]
        if t.result is None and t.name in self.taking_back:
            return ("its rollback (its analysis failed) was under way when interrupted",
                    "the node finishes it, or, before any change, refuses it once its admission to drain goes "
                    "unanswered: the rollback is then owed, and the next 'flatshare release --all' carries it out "
                    f"first ({self.command('status')} shows which)")
        if t.result is None and t.name in self.waiting:
            return ("waiting (--wait) to ask again when interrupted",
                    f"its last attempt was refused ({self.waiting[t.name]}); nothing changed on it")
        stands = self.progress.get(t.name)
        if t.result is None and t.name in self.switching and stands is not None \
                and stands.phase == SwitchPhase.NOTHING_TO_DO:
            return ("had nothing to do on the node when interrupted",
                    f"it runs what was asked already, changes nothing and ends by itself: {self.command('status')} "
                    "shows it")
        if t.result is None and t.name in self.asking and stands is not None \
                and stands.phase == SwitchPhase.ROLLING_BACK:
            return ("its automatic rollback was asking for admission to drain when interrupted (its new release did "
                    "not serve)", "without an answer the rollback does not begin: the node stays on the release that "
                    "did not serve, its switch's journal kept, and gives calls back; "
                    f"{self.command(f'rollback --node {t.name}')} takes it back ({self.command('status')} shows it)")
        if t.result is None and t.name in self.asking and stands is not None \
                and stands.phase in (SwitchPhase.SWITCHING, SwitchPhase.ENDING_EARLY):
            return ("was asking for admission to drain again mid-switch (its gateway's stop) when interrupted",
                    "without an answer it ends its switch early and gives calls back "
                    f"({self.command('status')} shows it)")
        if t.result is None and t.name in self.asking:
            asked = "admission to drain" if self.asking[t.name] else "the go-ahead (before any change)"
            return (f"was asking for {asked}", "without an answer it refuses and changes nothing "
                    f"({self.command('status')} shows it)")
        if t.result is None and t.name in self.switching:
            if stands is None or stands.phase == SwitchPhase.DECIDING:
                # Its refusals, preflight or admission: nothing changed there yet, and an admission no one
                # answers now is refused (node/cli.py): it changes nothing unless its plan drains nothing.
                return ("deciding on the node when interrupted (its checks and preflight, before any change)",
                        "it refuses once its admission to drain goes unanswered (a plan that drains nothing goes "
                        f"on): {self.command('status')} shows what it did")
            where = f" (step {stands.step})" if stands.step else ""
            if stands.phase == SwitchPhase.ROLLING_BACK:
                return (f"rolling back automatically on the node when interrupted{where} (its new release did not "
                        "serve)", f"it carries on: {self.command('status')} follows it")
            if stands.phase == SwitchPhase.ENDING_EARLY:
                return (f"ending its switch early on the node when interrupted{where}",
                        f"it gives calls back: {self.command('status')} follows it")
            return f"switching on the node when interrupted{where}", f"it carries on: {self.command('status')} follows it"
        if t.result is None:
            return "not started", None
        if self.dry_run and t.result == Exit.OK:
            return "planned (dry run)", None
        if outcome is not None and t.result in (Exit.OK, Exit.ROLLED_BACK):
            # What the node said it did: released, rolled back, repaired, rolled back automatically.
            return (outcome.result or EXIT_NAMES.get(t.result, f"exit {t.result}"),
                    (outcome.message or "the node gave no reason") if t.result == Exit.ROLLED_BACK else None)
        return (EXIT_NAMES.get(t.result, f"exit {t.result}"),
                outcome.message if outcome is not None else self.followed_up.get(t.name))

    def _summary(self, interrupted: bool = False) -> None:
        """One line a node (``NAME: RESULT: why (analysis)``): an interrupted run's, and a dry run's."""
        for t in self.chosen:
            result, message = self._result(t)
            if message and t.result is None and t.name in self.switching and t.name not in self.asking:
                label = f"{result} ({message})"
            elif message and t.result != Exit.OK:  # not started, refused, failed, rolled back: and why
                label = f"{result}: {message}"
            else:
                label = result
            if t.name in self.analysed:
                label += f" ({self.analysed[t.name]})"
            self.out.line(f"{t.name}: {label}")

    def document(self) -> dict:
        """What became of this run, as one JSON-ready document (``--json``; control/summary.py renders it).

        Returns:
            ``{"rollout", "mode", "dry_run", "code", "meaning", "duration_s", "nodes", "analyses"}``: ``nodes`` is
            node -> ``{"code", "result", "message", "switch", "from", "to", "tried", "commit", "drained_s",
            "engine_start_s", "analysis", "duration_s"}`` (and ``"plan"``, the node's plan as data, in a dry run);
            ``to`` is the release the node is on afterwards, ``tried`` the release a switch the node rolled back
            by itself went to (None otherwise); durations in seconds, None where not known (the node did not say,
            or did not get that far).
        """
        now = time.monotonic()
        nodes = {}
        for t in self.chosen:
            outcome = self.outcomes.get(t.name)
            result, message = self._result(t)
            times = self.node_times.get(t.name)
            # A node asked after a lost session gave no outcome: what its answer records of the switch.
            before, after, tried = (outcome.before, outcome.release, _tried(outcome)) if outcome is not None else \
                followed_releases(self.followed_answers.get(t.name, {}))
            entry = {
                "code": t.result, "result": result, "message": message, "switch": self.switch_ids.get(t.name),
                "from": before, "to": after, "tried": tried,
                "commit": outcome.commit if outcome else None,
                "drained_s": outcome.drained_s if outcome else None,
                "engine_start_s": outcome.engine_start_s if outcome else None,
                "analysis": self.analysed.get(t.name),
                "duration_s": round(times[1] - times[0], 3) if times and times[1] is not None else None}
            if self.dry_run and outcome is not None and outcome.plan:
                entry["plan"] = outcome.plan
            nodes[t.name] = entry
        code = int(self.code) if self.code is not None else None
        return {"rollout": self.id, "mode": self.mode, "dry_run": self.dry_run, "code": code,
                "meaning": "done" if code == 0 else "not ended" if code is None else EXIT_NAMES.get(code, f"exit {code}"),
                "duration_s": round(now - self.began, 3), "nodes": nodes, "analyses": self.analyses}

    def elapsed(self) -> str:
        """Time since this run began, for the start of a node's lines: ``0:41``, ``12:05``."""
        minutes, secs = divmod(int(time.monotonic() - self.began), 60)
        return f"{minutes}:{secs:02d}"

    # --- one node --------------------------------------------------------------------------------------

    def switch(self, target: NodeTarget, mode: Mode | None = None) -> int:
        """Run the node's switch (``mode``: this run's, or ``rollback`` for a canary that failed its analysis)
        and report what the node says; returns its exit code."""
        mode = mode or self.mode

        def echo(text: str) -> None:
            if not self.quiet or text.startswith("flatshare:"):
                self.out.line(f"[{target.name} {self.elapsed()}] {text}")

        times = self.node_times.setdefault(target.name, [time.monotonic(), None])
        wait_until = time.monotonic() + self.wait_s if self.wait_s else None
        try:
            while True:
                attempt = time.monotonic()
                code = self._switch(target, mode, echo)
                pause = self._wait_again(target, code, wait_until, time.monotonic() - attempt)
                if pause is None:
                    return code
                assert wait_until is not None  # _wait_again pauses only within --wait
                why = self.outcomes[target.name].message or "refused"
                # This side's decision: said even with -q.
                self.out.line(f"[{target.name} {self.elapsed()}] waiting (--wait): {why}; asking again in "
                              f"{pause:.0f} s ({wait_until - time.monotonic():.0f} s of --wait left)")
                self.switching.discard(target.name)
                self.progress.pop(target.name, None)
                self.waiting[target.name] = why  # kept if the wait is interrupted: the summary says so
                time.sleep(pause)
                self.waiting.pop(target.name, None)
                # The release may have failed and been taken back meanwhile (the run it waited for): asked again.
                refusal = self._read_guard() if mode == Mode.RELEASE and not self.retry else None
                if refusal is not None:
                    echo(f"flatshare: release refused: {refusal}")
                    self.refused[target.name] = refusal
                    return Exit.REFUSED
        finally:
            times[1] = time.monotonic()

    def _wait_again(self, target: NodeTarget, code: int, wait_until: float | None,
                    attempt_s: float = 0.0) -> float | None:
        """Seconds to wait before switching ``target`` again, or None: only with ``--wait``, for a refusal the
        node says waiting may end (its admission to drain, or another release holding it: the outcome's
        ``refused_for``), and while the wait's bound (``wait_until``, monotonic seconds) leaves room for the
        pause and one more attempt as long as the last (``attempt_s``: its checks and preflight), so that the
        wait never overruns its bound by an attempt. Each pause is drawn at random (2 to 8 s), so that releases
        refused by each other at once do not ask again at once."""
        import random

        outcome = self.outcomes.get(target.name)
        if target.name in self.refused:  # the retry guard's: no wait ends it
            return None
        if wait_until is None or code != Exit.REFUSED or outcome is None \
                or outcome.refused_for not in frozenset(RefusedFor):
            return None
        pause = random.uniform(2.0, 8.0)
        return pause if time.monotonic() + pause + attempt_s < wait_until else None

    def _switch(self, target: NodeTarget, mode: Mode, echo) -> int:
        from .bundle import bundle

        switch_id = uuid.uuid4().hex[:16]
        self.switch_ids[target.name] = switch_id
        try:
            payload = bundle(self.root, target, ship=not target.local) if mode == Mode.RELEASE else {}
            payload["progress_every_s"] = progress_cadence(self.settings.transport.silence_s)
            payload["plan"] = PlanForm.FULL if self.verbose or self.dry_run else PlanForm.COMPACT
            if self._guard is not None and mode == Mode.RELEASE:
                payload["confirm"] = True  # the retry guard's verdict is read beside it: asked before any change
            session = self.start(target, commands.switch(
                # An undo is part of the rollout it undoes: its switches carry that rollout's id, so that a
                # `rollback --all` run again goes on undoing it, never undoes the undo.
                target.spec, switch_id, rollout=self.undo if mode == Mode.UNDO_ROLLOUT and self.undo else self.id,
                force=self.force, dry_run=self.dry_run,
                rollback=mode == Mode.ROLLBACK, undo_rollout=self.undo if mode == Mode.UNDO_ROLLOUT else None,
                auto_rollback=self.auto_rollback and (mode != Mode.RELEASE
                                                      or target.loaded.profile.release.auto_rollback)))
        except TransportError as err:
            echo(f"flatshare: {err}")
            return err.exit_code
        self.switching.add(target.name)
        outcome = None
        try:
            session.send((json.dumps(payload) + "\n").encode())
            for line in session.lines(self.settings.transport.silence_s):
                if not protocol.is_protocol(line):
                    echo(line)
                    continue
                message = protocol.parse(line)
                if isinstance(message, protocol.AdmitRequest):
                    self.asking[target.name] = message.drains
                    reason = self.guard_refusal(target, message.history) if mode == Mode.RELEASE else None
                    if reason is None and message.drains:
                        reason = self.admission(target, message.node_id, message.load)
                    session.send(protocol.answer_line(protocol.AdmitAnswer(reason is None, reason)).encode())
                    self.asking.pop(target.name, None)
                elif isinstance(message, protocol.Outcome):
                    outcome = message
                    self.outcomes[target.name] = message
                elif isinstance(message, protocol.Progress):
                    self.progress[target.name] = message
                    if message.waiting_for and not self.quiet:
                        self.out.status(f"[{target.name} {self.elapsed()}]   {protocol.waiting_words(message)}")
            status = session.exit_status(10.0)
        except (Silence, Lost) as err:
            echo(f"flatshare: {err}")
            session.close()  # before following up: a node waiting for our answer then sees us gone
            self.drop(target)
            return self.follow_up(target, switch_id)
        finally:
            session.close()
        if outcome is None and status in (126, 127):
            # The shell could not run the node's entry point (not installed, not executable): nothing ran there.
            echo(f"flatshare: {target.spec.program[0]} could not be run on {target.name} (exit {status}); nothing "
                 f"was changed there. Install flatshare-ops on it: 'flatshare node bootstrap --node {target.name}'")
            return Exit.REFUSED
        if status is None or outcome is None:
            echo("flatshare: the node-side command ended without its outcome (killed, or the connection closed); "
                 "asking the node what became of the switch")
            self.drop(target)
            return self.follow_up(target, switch_id)
        return operator_code(status, outcome.result)

    def admission(self, target: NodeTarget, node_id: str | None = None, load: dict | None = None) -> str | None:
        """May ``target`` drain now? None to admit, else why not.

        Asked by the node while it holds its own release lock: each other node is probed
        (does it take calls, does a release hold it); an unreachable node counts as not
        serving. ``target`` may drain while at least ``min_serving`` others take calls and
        are not being released. One node is counted once, whatever names reach it: two
        answers are the same node when their SSH host keys or their node ids (the
        machine and state directory each node reports, node/probe.py ``node_identity``;
        ``node_id`` is the draining node's own) agree. Then the room: the nodes counted must carry their own
        load, ``load`` (the draining node's, from its request) and the load of each other node being released
        that takes calls now (it may drain meanwhile) within ``[release.admission]`` (:func:`headroom`).
        """
        serving = []
        loads: dict[str, object] = {}
        moving: dict[str, object] = {}
        draining = f"{target.name}, the node that would drain"
        nodes_by_key = {key: draining for key in [("SSH host key", self._identity(target)),
                                                  ("node id", node_id)] if key[1]}
        for other in self.everyone:
            if other.name == target.name:
                continue
            try:
                argv = commands.probe(other.spec)
            except FlatshareError as err:  # its profile does not load: how to ask it is not known
                self.out.line(f"{other.name}: UNKNOWN: it cannot be asked ({err})")
                continue
            try:
                result = self.run_command(other, argv)
                answer = answer_of(result)
            except TransportError as err:
                self.drop(other)
                self.out.line(f"{other.name}: UNKNOWN: {err}")
                continue
            except ValueError as err:
                self.out.line(f"{other.name}: UNKNOWN: its probe did not answer JSON "
                              f"({not_an_answer(result.status, result.output + result.errors, err)})")
                continue
            answer = answer if isinstance(answer, dict) else {}
            reported = answer.get("node_id")
            keys = [k for k in [("SSH host key", self._identity(other)),
                                ("node id", reported if isinstance(reported, str) else None)] if k[1]]
            same = next((k for k in keys if k in nodes_by_key), None)
            if same is not None:
                self.out.line(f"{other.name}: the same node as {nodes_by_key[same]} (the same {same[0]}): not "
                              "counted again")
                continue
            nodes_by_key.update({k: other.name for k in keys})
            gateway = answer.get("gateway")
            if isinstance(gateway, str) and not other.names_itself(gateway):
                self.out.line(f"{other.name}: its probe read the gateway at {gateway}, which does not name "
                              f"{other.node.host}: what its callers meet is not known, not counted")
                continue
            counts, line = admission_line(other.name, target.name, answer)
            self.out.line(f"admission for {target.name}: {line}")
            if counts:
                serving.append(other.name)
                loads[other.name] = answer.get("load")
            elif answer.get("locked") is True and answer.get("takes_calls") is True:
                moving[other.name] = answer.get("load")  # being released: it may drain while target does
        need = self.settings.serving_floor
        if len(serving) >= need:
            if need == 0:
                return None
            loaded = getattr(target, "loaded", None)
            settings = loaded.profile.release.admission if loaded is not None else Admission()
            lines, refusal = headroom(target.name, load, loads, settings, moving)
            for line in lines:
                self.out.line(f"admission for {target.name}: {line}")
            return refusal
        return (f"{len(serving)} other node(s) take calls and are not being released "
                f"({', '.join(serving) or 'none'}); min_serving {need} must while {target.name} drains, "
                "so that a node always takes calls")

    def _identity(self, target: NodeTarget) -> str | None:
        """The node's identity over its kept connection (:attr:`Connection.identity`), None when unknown."""
        with self._lock:
            conn = self._connections.get(target.name)
        return getattr(conn, "identity", None)

    def follow_up(self, target: NodeTarget, switch_id: str) -> int:
        """After a lost or stalled connection: reconnect (bounded) and report what the node says of the switch.

        Asked within ``reconnect_s``; a node that holds its lock but has no journal yet (its refusals,
        preflight or admission: nothing changed so far) is asked on, until past the node's own bound for an
        admission answer (:data:`protocol.ADMISSION_WAIT_S`), so that a node refusing for want of the answer a
        lost session never gave is reported as refused (exit 3), never as still switching."""
        bound = self.settings.transport.reconnect_s
        deciding_until = time.monotonic() + protocol.ADMISSION_WAIT_S + 10.0
        seen: dict = {"answer": None, "error": None}

        def settled() -> bool:
            try:
                result = self.run_command(target, commands.status(target.spec, switch_id))
            except TransportError as err:
                seen["error"] = err
                self.drop(target)
                return False
            try:
                answer = answer_of(result)
            except ValueError as err:
                seen["error"] = ("its status answer is not JSON: "
                                 f"{not_an_answer(result.status, result.output + result.errors, err)}")
                return False
            if not isinstance(answer, dict):
                seen["error"] = f"its status answer is not an object: {clip(result.output.strip(), 200)}"
                return False
            seen["answer"] = answer
            return answer.get("state") != SwitchState.SWITCHING

        poll_until(settled, bound, 1.0)
        answer = seen["answer"]
        if isinstance(answer, dict) and answer.get("state") == SwitchState.SWITCHING and not answer.get("journal") \
                and time.monotonic() < deciding_until:
            self.out.line(f"{target.name}: the node holds its lock before any journal (deciding whether it may "
                          f"switch): asking on, up to {deciding_until - time.monotonic():.0f} s more")
            poll_until(settled, deciding_until - time.monotonic(), 1.0)
        answer, last_error = seen["answer"], seen["error"]
        if answer is None:
            self.out.line(f"{target.name}: could not ask the node what became of switch {switch_id} within "
                          f"{bound:g} s (the reconnect bound): {last_error}. Its outcome is unknown: run "
                          f"{self.command(f'status --node {target.name}')}")
            return Exit.UNREACHABLE
        return self._report(target, switch_id, answer, bound)

    def _report(self, target: NodeTarget, switch_id: str, answer: dict, bound: float) -> int:
        code, line = follow_up_report(target.name, switch_id, answer, bound)
        self.followed_answers[target.name] = answer
        self.out.line(line)
        self.followed_up[target.name] = line.removeprefix(f"{target.name}: ")
        return code


def plan_batches(chosen: list, canaries: int, batch_size: int) -> list[list]:
    """The rollout's batches, in order: the first ``canaries`` nodes alone (when there are any and nodes remain
    after them), then batches of ``batch_size``.

    >>> plan_batches(list("abcd"), 1, 2), plan_batches(list("ab"), 1, 1), plan_batches(list("abc"), 0, 2)
    ([['a'], ['b', 'c'], ['d']], [['a'], ['b']], [['a', 'b'], ['c']])
    """
    head, rest = (chosen[:canaries], chosen[canaries:]) if 0 < canaries < len(chosen) else ([], chosen)
    return ([head] if head else []) + [rest[i:i + batch_size] for i in range(0, len(rest), batch_size)]


def progress_cadence(silence_s: float) -> float:
    """How often the node should report progress in a wait (seconds), for a silence bound of ``silence_s``.

    A third of the bound (so two reports can be lost to scheduling before it fires), at most the
    node's default of 10 s, at least 0.2 s.

    >>> progress_cadence(30.0), progress_cadence(5.0), progress_cadence(0.3), progress_cadence(600.0)
    (10.0, 1.6667, 0.2, 10.0)
    """
    return round(min(PROGRESS_EVERY_S, max(0.2, silence_s / 3)), 4)


def last_rollout(histories: dict[str, list[dict]], pending: dict[str, str | None]) -> str | None:
    """The rollout of the newest switch across the fleet (an interrupted switch counts as newest on its node).

    Args:
        histories: node -> its history records (oldest first).
        pending: node -> the rollout of its interrupted switch, if any.
    """
    newest, when = None, -1.0
    for node, records in histories.items():
        if pending.get(node):
            return pending[node]
        for record in records:
            if record.get("kind") == RecordKind.ANALYSIS:
                continue  # an analysis is no switch: a later rollout that only re-analysed undoes nothing
            started = record.get("started_at") or 0
            if record.get("rollout") and isinstance(started, (int, float)) and started >= when:
                newest, when = record["rollout"], started
    return newest


def refuse_drift(root: Path) -> None:
    """Refuse a release from a checkout whose rendered files drifted from its profile.

    Raises:
        Refused: the rendered files differ (the message names them and says how to fix it).
    """
    from ..render.checkout import drift, expected_outputs, misplaced

    diffs = drift(root, expected_outputs(root))
    if diffs:
        first = "; ".join(misplaced(root, diffs))
        raise Refused(
            f"release refused: the checkout's rendered files drifted from the profile ({', '.join(map(str, diffs))}); "
            + (f"{first}; then " if first else "")
            + "run 'make profiles' to see the diff and 'make profiles UPDATE=1' to rewrite them, then commit"
        )


def refuse_placeholder_pins(chosen: list[NodeTarget]) -> None:
    """Refuse, before connecting to any node, a release of a profile whose module pin is the placeholder.

    Raises:
        Refused: one line per such node's profile, saying how to pin.
    """
    from ..render.checkout import PLACEHOLDER_PIN

    placeholders = [t for t in chosen if t.loaded.profile.module.sha256 == PLACEHOLDER_PIN]
    if placeholders:
        names = ", ".join(f"{t.name} ({t.profile_path})" for t in placeholders)
        raise Refused(
            f"release refused: the module pin is a placeholder (zeros) in the profile of {names}; pin the built "
            "module first: 'flatshare profiles pin-module --sha256 HEX' (the hash a make-room revision publishes), "
            "'--file PATH', or '--from-node NAME' (the module a node built), then commit and release")


def refuse_foreign_gateways(chosen: list[NodeTarget]) -> None:
    """Refuse, before connecting to any node, a release of a profile whose ``gateway.url`` names another host:
    the admission asks a node's gateway for what its callers meet, so it must be that node's own
    (:meth:`NodeTarget.names_itself`).

    Raises:
        Refused: one line naming each such node, its URL and the hosts that would do.
    """
    foreign = [t for t in chosen if not t.names_itself(str(t.loaded.profile.gateway.url))]
    if foreign:
        names = "; ".join(f"{t.name}'s gateway.url {t.loaded.profile.gateway.url} ({t.profile_path}) does not name "
                          f"{t.node.host}" for t in foreign)
        raise Refused(f"release refused: {names}: a node's gateway URL names the node itself (its inventory host or "
                      "its address; loopback only when the inventory reaches the node at another address), since the "
                      "admission to drain asks it what callers meet there")


def warn_uncommitted(root: Path, out: ReleaseOutput) -> None:
    """Say so when the checkout has uncommitted changes (the commit is then recorded as ...-dirty)."""
    from .git import describe

    described = describe(root)
    if described and described.endswith("-dirty"):
        out.line(f"note: the checkout has uncommitted changes; the release is recorded as made from {described}")


def terminal(stream=None) -> ReleaseOutput:
    """The operator's terminal (``stream``, default stdout; stderr when stdout carries a ``--json`` document), as
    a line sink that survives its loss."""
    out = ReleaseOutput(None, stream if stream is not None else sys.stdout)
    out.watch_hangup()
    return out
