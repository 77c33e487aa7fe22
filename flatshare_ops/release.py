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
from .check import CRITICAL, UNKNOWN, installed_vllm, run_checks
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
    """A stored release as the planner sees it, and its serving.json."""
    directory = ctx.releases / rid
    try:
        serving = json.loads((directory / "serving.json").read_text())
    except FileNotFoundError:
        raise FlatshareError(f"{directory}: release {rid} is not stored on {ctx.node}") from None
    units = {p.name: p.read_text() for p in sorted((directory / "units").iterdir())}
    return ReleaseView(rid, units, serving["engine"]["argv"]), serving


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


def _holder(ctx: NodeContext) -> dict:
    try:
        return json.loads((ctx.releases / LOCK_HOLDER).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


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
        h = _holder(ctx)
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


def e2_drop_ins(ctx: NodeContext, services: list[str]) -> list[str]:
    """E2 benchmark drop-ins linked into the managed services: ``UNIT.d/NAME.conf -> TARGET`` lines.

    A benchmark point is applied by symlinking drop-ins into ``<unit>.d/`` (FACTS.md);
    systemd lists them in each unit's ``DropInPaths``.
    """
    found = []
    with connect(ctx.address) as bus:
        for name in services:
            for path in unit_property(bus, name, "Unit", "DropInPaths"):
                path = path.decode()
                if os.path.islink(path):
                    found.append(f"{Path(path).parent.name}/{Path(path).name} -> {os.readlink(path)}")
    return found


def refusals(ctx: NodeContext, serving: dict, force: bool, out: ReleaseOutput) -> bool:
    """Refuse (raise) unless the node can take the release; returns whether E2 drop-ins were forced past."""
    links = e2_drop_ins(ctx, serving["services"])
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
        _wait_health(url, remaining)
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


def _wait_health(url: str, timeout_s: float) -> None:
    from .check import http_get

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if http_get(url)[0] == 200:
            return
        time.sleep(0.2)
    raise FlatshareError(f"{url} did not answer 200 within {timeout_s:.0f} s")


# --- running a switch ------------------------------------------------------------------


def _run_switch(ctx: NodeContext, to_id: str, from_id: str | None, out: ReleaseOutput, forced: bool,
                journal: journals.Journal | None) -> None:
    new, serving = load_view(ctx, to_id)
    old = load_view(ctx, from_id)[0] if from_id and (ctx.releases / from_id).is_dir() else None
    resume = journal is not None
    p = plan(ctx.node, old, new, resume=resume)
    if journal is None:
        journal = journals.Journal(
            **{"from": from_id}, to=to_id, node=ctx.node, host=socket.gethostname(), pid=os.getpid(),
            user=getpass.getuser(), started_at=time.time(), forced=forced,
            steps=[journals.StepRecord(name=s) for s in STEPS],
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
            raise SwitchFailed(
                f"{ctx.node}: step {number}/{len(p.steps)} {step} failed: {reason}. The journal "
                f"({journals.journal_path(ctx.state_dir)}) is kept: the next 'flatshare release' finishes "
                f"the switch to {to_id}, restarting every managed unit"
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
            "forced": journal.forced, "resumed": journal.resumed}


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
            (None with ``rollback``: the release the active one replaced).
        out: where progress lines go (terminal and release.log).
        force: release even with E2 drop-ins linked (recorded in the history).
        dry_run: print the plan; change nothing.
        rollback: switch back to the previous release.

    Returns:
        :data:`RELEASED` or :data:`NOTHING_TO_DO`.

    Raises:
        Refused, SwitchFailed, journal.JournalError, FlatshareError.
    """
    ctx.releases.mkdir(parents=True, exist_ok=True)
    if rollback:
        target = previous_release(ctx)
        if target is None:
            raise Refused(f"rollback refused: {ctx.node} has no earlier release stored to return to")
    else:
        target = validate_bundle(bundle)["id"]

    if dry_run:
        return _dry_run(ctx, bundle, target, out)

    with node_lock(ctx, target):
        pending = journals.read_journal(ctx.state_dir)
        if pending is not None:
            out.line(f"finishing an interrupted {journals.journal_summary(pending)}")
            _run_switch(ctx, pending.to, pending.from_, out, pending.forced, pending)
            out.line(f"{ctx.node}: switch to {pending.to} finished")
            if pending.to == target:
                return RELEASED
        current = current_release(ctx.state_dir)
        if current == target:
            out.line(f"{ctx.node}: already on {target}; nothing to do")
            return RELEASED if pending is not None else NOTHING_TO_DO
        if bundle is not None:
            serving = json.loads(bundle["files"]["serving.json"])
        else:
            serving = load_view(ctx, target)[1]
        forced = refusals(ctx, serving, force, out)
        if bundle is not None:
            store_release(ctx.state_dir, target, bundle["files"])
        out.line(f"{ctx.node}: switching {current or '(no release)'} -> {target}")
        _run_switch(ctx, target, current, out, forced, None)
        out.line(f"{ctx.node}: released {target}")
        return RELEASED


def _dry_run(ctx: NodeContext, bundle: dict | None, target: str, out: ReleaseOutput) -> int:
    pending = journals.read_journal(ctx.state_dir)
    if pending is not None:
        out.line(f"an interrupted {journals.journal_summary(pending)} would be finished first")
    current = current_release(ctx.state_dir)
    if current == target and pending is None:
        out.line(f"{ctx.node}: already on {target}; nothing to do")
        return NOTHING_TO_DO
    if bundle is not None:
        files = bundle["files"]
        units = {name.removeprefix("units/"): text for name, text in files.items() if name.startswith("units/")}
        new = ReleaseView(target, units, json.loads(files["serving.json"])["engine"]["argv"])
    else:
        new = load_view(ctx, target)[0]
    old = load_view(ctx, current)[0] if current and (ctx.releases / current).is_dir() else None
    for line in describe(plan(ctx.node, old, new)):
        out.line(line)
    out.line("dry run: nothing changed")
    return RELEASED


def node_status(ctx: NodeContext) -> dict:
    """The node's active release, any unfinished switch, and its units' states."""
    from .render.units import SERVICE_UNITS

    status: dict = {"node": ctx.node, "release": current_release(ctx.state_dir), "switching": None, "units": {}}
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
