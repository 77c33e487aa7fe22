"""A node switch, carried out on the node: lock, refusals, journaled steps, history.

This is the only module that changes a node during a release. It runs on the
node itself (``flatshare node switch``, started locally or over SSH by
:mod:`.rollout`) so that a dropped SSH session cannot stop it halfway: its
output goes to ``releases/release.log`` whatever happens to the terminal
(:mod:`.output`), and every step is journaled (:mod:`.journal`) so a killed
run is finished by the next one.
"""

from __future__ import annotations

import getpass
import json
import os
import re
import signal
import socket
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from filelock import FileLock, Timeout

from . import drain, journal as journals
from .atomic import write_atomic
from .check import CRITICAL, UNKNOWN, installed_vllm, read_json_object, run_checks, wait_healthy
from .errors import FlatshareError
from .node_files import HISTORY, LOCK, LOCK_HOLDER, LOG
from .output import ReleaseOutput
from .plan import STEPS, Plan, ReleaseView, describe, plan, voice_restarts
from .release_store import current_release, releases_dir, store_release, switch_current
from .render.units import ENGINE_UNIT, GATEWAY_UNIT, TARGET_UNIT, VOICE_UNIT
from .systemd import ManagerAddress, connect, daemon_reload, run_job, unit_property

# Exit codes of `flatshare release` (and of `flatshare node switch`).
RELEASED = 0
FAILED = 1  # failed mid-switch; the journal is kept
BAD_INPUT = 2
REFUSED = 3  # lock held, E2 drop-ins, drift, missing vLLM release
NOTHING_TO_DO = 4

#: How many releases a node keeps (besides the active one) for rollback.
KEEP_RELEASES = 5

#: Test hook (fault injection): SIGKILL the release right after this step is journaled done.
KILL_AFTER_ENV = "FLATSHARE_RELEASE_KILL_AFTER"


class Refused(FlatshareError):
    """The release will not start: the lock is held, E2 drop-ins are linked, or the vLLM release is missing."""

    exit_code = REFUSED


class SwitchFailed(FlatshareError):
    """A step failed; the journal is kept and the next release finishes the switch."""

    exit_code = FAILED


@dataclass(frozen=True)
class NodeContext:
    """Where the node keeps things and how to reach its systemd manager.

    Attributes:
        node: the node's name.
        state_dir: ``/var/lib/flatshare`` (the releases directory is under it).
        address: the node's systemd manager.
    """

    node: str
    state_dir: Path
    address: ManagerAddress

    @property
    def releases(self) -> Path:
        """``STATE_DIR/releases``."""
        return releases_dir(self.state_dir)


# --- releases on disk ------------------------------------------------------------


def load_view(ctx: NodeContext, rid: str) -> tuple[ReleaseView, dict]:
    """A stored release as the planner sees it, and its serving.json.

    Raises:
        FlatshareError: the release directory is missing or its files are unreadable.
    """
    directory = ctx.releases / rid
    if not directory.is_dir():
        raise FlatshareError(f"{directory}: release {rid} is not stored on {ctx.node}")
    try:
        serving = json.loads((directory / "serving.json").read_bytes())
        units = {p.name: p.read_text() for p in sorted((directory / "units").iterdir())}
        return ReleaseView(rid, units, serving["engine"]["argv"]), serving
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise FlatshareError(f"{directory}: release {rid} is damaged on {ctx.node} ({type(err).__name__}: {err})") from None


def _old_view(ctx: NodeContext, rid: str | None, out: ReleaseOutput) -> ReleaseView | None:
    """The release being replaced, for the plan; a damaged one only costs the plan its comparison."""
    if not rid:
        return None
    try:
        return load_view(ctx, rid)[0]
    except FlatshareError as err:
        out.line(f"note: {err}; planning as if the node had no release")
        return None


def read_history(ctx: NodeContext) -> list[dict]:
    """Every history record, oldest first (a torn last line, from a crash mid-append, is skipped)."""
    try:
        lines = (ctx.releases / HISTORY).read_text().splitlines()
    except FileNotFoundError:
        return []
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def _append_history(ctx: NodeContext, record: dict) -> None:
    with open(ctx.releases / HISTORY, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def previous_release(ctx: NodeContext) -> str | None:
    """The release a rollback returns to: the one the active release replaced, if still stored."""
    current = current_release(ctx.state_dir)
    for record in reversed(read_history(ctx)):
        if record.get("result") == "released" and record.get("to") == current and record.get("from"):
            if (ctx.releases / record["from"]).is_dir():
                return record["from"]
    return None


def _prune(ctx: NodeContext, keep: int = KEEP_RELEASES) -> list[str]:
    import shutil

    current = current_release(ctx.state_dir)
    released = [r for r in reversed(read_history(ctx)) if r.get("result") == "released"][:keep]
    # The active release, and both ends of the last few switches (a rollback needs the "from").
    keep_ids = {current, *(r.get("to") for r in released), *(r.get("from") for r in released)}
    removed = []
    for directory in sorted(ctx.releases.iterdir()):
        if directory.is_dir() and not directory.is_symlink() and not directory.name.startswith(".") \
                and directory.name not in keep_ids:
            shutil.rmtree(directory)
            removed.append(directory.name)
    return removed


# --- the lock --------------------------------------------------------------------


@contextmanager
def node_lock(ctx: NodeContext, release: str) -> Iterator[None]:
    """Hold the node's release lock, with the holder's details beside it.

    The lock is an fcntl lock (filelock), released by the kernel when its
    holder dies, so a dead holder never blocks; its ``lock.json`` is then stale
    and simply overwritten.

    Raises:
        Refused: another live release holds it (the message gives its details).
    """
    ctx.releases.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(ctx.releases / LOCK))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        try:
            h = read_json_object(ctx.releases / LOCK_HOLDER) or {}
        except ValueError:
            h = {}
        since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(h.get("started_at", 0)))
        raise Refused(
            f"release refused: {ctx.node} is being released by {h.get('user')}@{h.get('host')} pid {h.get('pid')} "
            f"(release {h.get('release')}, since {since}); wait for it to finish"
        ) from None
    holder = {"host": socket.gethostname(), "pid": os.getpid(), "user": getpass.getuser(),
              "release": release, "started_at": time.time()}
    try:
        write_atomic(ctx.releases / LOCK_HOLDER, (json.dumps(holder) + "\n").encode())
        yield
    finally:
        (ctx.releases / LOCK_HOLDER).unlink(missing_ok=True)
        lock.release()


# --- refusals ----------------------------------------------------------------------


def e2_drop_ins(ctx: NodeContext, services: list[str], unit_dir: Path) -> list[str]:
    """E2 benchmark drop-ins linked into the managed services: ``UNIT.d/NAME.conf -> TARGET`` lines.

    A benchmark point is applied by symlinking drop-ins into ``<unit>.d/`` (FACTS.md);
    systemd lists them in each unit's ``DropInPaths`` once reloaded, and the
    unit directory is read too, for links made since.
    """
    paths: set[str] = set()
    with connect(ctx.address) as bus:
        for name in services:
            paths.update(p.decode() for p in unit_property(bus, name, "Unit", "DropInPaths"))
    # Linked since the last daemon-reload: systemd does not list them yet, the release's reload would apply them.
    for name in services:
        paths.update(str(p) for p in (unit_dir / f"{name}.d").glob("*.conf"))
    return [f"{Path(p).parent.name}/{Path(p).name} -> {os.readlink(p)}" for p in sorted(paths) if os.path.islink(p)]


def refusals(ctx: NodeContext, serving: dict, force: bool, out: ReleaseOutput) -> bool:
    """Refuse (raise) unless the node can take the release; returns whether E2 drop-ins were forced past."""
    links = e2_drop_ins(ctx, serving["services"], Path(serving["layout"]["unit_dir"]))
    if links and not force:
        raise Refused(
            f"release refused: {ctx.node} has E2 drop-ins linked: {'; '.join(links)}; "
            "run 'flatshare-bench e2 reset' or pass --force"
        )
    if links:
        out.line(f"--force: releasing with E2 drop-ins linked: {'; '.join(links)}")
    installed = installed_vllm(Path(serving["engine"]["venv"]))
    if installed != serving["vllm_release"]:
        raise Refused(
            f"release refused: {ctx.node}'s engine venv {serving['engine']['venv']} has vLLM "
            f"{installed or 'not installed'}, the release needs {serving['vllm_release']}; install it first"
        )
    return bool(links)


# --- the steps ---------------------------------------------------------------------


class _Switch:
    """One switch in progress: the plan, the new release's serving.json, and the open drain."""

    def __init__(self, ctx: NodeContext, p: Plan, serving: dict, new: ReleaseView, out: ReleaseOutput):
        self.ctx, self.plan, self.serving, self.new, self.out = ctx, p, serving, new, out
        self.drain: drain.VoiceDrain | None = None

    def _job(self, verb: str, unit: str, timeout_s: float) -> None:
        self.out.line(f"  {verb} {unit}: waiting for systemd's job (up to {timeout_s:g} s)")
        with connect(self.ctx.address) as bus:
            run_job(bus, verb, unit, timeout_s)

    def drain_voice(self) -> None:
        voice = self.serving["voice"]
        self.drain = drain.begin(Path(voice["drain_file"]), Path(voice["status_file"]))
        self.out.line(f"  drain {self.drain.drain_id}: waiting for the voice worker (up to {voice['drain_timeout_s']:g} s)")
        status = drain.wait_drained(self.drain, voice["drain_timeout_s"], progress=lambda l: self.out.line(f"  {l}"))
        self.out.line(f"  voice worker drained (status written {time.time() - status['written_at']:.1f} s ago)")

    def stop_gateway(self) -> None:
        self._job("stop", GATEWAY_UNIT, self.serving["gateway"]["drain_timeout_s"] + 30)

    def install_units(self) -> None:
        unit_dir = Path(self.serving["layout"]["unit_dir"])
        unit_dir.mkdir(parents=True, exist_ok=True)
        for name, text in self.new.units.items():
            path = unit_dir / name
            if not path.exists() or path.read_text() != text:
                write_atomic(path, text.encode())
                self.out.line(f"  installed {path}")
        for name, action in self.plan.units.items():
            if action == "remove":
                (unit_dir / name).unlink(missing_ok=True)
                self.out.line(f"  removed {unit_dir / name}")
        with connect(self.ctx.address) as bus:
            daemon_reload(bus)  # always: mtimes can hide a change (FACTS.md)
        self.out.line("  daemon-reload done")

    def restart_engine(self) -> None:
        timeout_s = float(self.serving["engine"]["start_timeout_s"])
        started = time.monotonic()
        with connect(self.ctx.address) as bus:
            before = unit_property(bus, ENGINE_UNIT, "Unit", "InvocationID")
        self._job("restart", ENGINE_UNIT, timeout_s)
        with connect(self.ctx.address) as bus:
            after = unit_property(bus, ENGINE_UNIT, "Unit", "InvocationID")
        if after == before:
            raise FlatshareError(f"{ENGINE_UNIT}: InvocationID did not change; the engine was not restarted")
        url = self.serving["engine"]["url"] + "/health"
        remaining = max(1.0, timeout_s - (time.monotonic() - started))
        self.out.line(f"  waiting for {url} to answer 200 (up to {remaining:.0f} s)")
        wait_healthy(url, remaining)
        self.out.line(f"  engine ready in {time.monotonic() - started:.1f} s")

    def start_gateway(self) -> None:
        self._job("start", GATEWAY_UNIT, 60)

    def end_voice_drain(self) -> None:
        if voice_restarts(self.plan):
            self._job("restart", VOICE_UNIT, 60)
        for name, action in self.plan.units.items():
            if name.endswith(".timer") and action in ("restart", "start"):
                self._job("restart", name, 30)
        self._job("start", TARGET_UNIT, 60)
        voice = self.serving["voice"]
        since = time.time()
        drain.end(Path(voice["drain_file"]))
        self.drain = None
        drain.wait_serving(Path(voice["drain_file"]), Path(voice["status_file"]), since, 30)
        self.out.line("  voice worker takes calls again")

    def switch_current(self) -> None:
        switch_current(self.ctx.state_dir, self.new.id)
        self.out.line(f"  releases/current -> {self.new.id}")

    def serving_check(self) -> None:
        report = run_checks(self.ctx.state_dir, self.ctx.node, self.ctx.address.runtime_dir, inside_release=True)
        for finding in report.findings:
            if finding.status != "OK":
                self.out.line(f"  {finding.status} {finding.check}: {finding.summary}")
                for detail in finding.details:
                    self.out.line(f"      {detail}")
        if report.status in (CRITICAL, UNKNOWN):
            raise FlatshareError(f"serving-check is {report.status} after the switch")
        self.out.line(f"  serving-check {report.status}")

    def abort_drain(self) -> None:
        """The switch stopped early: end the voice drain so the worker takes calls again."""
        voice = self.serving["voice"]
        if self.drain is not None or Path(voice["drain_file"]).exists():
            drain.end(Path(voice["drain_file"]))
            self.out.line("  voice drain ended early: the worker takes calls again")
            self.drain = None


# --- running a switch ------------------------------------------------------------------


def _run_switch(ctx: NodeContext, to_id: str, from_id: str | None, out: ReleaseOutput, forced: bool,
                journal: journals.Journal | None, kind: str = "release") -> None:
    new, serving = load_view(ctx, to_id)
    old = _old_view(ctx, from_id, out)
    resume = journal is not None
    p = plan(ctx.node, old, new, resume=resume)
    if journal is None:
        journal = journals.Journal(
            **{"from": from_id}, to=to_id, node=ctx.node, host=socket.gethostname(), pid=os.getpid(),
            user=getpass.getuser(), started_at=time.time(), forced=forced,
            steps=[journals.StepRecord(name=s) for s in STEPS], kind=kind,
        )
    else:
        # Finish it by running every step again: each is idempotent, and the
        # engine, gateway and voice worker are all restarted.
        journal = journal.model_copy(update={"resumed": journal.resumed + 1, "pid": os.getpid(),
                                             "steps": [journals.StepRecord(name=s) for s in STEPS]})
    journals.write_journal(ctx.state_dir, journal)
    for line in describe(p)[2 + len(p.steps):]:
        out.line(line)

    switch = _Switch(ctx, p, serving, new, out)
    started = time.time()
    kill_after = os.environ.get(KILL_AFTER_ENV)
    for number, step in enumerate(p.steps, 1):
        out.line(f"step {number}/{len(p.steps)} {step}")
        journals.mark(ctx.state_dir, journal, step, "running")
        try:
            if step == "record-history":
                _record(ctx, journal, "released", started)
            else:
                getattr(switch, step.replace("-", "_"))()
        except (Exception, KeyboardInterrupt) as err:
            reason = "interrupted" if isinstance(err, KeyboardInterrupt) else str(err)
            journals.mark(ctx.state_dir, journal, step, "failed", reason)
            switch.abort_drain()
            _append_history(ctx, _history_record(ctx, journal, f"failed at {step}: {reason}", started))
            back = f"; 'flatshare rollback' abandons it and returns to {journal.from_}" if journal.from_ else ""
            raise SwitchFailed(
                f"{ctx.node}: step {number}/{len(p.steps)} {step} failed: {reason}. The journal "
                f"({journals.journal_path(ctx.state_dir)}) is kept: the next 'flatshare release' finishes "
                f"the switch to {to_id}, restarting every managed unit{back}"
            ) from None
        if step != "record-history":
            journals.mark(ctx.state_dir, journal, step, "done")
        if kill_after == step:
            os.kill(os.getpid(), signal.SIGKILL)
    for removed in _prune(ctx):
        out.line(f"removed old release {removed}")


def _history_record(ctx: NodeContext, journal: journals.Journal, result: str, started: float) -> dict:
    return {"schema": 1, "node": ctx.node, "from": journal.from_, "to": journal.to, "result": result,
            "user": journal.user, "host": journal.host, "started_at": journal.started_at,
            "finished_at": time.time(), "duration_s": round(time.time() - started, 3),
            "forced": journal.forced, "resumed": journal.resumed, "kind": journal.kind}


def _record(ctx: NodeContext, journal: journals.Journal, result: str, started: float) -> None:
    _append_history(ctx, _history_record(ctx, journal, result, started))
    journals.remove_journal(ctx.state_dir)


_RELEASE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_RELEASE_FILE = re.compile(r"^(serving\.json|profile\.json|units/[A-Za-z0-9@._-]+\.(service|target|timer))$")


def validate_bundle(bundle: object) -> dict:
    """Check a release bundle read from stdin before any of it touches the disk.

    Raises:
        FlatshareError (exit 2): not ``{"id": ID, "files": {NAME: TEXT}}``, an id
            that is not a plain directory name, or a file name outside
            ``serving.json``, ``profile.json``, ``units/UNIT``.
    """
    if not isinstance(bundle, dict) or not isinstance(bundle.get("id"), str) or not isinstance(bundle.get("files"), dict):
        raise FlatshareError('node switch: the release bundle must be {"id": ..., "files": {...}}')
    if not _RELEASE_ID.match(bundle["id"]):
        raise FlatshareError(f"node switch: release id {bundle['id']!r} is not a plain name ([A-Za-z0-9._-])")
    for name, text in bundle["files"].items():
        if not isinstance(name, str) or not _RELEASE_FILE.match(name) or not isinstance(text, str):
            raise FlatshareError(f"node switch: release file {name!r} is not serving.json, profile.json or units/UNIT")
    if "serving.json" not in bundle["files"]:
        raise FlatshareError("node switch: the release bundle has no serving.json")
    return bundle


def switch_node(ctx: NodeContext, bundle: dict | None, out: ReleaseOutput, force: bool = False,
                dry_run: bool = False, rollback: bool = False) -> int:
    """Switch this node to a release; finish an interrupted switch first.

    Args:
        ctx: the node.
        bundle: ``{"id": ..., "files": {relative name: text}}``, the release to switch to
            (None with ``rollback``).
        out: where progress lines go (terminal and release.log).
        force: release even with E2 drop-ins linked (recorded in the history).
        dry_run: print the plan (and any refusal); change nothing.
        rollback: switch back: to the release an interrupted switch started from
            (abandoning it), else to the release the active one replaced.

    Returns:
        :data:`RELEASED` or :data:`NOTHING_TO_DO`.

    Raises:
        Refused, SwitchFailed, journal.JournalError, FlatshareError.
    """
    ctx.releases.mkdir(parents=True, exist_ok=True)
    if bundle is not None:
        validate_bundle(bundle)
    if dry_run:
        return _dry_run(ctx, bundle, rollback, force, out)
    with node_lock(ctx, bundle["id"] if bundle else "rollback"):
        pending = journals.read_journal(ctx.state_dir)
        if rollback:
            return _rollback(ctx, pending, out)
        target = bundle["id"]
        if pending is not None:
            _finish(ctx, pending, bundle, out)
            if pending.to == target:
                return RELEASED
        current = current_release(ctx.state_dir)
        if current == target:
            problems = _unhealthy(ctx)
            if not problems:
                out.line(f"{ctx.node}: already on {target}; nothing to do")
                return RELEASED if pending is not None else NOTHING_TO_DO
            out.line(f"{ctx.node}: already on {target}, but serving-check fails ({'; '.join(problems)}): "
                     "switching again to repair it")
        serving = json.loads(bundle["files"]["serving.json"])
        forced = refusals(ctx, serving, force, out)
        store_release(ctx.state_dir, target, bundle["files"])
        out.line(f"{ctx.node}: switching {current or '(no release)'} -> {target}")
        _run_switch(ctx, target, current, out, forced, None, kind="repair" if current == target else "release")
        out.line(f"{ctx.node}: released {target}")
        return RELEASED


def _finish(ctx: NodeContext, pending: journals.Journal, bundle: dict | None, out: ReleaseOutput) -> None:
    """Finish an interrupted switch (its target re-stored from the bundle if it is the same release)."""
    out.line(f"finishing an interrupted {journals.journal_summary(pending)}")
    if not (ctx.releases / pending.to).is_dir():
        if bundle is not None and bundle["id"] == pending.to:
            store_release(ctx.state_dir, pending.to, bundle["files"])
        else:
            raise SwitchFailed(
                f"{ctx.node}: the interrupted switch's release {pending.to} is no longer stored; "
                f"run 'flatshare rollback' to abandon it and return to {pending.from_}"
            )
    _run_switch(ctx, pending.to, pending.from_, out, pending.forced, pending, kind=pending.kind)
    out.line(f"{ctx.node}: switch to {pending.to} finished")


def _rollback(ctx: NodeContext, pending: journals.Journal | None, out: ReleaseOutput) -> int:
    """Switch back. An interrupted switch is abandoned: back to the release it started from."""
    if pending is not None:
        if not pending.from_ or not (ctx.releases / pending.from_).is_dir():
            raise Refused(f"rollback refused: the interrupted {journals.journal_summary(pending)} started from "
                          "no stored release; run 'flatshare release' to finish it")
        out.line(f"abandoning the interrupted {journals.journal_summary(pending)}")
        target, current = pending.from_, pending.to
        journals.remove_journal(ctx.state_dir)
        _append_history(ctx, _history_record(ctx, pending, "abandoned by rollback", time.time()))
    else:
        target, current = previous_release(ctx), current_release(ctx.state_dir)
        if target is None:
            raise Refused(f"rollback refused: {ctx.node} has no earlier release stored to return to")
    refusals(ctx, load_view(ctx, target)[1], False, out)
    out.line(f"{ctx.node}: rolling back {current or '(no release)'} -> {target}")
    _run_switch(ctx, target, current, out, False, None, kind="rollback")
    out.line(f"{ctx.node}: rolled back to {target}")
    return RELEASED


def _unhealthy(ctx: NodeContext) -> list[str]:
    """serving-check's CRITICAL and UNKNOWN findings for the active release (empty when it serves)."""
    report = run_checks(ctx.state_dir, ctx.node, ctx.address.runtime_dir, inside_release=True)
    return [f"{f.check}: {f.summary}" for f in report.findings if f.status in (CRITICAL, UNKNOWN)]


def _dry_run(ctx: NodeContext, bundle: dict | None, rollback: bool, force: bool, out: ReleaseOutput) -> int:
    pending = journals.read_journal(ctx.state_dir)
    current = current_release(ctx.state_dir)
    if rollback:
        target = pending.from_ if pending else previous_release(ctx)
        if target is None:
            raise Refused(f"rollback refused: {ctx.node} has no earlier release stored to return to")
        if pending:
            out.line(f"the interrupted {journals.journal_summary(pending)} would be abandoned")
            current = pending.to  # its units may already be installed: plan from there
        new, serving = load_view(ctx, target)
    else:
        target = bundle["id"]
        if pending is not None:
            out.line(f"an interrupted {journals.journal_summary(pending)} would be finished first")
        if current == target and pending is None and not _unhealthy(ctx):
            out.line(f"{ctx.node}: already on {target}; nothing to do")
            return NOTHING_TO_DO
        files = bundle["files"]
        units = {name.removeprefix("units/"): text for name, text in files.items() if name.startswith("units/")}
        serving = json.loads(files["serving.json"])
        new = ReleaseView(target, units, serving["engine"]["argv"])
    refusals(ctx, serving, force, out)  # a dry run shows a refusal as the release would meet it
    for line in describe(plan(ctx.node, _old_view(ctx, current, out), new)):
        out.line(line)
    out.line("dry run: nothing changed")
    return RELEASED


def node_status(ctx: NodeContext) -> dict:
    """The node's active release, any unfinished switch, and its units' states."""
    from .render.units import SERVICE_UNITS

    from .check import release_holder

    status: dict = {"node": ctx.node, "release": current_release(ctx.state_dir), "switching": None,
                    "in_progress": None, "units": {}}
    holder = release_holder(ctx.releases)
    if holder:
        status["in_progress"] = f"release {holder.get('release')} by {holder.get('user')}@{holder.get('host')} pid {holder.get('pid')}"
    try:
        pending = journals.read_journal(ctx.state_dir)
        status["switching"] = journals.journal_summary(pending) if pending else None
    except journals.JournalError as err:
        status["switching"] = str(err)
    with connect(ctx.address) as bus:
        for name in (TARGET_UNIT, *SERVICE_UNITS):
            status["units"][name] = unit_property(bus, name, "Unit", "ActiveState").decode()
    history = read_history(ctx)
    status["last"] = history[-1] if history else None
    return status


def log_path(ctx: NodeContext) -> Path:
    """``releases/release.log``."""
    return ctx.releases / LOG
