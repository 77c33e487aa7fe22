"""Damaged node files, every kind issue 22 names, each in every form the kind covers.

On a sandbox fleet of its own (loopback block 81, module-scoped), from a scratch
checkout whose hold value is set anew for each release that must be a real change. Where a case needs only
the node's switch, it drives ``flatshare-node switch`` itself (the bundle on stdin, made by
control/bundle.py; admission requests answered by the test as the operator's side would,
common/protocol.py); the operator's commands only where they are the subject (status and releases'
exit codes and lines, known_hosts).

The kinds:

1. a stored release is used only once verified by its id: the release that served, the rollback target
   and the active one, each edited (its drain file pointed at history.jsonl, its gateway at a dead port);
2. (tests/test_fleet_safety.py: a damaged active release never skips its admission; here: an edited one
   is never trusted to say the node takes no calls);
3. bounded parsing: 200,000 nested brackets and a 100 MB file at each JSON file the node reads;
4. NaN, Infinity and 1e400 in each numeric field, refused by every reader, and never written;
5. a FIFO, a socket, a device and a directory at each path the node opens: nothing blocks;
6. a kept switcher's zips truncated, edited, gone or of another interpreter: checked and made again;
7. history reordered, of schema 3, of another node; a journal of another node;
8. a read-only state directory (a read-only bind mount in a mount namespace of its own; an immutable
   directory), a BOM at the top of known_hosts, 1e400 as a time and -3 as a duration, status's exit codes.

The truth each test reads: the bytes on disk, the kernel (processes left in /proc, the lock table), systemd
over D-Bus (InvocationID, ActiveState), the exit code, and one line naming the file and the damage, with no
traceback. Every test leaves cyan settled (no journal, no drain file, no node process left, taking calls,
serving-check OK).
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import stat
import subprocess
import sys
import threading
import time
import uuid
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import BIN, loopback_pair, quick_stand_in, run_cli, scratch_sandbox

from flatshare_ops.check.run import run_checks
from flatshare_ops.common import protocol
from flatshare_ops.common.http import wait_for_200
from flatshare_ops.common.locks import held_by
from flatshare_ops.control.bundle import bundle as make_bundle
from flatshare_ops.control.targets import targets
from flatshare_ops.sandbox.fleet import ENGINE_PORT, GATEWAY_PORT, SandboxNode
from flatshare_ops.common.systemd import ManagerAddress, connect, run_job, unit_property

ADDRESSES = loopback_pair(81)
CYAN = "cyan"
ENGINE, GATEWAY, VOICE = "flatshare-engine.service", "flatshare-gateway.service", "flatshare-voice.service"
NODE_PROCESS = re.compile(r"flatshare-node|flatshare_ops\.node")
#: How long one node-side command may take before the test calls it hung (seconds).
BOUND_S = 90.0


# --- the node, and driving its side ------------------------------------------------------------------


@dataclass
class Run:
    """One node-side command as it ended: its exit code, the lines for people, the protocol's outcome, how
    many admission requests it sent, its stderr."""

    code: int
    lines: list[str]
    outcome: dict | None
    asked: int
    stderr: str

    @property
    def text(self) -> str:
        return "\n".join(self.lines) + "\n" + self.stderr


class Node:
    """This module's checkout and sandbox node cyan, and how the tests act on it."""

    def __init__(self, checkout: Path, base: Path, scratch: Path) -> None:
        self.checkout, self.base, self.scratch = checkout, base, scratch
        self.inventory = base / "fleet.toml"
        self.sandbox = SandboxNode(CYAN, ADDRESSES[CYAN], base)
        self._hold = 2000

    # where things are

    @property
    def state_dir(self) -> Path:
        return self.sandbox.state_dir

    @property
    def releases(self) -> Path:
        return self.state_dir / "releases"

    @property
    def history(self) -> Path:
        return self.releases / "history.jsonl"

    @property
    def journal(self) -> Path:
        return self.releases / "switching.json"

    @property
    def drain_file(self) -> Path:
        return self.sandbox.run_dir / "voice.drain"

    @property
    def address(self) -> ManagerAddress:
        return ManagerAddress("user", self.sandbox.manager.runtime_dir)

    def current(self) -> str | None:
        try:
            return os.readlink(self.releases / "current")
        except OSError:
            return None

    def stored(self) -> list[str]:
        return sorted(p.name for p in self.releases.iterdir() if re.fullmatch(r"[0-9a-f]{16}", p.name))

    def records(self) -> list[dict]:
        """history.jsonl's records, read here with Python's own json (lines that are not objects left out)."""
        out = []
        for line in self.history.read_bytes().decode(errors="replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                out.append(record)
        return out

    # what systemd and the kernel say

    def invocation(self, unit: str = ENGINE) -> bytes:
        with connect(self.address) as bus:
            return unit_property(bus, unit, "Unit", "InvocationID")

    def active(self, unit: str) -> str:
        with connect(self.address) as bus:
            state = unit_property(bus, unit, "Unit", "ActiveState")
        return state.decode() if isinstance(state, bytes) else str(state)

    def restart(self, unit: str) -> None:
        with connect(self.address) as bus:
            run_job(bus, "restart", unit, 60)

    def node_processes(self) -> list[str]:
        """Processes of this node's side still alive (their /proc cmdline), the test's own excepted."""
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                argv = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                state = next((line for line in (entry / "status").read_text().splitlines()
                              if line.startswith("State:")), "")
            except OSError:
                continue
            if str(self.state_dir) in argv and NODE_PROCESS.search(argv) and "zombie" not in state:
                found.append(f"pid {entry.name} ({state.strip()}): {argv[:200]}")
        return found

    def calls_problems(self, wait_s: float = 15.0) -> list[str]:
        """Why cyan does not take calls (empty when it does): gateway and engine /health 200, no drain file."""
        problems = []
        for what, port in (("gateway", GATEWAY_PORT), ("engine", ENGINE_PORT)):
            status = wait_for_200(f"http://{self.sandbox.address}:{port}/health", wait_s)
            if status != 200:
                problems.append(f"{what} /health answered {status or 'nothing'}")
        if os.path.lexists(self.drain_file):
            problems.append(f"{self.drain_file} is present")
        return problems

    # the checkout

    def fresh(self) -> dict:
        """Make the checkout render a release never stored on cyan; returns its bundle (with the switcher)."""
        from flatshare_ops.config.edit import set_value
        from flatshare_ops.render.checkout import DEFAULT_PROFILE, expected_outputs, write_outputs

        self._hold += 1
        set_value(self.checkout / DEFAULT_PROFILE, "engine.make_room.decode_hold_tokens", str(self._hold),
                  then=lambda: write_outputs(self.checkout, expected_outputs(self.checkout)), echo=lambda _w: None)
        return self.bundle()

    def bundle(self) -> dict:
        """The release the checkout renders for cyan, as the operator's side ships it."""
        (target,) = targets(self.inventory, [CYAN], False)
        return make_bundle(self.checkout, target, ship=True)

    # the node's side

    def node_argv(self, command: str, *options: str) -> list[str]:
        return [str(BIN / "flatshare-node"), command, "--node", CYAN, "--state-dir", str(self.state_dir),
                "--scope", "user", "--runtime-dir", str(self.sandbox.manager.runtime_dir), *options]

    def switch(self, bundle: dict | None, *options: str, admit: bool = True, wrap: list[str] | None = None,
               first_line: bytes | None = None) -> Run:
        """``flatshare-node switch`` with ``bundle`` (None: ``{}``, a rollback) on stdin; each admission request
        is answered ``admit``. Fails the test if it runs past :data:`BOUND_S` (killed, named as hung)."""
        argv = (wrap or []) + self.node_argv("switch", "--switch-id", uuid.uuid4().hex[:16], *options)
        process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = process.stdout, process.stderr
        assert process.stdin is not None and out is not None and err is not None  # all three PIPE
        lines: queue.Queue = queue.Queue()
        def read() -> None:
            for raw in out:
                lines.put(raw)
            lines.put(None)  # its stdout ended (an error before any outcome: bad input is printed and exits)

        threading.Thread(target=read, daemon=True).start()
        errors: list[bytes] = []
        threading.Thread(target=lambda: errors.append(err.read()), daemon=True).start()
        payload = first_line if first_line is not None else (json.dumps(bundle if bundle is not None else {}) + "\n").encode()
        try:
            process.stdin.write(payload)
            process.stdin.flush()
        except BrokenPipeError:
            pass
        deadline = time.monotonic() + BOUND_S
        people: list[str]
        people, outcome, asked = [], None, 0
        while True:
            try:
                raw = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                process.kill()
                process.wait()
                pytest.fail(f"flatshare-node switch hung past {BOUND_S:g} s:\n" + "\n".join(people[-30:]))
            if raw is None:
                break
            line = raw.decode(errors="replace").rstrip("\n")
            message = protocol.parse(line)
            if isinstance(message, protocol.AdmitRequest):
                asked += 1
                try:
                    process.stdin.write(protocol.answer_line(protocol.AdmitAnswer(admit, None if admit else
                                                                                   "the test refuses")).encode())
                    process.stdin.flush()
                except BrokenPipeError:
                    pass
            elif isinstance(message, protocol.Outcome):
                outcome = json.loads(line.split(" ", 1)[1])
                break
            elif not protocol.is_protocol(line):
                people.append(line)
        try:
            process.stdin.close()
        except BrokenPipeError:
            pass
        code = process.wait(timeout=BOUND_S)
        time.sleep(0.05)
        return Run(code, people, outcome, asked, b"".join(errors).decode(errors="replace"))

    def command(self, command: str, *options: str) -> subprocess.CompletedProcess:
        """A node-side command without stdin (status, history, probe, module, hold), bounded."""
        try:
            return subprocess.run(self.node_argv(command, *options), capture_output=True, text=True,
                                  timeout=BOUND_S, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            pytest.fail(f"flatshare-node {command} hung past {BOUND_S:g} s")

    def status(self) -> tuple[subprocess.CompletedProcess, dict]:
        result = self.command("status")
        return result, json.loads(result.stdout) if result.returncode == 0 else {}

    def serving_check(self) -> subprocess.CompletedProcess:
        try:
            return run_cli("--state-dir", str(self.state_dir), "--runtime-dir", str(self.sandbox.manager.runtime_dir),
                           "--node-name", CYAN, program="serving-check")
        except subprocess.TimeoutExpired:
            pytest.fail("serving-check hung")

    def cli(self, *args: str) -> subprocess.CompletedProcess:
        """The operator's ``flatshare`` (over SSH to the sandbox)."""
        return run_cli(*args, "--inventory", str(self.inventory))

    # leaving it as found

    def settle(self) -> None:
        """Bring cyan back to settled after a test (a release of the checkout finishes what was left)."""
        if self.journal.exists() or self.calls_problems(wait_s=2) or not self._checks_ok():
            result = self.switch(self.bundle())
            assert result.code in (0, 4), result.text
        self.assert_settled()

    def _checks_ok(self) -> bool:
        return run_checks(self.state_dir, CYAN, self.sandbox.manager.runtime_dir).status == "OK"

    def assert_settled(self) -> None:
        assert not os.path.lexists(self.journal), f"{self.journal} left behind"
        assert not self.node_processes(), self.node_processes()
        assert not self.calls_problems(), self.calls_problems()
        report = run_checks(self.state_dir, CYAN, self.sandbox.manager.runtime_dir)
        assert report.status == "OK", [(f.check, f.status, f.summary, f.details) for f in report.findings]
        assert_strict_files(self.releases)


def assert_strict_files(releases: Path) -> None:
    """Every JSON file the node keeps reads with a strict reader of the test's own (RFC 8259: no NaN, no
    infinity, no number too large for a float): the tool never writes what it would refuse to read."""
    def refuse(text):
        raise ValueError(f"{text} is not an RFC 8259 number")

    def finite(text):
        value = float(text)
        if value in (float("inf"), float("-inf")):
            raise ValueError(f"{text} overflows")
        return value

    for name in ("history.jsonl", "outcomes.jsonl", "switching.json", "lock.json", "hold.json"):
        path = releases / name
        if not path.is_file() or path.is_symlink():
            continue
        raw = path.read_bytes()
        pieces = raw.splitlines() if name.endswith(".jsonl") else [raw]
        for number, piece in enumerate(pieces, 1):
            try:
                json.loads(piece, parse_constant=refuse, parse_float=finite)
            except ValueError as err:
                if "RFC 8259" in str(err) or "overflows" in str(err):
                    raise AssertionError(f"{path}:{number}: the node wrote {err}") from None


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    with scratch_sandbox(tmp_path_factory, "node_damage", ADDRESSES) as (scratch, checkout, base):
        n = Node(checkout, base, scratch)
        quick_stand_in(n.sandbox.profile)
        # Three releases that served, through the node's own switch: A, then B (the rollback target), then C.
        for _ in range(3):
            result = n.switch(n.fresh())
            assert result.code == 0, result.text
        n.assert_settled()
        yield n


@pytest.fixture
def cyan(node):
    """cyan for one test, settled after it (whatever the test left)."""
    yield node
    node.settle()


# --- putting damage in place -------------------------------------------------------------------------


class Kept:
    """What was at a path before a test damaged it (a file, a link or nothing), to put back."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.link = os.readlink(path) if path.is_symlink() else None
        self.data = path.read_bytes() if self.link is None and path.is_file() else None
        self.mode = stat.S_IMODE(os.lstat(path).st_mode) if self.data is not None else None

    def restore(self) -> None:
        clear(self.path)
        if self.link is not None:
            os.symlink(self.link, self.path)
        elif self.data is not None:
            self.path.write_bytes(self.data)
            assert self.mode is not None  # kept with the data
            os.chmod(self.path, self.mode)


def clear(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()


def put(path: Path, form: str) -> None:
    """Put ``form`` at ``path`` (whatever was there removed): a FIFO, a socket, a character device (/dev/zero's:
    a read of it never ends) or a directory holding a file."""
    clear(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if form == "fifo":
        os.mkfifo(path)
    elif form == "socket":
        # bound from inside the directory: a socket's path is limited to 107 bytes
        subprocess.run([sys.executable, "-c", "import socket, sys; socket.socket(socket.AF_UNIX).bind(sys.argv[1])",
                        path.name], cwd=path.parent, check=True)
    elif form == "device":
        os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 5))
    elif form == "directory":
        path.mkdir()
        (path / "left-here").write_text("x\n")
    else:
        raise AssertionError(form)
    assert not stat.S_ISREG(os.lstat(path).st_mode)


@contextmanager
def damaged(*paths: Path):
    """Keep what is at each path, let the test damage it, put it back whatever happens."""
    kept = [Kept(p) for p in paths]
    try:
        yield
    finally:
        for k in kept:
            k.restore()


def one_line_naming(text: str, name: str, damage: str) -> bool:
    """Whether one line of ``text`` names the file (regex ``name``) and its damage (regex ``damage``)."""
    return any(re.search(name, line) and re.search(damage, line, re.IGNORECASE) for line in text.splitlines())


def snapshot(directory: Path, skip: tuple[str, ...] = ("release.log", "outcomes.jsonl")) -> dict[str, bytes]:
    """Every regular file under ``directory`` with its bytes (links as their target), but the two files a
    refused command may rightly append to, and the caches (kept switchers, kept preflights)."""
    out = {}
    for path in sorted(directory.rglob("*")):
        relative = str(path.relative_to(directory))
        if relative.startswith((".switchers", ".preflight")) or path.name in skip:
            continue
        if path.is_symlink():
            out[relative] = b"-> " + os.readlink(path).encode()
        elif path.is_file():
            out[relative] = path.read_bytes()
    return out


FORMS = ["fifo", "socket", "device", "directory"]
DEEP = b"[" * 200_000 + b"]" * 200_000
#: Bytes a 100 MB file starts with before its sparse rest (no disk is used for the rest).
BIG = 100 * 1000 * 1000


def make_big(path: Path, head: bytes) -> None:
    clear(path)
    path.write_bytes(head)
    os.truncate(path, BIG)


# --- 1. stored releases verified by their id -------------------------------------------------------------


def served_newest_first(records: list[dict]) -> list[str]:
    """The releases that served, newest first, by releases/README.md's rule (a release whose latest switch
    failed or was abandoned left out), read from the test's own parse of history.jsonl."""
    seen: list[str] = []
    distrusted: set = set()
    for r in reversed(records):
        if r.get("result") in ("failed", "abandoned") and r.get("target") not in seen:
            distrusted.add(r.get("target"))
        elif r.get("result") in ("released", "rolled back") and r.get("served") and r.get("after") not in seen \
                and r.get("after") not in distrusted:
            seen.append(r.get("after"))
    return seen


@dataclass
class Roles:
    active: str
    target: str
    served: str


def roles(node: Node) -> Roles:
    """The active release, the rollback target, and another release that served (all stored)."""
    stored = set(node.stored())
    served = [r for r in served_newest_first(node.records()) if r in stored and r != node.current()]
    assert len(served) >= 2, (served, stored)
    active = node.current()
    assert active is not None, "no current link"
    return Roles(active, served[0], served[1])


def edit_serving(node: Node, rid: str, **changes: object) -> Path:
    """Edit stored release ``rid``'s serving.json in place, keeping it a well-shaped serving.json (only its id
    can tell): ``voice__drain_file="..."`` sets voice.drain_file. Returns the file."""
    path = node.releases / rid / "serving.json"
    document = json.loads(path.read_text())
    for key, value in changes.items():
        *parents, last = key.split("__")
        where = document
        for part in parents:
            where = where[part]
        where[last] = value
    path.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n")
    return path


#: The breaker's edit: the voice drain file pointed at the node's own history, so that removing "the drain
#: file" would remove the history.
def breakers_edit(node: Node) -> dict:
    return {"voice__drain_file": str(node.history), "gateway__url": f"http://{ADDRESSES[CYAN]}:1"}


def test_an_edited_rollback_target_is_refused_by_its_id_and_nothing_is_drained_or_lost(cyan):
    r = roles(cyan)
    path = cyan.releases / r.target / "serving.json"
    with damaged(path):
        edit_serving(cyan, r.target, **breakers_edit(cyan))
        history, engine = cyan.history.read_bytes(), cyan.invocation()
        dry = cyan.switch(None, "--rollback", "--dry-run")
        rollback = cyan.switch(None, "--rollback")
        assert (dry.code, rollback.code) == (5, 5), dry.text + rollback.text
        for run in (dry, rollback):
            assert "Traceback" not in run.text
            assert one_line_naming(run.text, rf"releases/{r.target}\b",
                                   rf"its files make release [0-9a-f]{{16}}, not {r.target}"), run.text
        # The truth: history untouched (the breaker's edit would have removed it), nothing drained or restarted.
        assert cyan.history.read_bytes() == history
        assert cyan.invocation() == engine and cyan.current() == r.active
        assert not cyan.calls_problems() and not cyan.node_processes()


def test_an_edited_active_release_is_never_acted_on_and_is_named_by_status_serving_check_and_the_switch(cyan):
    r = roles(cyan)
    path = cyan.releases / r.active / "serving.json"
    with damaged(path):
        edit_serving(cyan, r.active, **breakers_edit(cyan))
        history, engine = cyan.history.read_bytes(), cyan.invocation()
        # A release that is refused gives calls back (node/calls.py give_calls_back): never through the edited
        # file's drain path, which names history.jsonl.
        refused = cyan.switch(cyan.fresh(), admit=False)
        assert refused.code == 3 and "Traceback" not in refused.text, refused.text
        assert refused.asked == 1, refused.text  # the edited gateway (a dead port) never said "takes no calls"
        assert one_line_naming(refused.text, rf"releases/{r.active}\b", r"its files make release.*planning a whole switch")
        assert cyan.history.read_bytes() == history and cyan.invocation() == engine
        # What the node says of itself names the damage; nothing answers from the edited file.
        _, status = cyan.status()
        assert any("active release is damaged" in d and r.active in d for d in status["damaged"]), status
        check = cyan.serving_check()
        assert check.returncode == 3 and one_line_naming(check.stdout, rf"releases/{r.active}\b", "damaged"), check.stdout
        probe = json.loads(cyan.command("probe").stdout)
        assert probe["takes_calls"] is False and any("cannot be read" in p for p in probe["problems"]), probe
        module = json.loads(cyan.command("module").stdout)
        assert "active release is damaged" in module.get("error", ""), module
        operator = cyan.cli("status", "--node", CYAN)
        assert operator.returncode == 5 and "active release is damaged" in operator.stdout, operator.stdout
        # Admitted, the release switches away from it: a whole switch, the history kept and one record added.
        released = cyan.switch(cyan.fresh())
        assert released.code == 0 and released.asked == 1, released.text
        after = cyan.history.read_bytes()
        assert after.startswith(history) and len(after.splitlines()) == len(history.splitlines()) + 1
        assert cyan.invocation() != engine and cyan.current() != r.active


def test_a_release_from_a_damaged_active_release_leaves_it_by_its_id_never_as_the_nodes_first(cyan):
    # A breaker's case: one edited unit in the active release made the next release "the node's first release"
    # (no `before`, no canary analysis, and `rollback --all` had nothing to undo).
    r = roles(cyan)
    unit = cyan.releases / r.active / "units" / ENGINE
    with damaged(unit):
        unit.write_bytes(unit.read_bytes() + b"# edited\n")
        run = cyan.switch(cyan.fresh())
    assert run.code == 0, run.text
    assert "the node's first release" not in run.text and f"plan for cyan: {r.active} -> " in run.text, run.text
    assert re.search(rf"the stored copy of {r.active}, the release it leaves, is damaged", run.text), run.text
    record = cyan.records()[-1]
    assert (record["result"], record["before"]) == ("released", r.active), record
    assert run.outcome.get("first") is False, run.outcome


def test_an_edited_release_that_served_is_never_used_and_releasing_it_again_stores_it_afresh(cyan):
    from flatshare_ops.common.release_files import read_release

    r = roles(cyan)
    path = cyan.releases / r.served / "serving.json"
    files = read_release(path.parent, r.served)  # what the release is, read while it is whole
    bundle = {**cyan.bundle(), "id": r.served, "files": files}
    with damaged(path):
        edit_serving(cyan, r.served, **breakers_edit(cyan))
        edited, history = path.read_bytes(), cyan.history.read_bytes()
        dry = cyan.switch(None, "--rollback", "--dry-run")  # it goes to the target: the damaged one is not read
        assert dry.code == 0 and f"-> {r.target} (rollback)" in dry.text, dry.text
        assert path.read_bytes() == edited and cyan.history.read_bytes() == history
        # The checkout renders that release again: the damaged copy is named and stored afresh from the bundle.
        released = cyan.switch(bundle)
        assert released.code == 0, released.text
        assert one_line_naming(released.text, r.served, r"stored copy .*differs.*damaged.*storing it again")
        assert read_release(path.parent, r.served) == files and cyan.current() == r.served


# --- 5. every path the node opens, checked without blocking ------------------------------------------------


@dataclass(frozen=True)
class Opened:
    """A path the node opens, the command that opens it, the exit codes it may give with something other than a
    regular file there, and what a line must name (None: nothing to name, e.g. lock.json, which only informs)."""

    name: str
    where: object  # Node -> Path
    command: str  # "switch" (a real change), "status", "serving-check", "module"
    codes: tuple[int, ...]
    names: str | None
    serving: bool = True


def _active(node: Node) -> Path:
    current = node.current()
    assert current is not None, "no current link"
    return node.releases / current


def _metadata(node: Node) -> Path:
    (found,) = node.sandbox.venv.glob("lib/python*/site-packages/vllm-*.dist-info/METADATA")
    return found


def _module(node: Node) -> Path:
    return Path(json.loads((_active(node) / "serving.json").read_text())["module"]["path"])


def _model_file(node: Node) -> Path:
    """The model's config.json (the engine's ``vllm serve MODEL``, a local directory in the sandbox)."""
    argv = json.loads((_active(node) / "serving.json").read_text())["engine"]["argv"]
    return Path(argv[argv.index("serve") + 1]) / "config.json"


def _switcher_file(node: Node) -> Path:
    return run_zip(switcher_dir(node))


OPENED = [
    # written, never read: the switch goes on and says the log is not kept
    Opened("release.log", lambda n: n.releases / "release.log", "switch", (0,), r"release\.log.*not kept"),
    # read before anything changes: damage, named
    Opened("history.jsonl", lambda n: n.history, "switch", (5,), r"history\.jsonl"),
    Opened("switching.json", lambda n: n.journal, "switch", (5,), r"switching\.json"),
    Opened("hold.json", lambda n: n.releases / "hold.json", "switch", (5,), r"hold\.json"),
    Opened(".lock", lambda n: n.releases / ".lock", "switch", (5,), r"releases/\.lock\b"),
    # what a command ended with: not kept, said, the switch's own result stands
    Opened("outcomes.jsonl", lambda n: n.releases / "outcomes.jsonl", "switch", (0,),
           r"could not be kept in .*outcomes\.jsonl"),
    # who holds the lock, for people only: never read by the switch, never written through
    Opened("lock.json", lambda n: n.releases / "lock.json", "switch", (0,), None),
    # the voice drain files: the drain cannot begin, or cannot be confirmed: an early end, named, calls given back
    Opened("voice.drain", lambda n: n.drain_file, "switch", (1,), r"voice\.drain"),
    Opened("voice.status", lambda n: n.sandbox.run_dir / "voice.status", "switch", (1,), r"voice\.status"),
    # an installed unit the release would install: install-units ends early, named (before any daemon-reload)
    Opened("installed unit", lambda n: n.sandbox.manager.unit_dir / VOICE, "switch", (1,), re.escape(VOICE)),
    # the model's files, read by the preflight (and by vLLM's reader, which a FIFO stops: a breaker's case, with the
    # release lock held for good): refused before any drain, named
    Opened("model config.json", _model_file, "switch", (3,), r"config\.json"),
    # the engine venv's vLLM metadata: the release is refused (no vLLM known there)
    Opened("vLLM METADATA", _metadata, "switch", (3,), r"vLLM not installed \(.*METADATA"),
    # the active release's own files: a whole switch with a note naming it
    Opened("active serving.json", lambda n: _active(n) / "serving.json", "switch", (0,), r"serving\.json.*whole switch"),
    Opened("active unit", lambda n: _active(n) / "units" / ENGINE, "switch", (0,), rf"{ENGINE}.*whole switch"),
    # read by serving-check and the module probe: named, never waited on
    Opened("serve module", _module, "serving-check", (2,), r"serve module .*not a regular file"),
    Opened("serve module (probe)", _module, "module", (0,), r"not a regular file"),
    Opened("active serving.json (check)", lambda n: _active(n) / "serving.json", "serving-check", (3,),
           r"serving\.json.*(not a file|not a regular file)"),
    # the switcher's note and the switcher itself: checked, never waited on (status still answers)
    Opened("switcher note", lambda n: _active(n) / "switcher", "status", (0,), None),
    Opened("switcher file", _switcher_file, "status", (0,), None),
    # what switch commands ended with, as the node's status shows it (a breaker's case: status said nothing)
    Opened("outcomes.jsonl (status)", lambda n: n.releases / "outcomes.jsonl", "status", (0,),
           r"outcomes\.jsonl.*a follow-up cannot learn"),
]


def _opened_cases():
    for o in OPENED:
        for form in FORMS:
            yield pytest.param(o, form, id=f"{o.name}-{form}")


@pytest.mark.parametrize("opened, form", list(_opened_cases()))
def test_nothing_at_a_path_the_node_opens_makes_it_wait(cyan, opened, form):
    path = opened.where(cyan)
    engine = cyan.invocation()
    bundle = cyan.fresh() if opened.command == "switch" else None
    with damaged(path):
        put(path, form)
        if opened.name.startswith("voice."):
            time.sleep(0.3)  # the worker polls its drain file every 50 ms
        if opened.command == "switch":
            run = cyan.switch(bundle)
            code, text = run.code, run.text
        elif opened.command == "serving-check":
            result = cyan.serving_check()
            code, text = result.returncode, result.stdout + result.stderr
        else:
            result = cyan.command(opened.command)
            code, text = result.returncode, result.stdout + result.stderr
            if opened.command == "status":
                assert json.loads(result.stdout)["release"] == cyan.current(), result.stdout
        left = cyan.node_processes()
        still_there = os.path.lexists(path) and not stat.S_ISREG(os.lstat(path).st_mode)
    assert not left, f"node processes left behind (blocked?): {left}"
    assert "Traceback" not in text, text
    assert code in opened.codes, f"exit {code}, expected {opened.codes}:\n{text[-3000:]}"
    if opened.names:
        assert one_line_naming(text, opened.names, form_words(form)), f"no line names it:\n{text[-3000:]}"
    if code == 5 or (code == 3 and opened.command == "switch"):
        assert cyan.invocation() == engine  # refused: nothing restarted
    if opened.name == "switcher file":
        assert not still_there  # made again: a regular file there once more
    if opened.name in ("voice.drain", "voice.status"):
        cyan.restart(VOICE)  # the stand-in worker may have stopped on it


def test_a_kept_preflight_is_checked_without_opening_a_fifo_among_the_models_files(tmp_path):
    # A breaker's case: a switch to a release whose passed preflight was kept read the model's config.json to see
    # whether it changed, and a FIFO there held the switch (and its node's release lock) for good.
    import subprocess
    import sys

    model = tmp_path / "model"
    model.mkdir()
    os.mkfifo(model / "config.json")
    serving = {"engine": {"argv": ["vllm", "serve", str(model)], "venv": str(tmp_path / "venv")}}
    code = ("import json, sys; from flatshare_ops.node.preflight import fingerprint; "
            "print(fingerprint('a1b2c3d4e5f60718', json.loads(sys.argv[1])))")
    done = subprocess.run([sys.executable, "-c", code, json.dumps(serving)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and len(done.stdout.strip()) == 64, done.stdout + done.stderr


def form_words(form: str) -> str:
    """How a line says what is there (common/files.py what_is)."""
    return {"fifo": r"FIFO", "socket": r"socket", "device": r"device", "directory": r"directory"}[form] \
        + r"|not a regular file|not a file"


# --- 3. bounded parsing: nesting without end, a file of 100 MB ----------------------------------------------

MARK = "__NOT_A_NUMBER__"


def with_literal(document: dict, literal: str) -> bytes:
    """``document`` as JSON with the field set to :data:`MARK` written as ``literal`` (NaN, Infinity, 1e400)."""
    return json.dumps(document).replace(json.dumps(MARK), literal).encode() + b"\n"


def journal_document(n: Node, **fields: object) -> dict:
    """A journal as a switch interrupted after its first step leaves it (releases/README.md, schema 2)."""
    r = roles(n)
    now = time.time()
    document: dict[str, Any] = {"schema": 2, "switch": uuid.uuid4().hex[:16], "rollout": None, "commit": None, "from": r.active,
                "to": r.target, "node": CYAN, "host": "test", "pid": 4242, "user": "root", "started_at": now - 60,
                "forced": False, "resumed": 0, "auto": None, "kind": "release",
                "steps": [{"name": "drain-voice", "state": "done", "at": now - 59, "error": None},
                          {"name": "stop-gateway", "state": "pending", "at": None, "error": None}]}
    for key, value in fields.items():
        if key == "at":
            document["steps"][0]["at"] = value
        else:
            document[key] = value
    return document


def lock_held(node: Node):
    """The node's release lock held by this test (as a release holds it: the kernel's lock table says so)."""
    from filelock import FileLock

    return FileLock(str(node.releases / ".lock"))


BOUNDED = ["switching.json", "history.jsonl", "hold.json", "lock.json", "outcomes.jsonl", "active serving.json"]


@pytest.mark.parametrize("form", ["deep", "big"])
@pytest.mark.parametrize("file", BOUNDED)
def test_a_file_nested_without_end_or_of_100_mb_is_damage_named_never_a_traceback(cyan, file, form):
    what = r"nested more than 32 levels|its files make release" if form == "deep" else r"MiB, more than"
    path = {"switching.json": cyan.journal, "history.jsonl": cyan.history, "hold.json": cyan.releases / "hold.json",
            "lock.json": cyan.releases / "lock.json", "outcomes.jsonl": cyan.releases / "outcomes.jsonl",
            "active serving.json": _active(cyan) / "serving.json"}[file]
    appended = file.endswith(".jsonl") and form == "deep"  # a line added to the file, as a crash or an editor might
    engine = cyan.invocation()
    with damaged(path):
        if appended:
            with open(path, "ab") as f:
                f.write(DEEP + b"\n")
        elif form == "deep":
            path.write_bytes(DEEP)
        else:
            make_big(path, b'{"schema": 2, ')
        before = snapshot(cyan.releases)
        if file == "lock.json":
            lock = lock_held(cyan)
            lock.acquire(timeout=0)
            try:
                refused, check = cyan.switch(cyan.fresh()), cyan.serving_check()
            finally:
                lock.release()
            assert refused.code == 3 and one_line_naming(refused.text, r"lock\.json", what), refused.text
            assert one_line_naming(check.stdout, r"lock\.json", what), check.stdout
            runs = [refused.text, check.stdout]
        elif file == "outcomes.jsonl":
            run = cyan.switch(cyan.fresh())
            asked = cyan.command("status", "--switch", run.outcome["switch"])
            state = json.loads(asked.stdout)
            runs = [run.text, asked.stdout + asked.stderr]
            assert run.code == 0, run.text
            if appended:  # the damaged line is skipped: the outcome after it is found
                assert state["state"] == "recorded", state
            else:  # grown past its bound: its newest lines that fit are kept, and this outcome after them (a
                # breaker's case: every later outcome was lost, so a follow-up after a refusal heard "never began")
                kept = (cyan.releases / "outcomes.jsonl").read_bytes()
                assert len(kept) <= 4 << 20 and b"\0" not in kept, len(kept)
                assert json.loads(kept.splitlines()[-1])["switch"] == run.outcome["switch"], kept[-300:]
                assert "outcomes.jsonl" not in run.text, run.text
        elif file == "history.jsonl" and appended:
            run = cyan.switch(cyan.fresh())
            assert run.code == 0 and one_line_naming(run.text, r"history\.jsonl:\d+", what), run.text
            listing = json.loads(cyan.command("history").stdout)
            assert listing["records"][-1]["switch"] == run.outcome["switch"], listing["records"][-1]
            assert any(re.search(what, note) for note in listing["skipped"])
            runs = [run.text]
        elif file == "active serving.json":
            check = cyan.serving_check()
            assert check.returncode == 3 and one_line_naming(check.stdout, r"serving\.json|releases/", what), check.stdout
            run = cyan.switch(cyan.fresh())
            assert run.code == 0 and one_line_naming(run.text, r"serving\.json|releases/", what), run.text
            runs = [check.stdout, run.text]
        else:
            run = cyan.switch(cyan.fresh())
            dry = cyan.switch(None, "--rollback", "--dry-run")
            _, status = cyan.status()
            runs = [run.text, dry.text]
            for r in (run, dry):
                assert r.code == 5 and one_line_naming(r.text, re.escape(file), what), r.text
            assert any(re.search(what, d) for d in status["damaged"]), status
            assert cyan.invocation() == engine and snapshot(cyan.releases) == before  # nothing changed
        assert not cyan.node_processes()
    for text in runs:
        assert "Traceback" not in text and "RecursionError" not in text, text


def test_a_bundle_nested_without_end_or_of_100_mb_on_stdin_is_bad_input_named(cyan):
    before = snapshot(cyan.releases)
    deep = cyan.switch(None, first_line=DEEP + b"\n")
    big = cyan.switch(None, first_line=b"x" * BIG + b"\n")
    assert deep.code == 2 and one_line_naming(deep.text, r"stdin is not JSON", r"nested more than 32 levels"), deep.text
    assert big.code == 2 and one_line_naming(big.text, r"stdin", r"not JSON"), big.text
    assert "Traceback" not in deep.text + big.text
    assert snapshot(cyan.releases) == before


@pytest.mark.parametrize("form", ["deep", "big"])
@pytest.mark.parametrize("file", ["profile", "inventory", "known_hosts"])
def test_an_operators_file_nested_without_end_or_of_100_mb_is_named(cyan, file, form):
    path = {"profile": cyan.sandbox.profile, "inventory": cyan.inventory,
            "known_hosts": cyan.base / "ssh/known_hosts"}[file]
    with damaged(path):
        if form == "deep":
            if file == "known_hosts":
                return  # lines, not a nesting format: only its size is bounded
            path.write_bytes(path.read_bytes() + b"\nnested = " + b"[" * 200_000 + b"]" * 200_000 + b"\n")
        else:
            make_big(path, path.read_bytes())
        result = cyan.cli("status", "--node", CYAN)
    text = result.stdout + result.stderr
    what = r"nested more than \d+ levels" if form == "deep" else r"MiB, more than"
    assert "Traceback" not in text and "RecursionError" not in text, text
    # A damaged profile is this side's bad input (2); a damaged known_hosts keeps the node from being reached (6).
    assert (result.returncode == 6 if path.name == "known_hosts" else result.returncode in (1, 2)) and one_line_naming(text, re.escape(path.name), what), text


# --- 4. NaN, Infinity and 1e400 in each numeric field ------------------------------------------------------

#: The last: an integer too large for a float (RFC 8259 has no bound; Python reads it exactly, and it overflows
#: wherever it meets a float), refused like the rest.
LITERALS = ["NaN", "Infinity", "-Infinity", "1e400", pytest.param("1" + "0" * 400, id="401-digit-integer")]


@pytest.mark.parametrize("literal", LITERALS)
@pytest.mark.parametrize("key", ["started_at", "pid", "resumed", "at"])
def test_a_journal_with_a_number_that_is_no_number_is_refused_and_nothing_is_written(cyan, key, literal):
    history, engine = cyan.history.read_bytes(), cyan.invocation()
    with damaged(cyan.journal):
        cyan.journal.write_bytes(with_literal(journal_document(cyan, **{key: MARK}), literal))
        release = cyan.switch(cyan.bundle())
        rollback = cyan.switch(None, "--rollback")
        _, status = cyan.status()
        for run in (release, rollback):
            assert run.code == 5 and "Traceback" not in run.text, run.text
            assert one_line_naming(run.text, r"switching\.json", rf"{re.escape(literal)}|not a JSON number|too large"), \
                run.text
        assert (status["journal_state"], status["switching"]) == ("journal-unreadable", None), status
        assert any("switching.json" in d for d in status["damaged"]), status
        # The case: the rollback wrote NaN into history, whose reader then skipped the record.
        assert cyan.history.read_bytes() == history and cyan.invocation() == engine
    assert_strict_files(cyan.releases)


@pytest.mark.parametrize("literal", LITERALS)
@pytest.mark.parametrize("key", ["started_at", "finished_at", "duration_s", "resumed"])
def test_a_history_record_with_a_number_that_is_no_number_is_named_and_not_used(cyan, key, literal):
    records = cyan.records()
    target = roles(cyan).target
    last = {**records[-1], "switch": "damaged-" + uuid.uuid4().hex[:8], key: MARK}
    # the damaged record would make the target's release the newest that served, were it read
    last.update(result="released", served=True, after=target, target=target)
    with damaged(cyan.history):
        with open(cyan.history, "ab") as f:
            f.write(with_literal(last, literal))
        line = len(cyan.history.read_bytes().splitlines())
        listing = json.loads(cyan.command("history").stdout)
        dry = cyan.switch(None, "--rollback", "--dry-run")
        operator = cyan.cli("releases", "--node", CYAN)
    assert listing["records"] == [json.loads(json.dumps(r)) for r in listing["records"]]
    assert not any(r.get("switch") == last["switch"] for r in listing["records"])
    assert any(note.startswith(f"history.jsonl:{line}: ") and re.search(r"RFC 8259|not a JSON number|too large", note)
               for note in listing["skipped"]), listing["skipped"]
    assert dry.code == 0 and f"-> {target} (rollback)" in dry.text and f"history.jsonl:{line}" in dry.text, dry.text
    for bad in ("inf s", "nan", "(not a time", "None"):
        assert bad not in operator.stdout, operator.stdout


@pytest.mark.parametrize("literal", LITERALS)
@pytest.mark.parametrize("file, key", [("lock.json", "started_at"), ("lock.json", "pid"), ("hold.json", "since"),
                                       ("outcomes.jsonl", "code"), ("outcomes.jsonl", "at")])
def test_a_record_with_a_number_that_is_no_number_is_named_by_whoever_reads_it(cyan, file, key, literal):
    path = cyan.releases / file
    document = {"lock.json": {"host": "test", "pid": 4242, "user": "root", "release": "x", "started_at": time.time()},
                "hold.json": {"schema": 1, "who": "test", "since": time.time(), "message": "E2 benchmark"},
                "outcomes.jsonl": {"switch": "damaged-outcome", "code": 0, "result": "released", "release": None,
                                   "message": None, "detail": {}, "node": CYAN, "at": time.time()}}[file]
    with damaged(path):
        if file == "outcomes.jsonl":
            with open(path, "ab") as f:
                f.write(with_literal({**document, key: MARK}, literal))
            state = json.loads(cyan.command("status", "--switch", "damaged-outcome").stdout)
            assert state["state"] == "unknown", state  # the damaged line is never believed
            return
        path.write_bytes(with_literal({**document, key: MARK}, literal))
        if file == "hold.json":
            run = cyan.switch(cyan.bundle())
            assert run.code == 5, run.text
            assert one_line_naming(run.text, r"hold\.json", r"RFC 8259|not a JSON number|too large"), run.text
            return
        lock = lock_held(cyan)
        lock.acquire(timeout=0)
        try:
            check, refused = cyan.serving_check(), cyan.switch(cyan.bundle())
        finally:
            lock.release()
    for text in (check.stdout, refused.text):
        assert "Traceback" not in text
        assert one_line_naming(text, r"lock\.json", r"RFC 8259|not a JSON number|too large"), text
        assert not re.search(r"-?\d+e\+\d+ s|inf s|nan s", text), text
    assert refused.code == 3


@pytest.mark.parametrize("literal", LITERALS)
@pytest.mark.parametrize("key", ["engine__start_timeout_s", "engine__stop_timeout_s", "voice__drain_timeout_s",
                                 "gateway__drain_timeout_s"])
def test_a_bundle_whose_serving_json_holds_a_number_that_is_no_number_is_bad_input(cyan, key, literal):
    bundle = cyan.bundle()
    serving = json.loads(bundle["files"]["serving.json"])
    section, name = key.split("__")
    serving[section][name] = MARK
    bundle["files"]["serving.json"] = with_literal(serving, literal).decode()
    before = snapshot(cyan.releases)
    run = cyan.switch(bundle)
    assert run.code == 2 and "Traceback" not in run.text, run.text
    assert one_line_naming(run.text, r"serving\.json", r"RFC 8259|not a JSON number|too large"), run.text
    assert snapshot(cyan.releases) == before


def test_an_admission_answer_holding_nan_is_no_answer_and_the_drain_is_refused(cyan, monkeypatch):
    engine = cyan.invocation()
    bad = b'{"admit": true, "reason": null, "extra": NaN}\n'
    monkeypatch.setattr(protocol, "answer_line", lambda _message: bad.decode())
    run = cyan.switch(cyan.fresh())
    assert run.code == 3 and run.asked == 1, run.text
    assert one_line_naming(run.text, r"admission answer", r"was not one"), run.text
    assert cyan.invocation() == engine


# --- 6. a kept switcher checked against its digests ----------------------------------------------------------


def switcher_dir(node: Node) -> Path:
    digest = (_active(node) / "switcher").read_text().strip()
    return node.releases / ".switchers" / digest


def run_zip(directory: Path) -> Path:
    """The zip that runs, as the kept switcher's run.json names it (run-SHA256.zip)."""
    return directory / f"run-{json.loads((directory / 'run.json').read_text())['sha256']}.zip"


def run_zip_problems(directory: Path, data: bytes) -> list[str]:
    """How the zip that runs (node/entry.py ``RUN_ZIP``) differs from one made from the shipped zip ``data`` by
    this interpreter (empty: it is that zip), read here independently: every file of the shipped zip in it, byte
    for byte; beside each module, a pyc (PEP 552: this interpreter's magic, flags 1, the source's hash as
    importlib computes it) whose code is what compile() makes of the source; its note holding its sha256."""
    import hashlib
    import io
    import marshal
    from importlib.util import MAGIC_NUMBER, source_hash

    wrong = []
    try:
        note = json.loads((directory / "run.json").read_text())
        run = (directory / f"run-{note['sha256']}.zip").read_bytes()
    except (OSError, ValueError, KeyError, TypeError) as err:
        return [f"cannot read run.json or the zip it names: {err}"]
    if note.get("sha256") != hashlib.sha256(run).hexdigest() or note.get("magic") != MAGIC_NUMBER.hex():
        wrong.append(f"run.json {note} does not describe run.zip")
    with zipfile.ZipFile(io.BytesIO(data)) as shipped, zipfile.ZipFile(io.BytesIO(run)) as made:
        names = {i.filename for i in shipped.infolist() if not i.is_dir()}
        have = set(made.namelist())
        for name in sorted(names):
            source = shipped.read(name)
            if name not in have or made.read(name) != source:
                wrong.append(f"{name} differs")
                continue
            if not name.endswith(".py"):
                continue
            pyc = made.read(name + "c") if name + "c" in have else b""
            if pyc[:4] != MAGIC_NUMBER or pyc[4:8] != (1).to_bytes(4, "little") or pyc[8:16] != source_hash(source):
                wrong.append(f"{name}c: not an unchecked hash-based pyc of this source")
            elif marshal.loads(pyc[16:]).co_code != compile(source, name, "exec", dont_inherit=True).co_code:
                wrong.append(f"{name}c: its code is not the source's")
        extra = have - names - {n + "c" for n in names if n.endswith(".py")}
        wrong += [f"{name} is extra" for name in sorted(extra)]
    return wrong


def shipped_zip(node: Node) -> bytes:
    import base64

    return base64.b64decode(node.bundle()["switcher"]["zip_b64"])


def _replaced(zip_path: Path, name: str, data: bytes) -> None:
    """``zip_path`` written again with member ``name`` holding ``data`` (every other member as it was)."""
    import io

    with zipfile.ZipFile(zip_path) as old:
        members = [(i.filename, old.read(i)) for i in old.infolist()]
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as new:
        for member, content in members:
            new.writestr(member, data if member == name else content)
    zip_path.write_bytes(buffer.getvalue())


@pytest.mark.parametrize("damage", ["the zip that runs truncated", "a module's bytecode edited", "run.json not JSON",
                                    "run.json of another interpreter", "the zip that runs gone",
                                    "truncated, its shipped zip too", "its directory a link to a copy elsewhere"])
@pytest.mark.parametrize("by", ["status", "switch"])
def test_a_kept_switcher_is_checked_against_its_digests_and_made_again(cyan, damage, by):
    import marshal
    from importlib.util import MAGIC_NUMBER, source_hash

    data = shipped_zip(cyan)
    if by == "switch" or run_zip_problems(switcher_dir(cyan), data):
        assert cyan.switch(cyan.fresh()).code == 0  # the active release runs this checkout's switcher
    directory = switcher_dir(cyan)
    assert not run_zip_problems(directory, data)
    run, note = run_zip(directory), directory / "run.json"
    if damage.startswith("the zip that runs truncated") or damage.startswith("truncated"):
        run.write_bytes(run.read_bytes()[:4000])
    if damage == "a module's bytecode edited":
        # status.py's pyc replaced by code that exits 99, its header right for the source beside it
        source = zipfile.ZipFile(run).read("flatshare_ops/node/status.py")
        code = compile("raise SystemExit(99)\n", "status.py", "exec")
        _replaced(run, "flatshare_ops/node/status.pyc", MAGIC_NUMBER + (1).to_bytes(4, "little")
                  + source_hash(source) + marshal.dumps(code))
    if damage == "run.json not JSON":
        note.write_bytes(b"{")
    if damage == "run.json of another interpreter":
        document = json.loads(note.read_text())
        note.write_text(json.dumps({**document, "magic": "00000000"}))
    if damage == "the zip that runs gone":
        run.unlink()
    if damage.endswith("its shipped zip too"):
        (directory / "switcher.zip").write_bytes(b"not the zip")
    if damage.startswith("its directory a link"):
        # A breaker's case: the switcher was run from wherever the link pointed, and the link kept.
        elsewhere = directory.with_name("elsewhere-for-test")
        shutil.copytree(directory, elsewhere, symlinks=True)
        shutil.rmtree(directory)
        directory.symlink_to(elsewhere)
    if by == "status":
        result = cyan.command("status")
        assert result.returncode == 0 and json.loads(result.stdout)["release"] == cyan.current(), result.stderr
        text = result.stdout + result.stderr
    else:
        run_ = cyan.switch(cyan.fresh())
        assert run_.code == 0, run_.text
        text = run_.text
    assert "Traceback" not in text and "SyntaxError" not in text, text
    if damage.endswith("its shipped zip too") and by == "status":
        # nothing to check it against: said, and the installed code answers; the next release keeps it again
        assert one_line_naming(text, re.escape(str(directory)), r"cannot be checked"), text
        assert cyan.switch(cyan.fresh()).code == 0
    assert not switcher_dir(cyan).is_symlink()
    assert run_zip_problems(switcher_dir(cyan), data) == []
    shutil.rmtree(directory.with_name("elsewhere-for-test"), ignore_errors=True)
    left = sorted(p.name for p in directory.parent.glob(".damaged-*"))
    assert not left, left


# --- 7. history's order, schema and node -------------------------------------------------------------------


def test_a_history_whose_order_disagrees_with_its_times_decides_no_rollback_target(cyan):
    with damaged(cyan.history):
        lines = cyan.history.read_bytes().splitlines(keepends=True)
        cyan.history.write_bytes(b"".join(lines[1:] + lines[:1]))  # the first line moved to the end
        before, engine = cyan.history.read_bytes(), cyan.invocation()
        dry = cyan.switch(None, "--rollback", "--dry-run")
        rollback = cyan.switch(None, "--rollback")
        undo = cyan.switch(None, "--undo-rollout", "any-rollout")
        for run in (dry, rollback, undo):
            assert run.code == 5 and "Traceback" not in run.text, run.text
            assert one_line_naming(run.text, rf"history\.jsonl:{len(lines)}\b",
                                   r"before line \d+ above it.*rollback target"), run.text
        assert cyan.history.read_bytes() == before and cyan.invocation() == engine  # nothing done
        operator = cyan.cli("status", "--node", CYAN)
        assert operator.returncode == 5 and one_line_naming(operator.stdout, r"history\.jsonl", r"times disagree"), \
            operator.stdout
        # A release still goes ahead; it only cannot roll back by itself, and says so; nothing is pruned.
        stored = set(cyan.stored())
        release = cyan.switch(cyan.fresh())
        assert release.code == 0, release.text
        assert one_line_naming(release.text, r"automatic rollback", r"none possible.*history\.jsonl")
        assert stored <= set(cyan.stored())
        new = cyan.history.read_bytes()
        assert new.startswith(before) and json.loads(new.splitlines()[-1])["finished_at"] >= max(
            json.loads(line)["finished_at"] for line in lines)  # written in order, whatever came before


@pytest.mark.parametrize("foreign", ["schema 3", "node peacock"])
def test_a_record_of_an_unknown_schema_or_of_another_node_is_named_and_not_used(cyan, foreign):
    records = cyan.records()
    r = roles(cyan)
    # a record that, were it used, would make the served release the newest to serve (the rollback's target)
    record = {**records[-1], "switch": "foreign-" + uuid.uuid4().hex[:8], "result": "released", "served": True,
              "before": r.target, "after": r.served, "target": r.served, "finished_at": time.time()}
    record.update({"schema": 3} if foreign == "schema 3" else {"node": "peacock"})
    with damaged(cyan.history):
        with open(cyan.history, "ab") as f:
            f.write(json.dumps(record).encode() + b"\n")
        line = len(cyan.history.read_bytes().splitlines())
        listing = json.loads(cyan.command("history").stdout)
        dry = cyan.switch(None, "--rollback", "--dry-run")
        operator = cyan.cli("releases", "--node", CYAN)
    said = (r"schema 3, which this flatshare-ops does not read" if foreign == "schema 3"
            else r"of node 'peacock', not of cyan")
    assert not any(x.get("switch") == record["switch"] for x in listing["records"])
    assert any(note.startswith(f"history.jsonl:{line}: ") and re.search(said, note) for note in listing["skipped"])
    assert dry.code == 0 and f"-> {r.target} (rollback)" in dry.text, dry.text  # the target is as before
    assert one_line_naming(dry.text, rf"history\.jsonl:{line}\b", said)
    assert operator.returncode == 0 and "None" not in operator.stdout and "(none) -> (none)" not in operator.stdout
    assert one_line_naming(operator.stdout, rf"history\.jsonl:{line}\b", said), operator.stdout


def test_a_journal_of_another_node_is_never_finished_here(cyan):
    engine, history = cyan.invocation(), cyan.history.read_bytes()
    with damaged(cyan.journal):
        document = journal_document(cyan, node="peacock")
        document["to"] = cyan.bundle()["id"]  # what the checkout renders: it would be "finished" on cyan
        cyan.journal.write_text(json.dumps(document))
        dry = cyan.switch(cyan.bundle(), "--dry-run")
        release = cyan.switch(cyan.bundle())
        rollback = cyan.switch(None, "--rollback")
        journal = cyan.journal.read_bytes()
    for run in (dry, release, rollback):
        assert run.code == 5 and "Traceback" not in run.text, run.text
        assert one_line_naming(run.text, r"switching\.json", r"journal of node 'peacock', not of cyan"), run.text
    assert journal == json.dumps(document).encode()  # never overwritten, never removed
    assert cyan.invocation() == engine and cyan.history.read_bytes() == history


# --- 8. a read-only state directory, a BOM, times that are no times, status's exit codes ----------------------


def read_only(directory: Path) -> list[str]:
    """A wrapper that runs a command in a mount namespace of its own, where ``directory`` is bound over itself
    read-only (the rest of the machine never sees it)."""
    script = 'mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" "$1" && shift && exec "$@"'
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", str(directory)]


def test_a_read_only_state_directory_is_named_read_only_and_nothing_changes(cyan):
    before, engine = snapshot(cyan.releases, skip=()), cyan.invocation()
    run = cyan.switch(cyan.fresh(), wrap=read_only(cyan.releases))
    rollback = cyan.switch(None, "--rollback", wrap=read_only(cyan.releases))
    for r in (run, rollback):
        assert r.code == 3 and "Traceback" not in r.text, r.text
        assert one_line_naming(r.text, re.escape(str(cyan.releases)), r"read-only filesystem \(EROFS\)"), r.text
        assert not one_line_naming(r.text, r"\.lock", r"damaged|fix or remove it"), r.text
        assert one_line_naming(r.text, r"release\.log", r"Read-only file system"), r.text
    assert snapshot(cyan.releases, skip=()) == before and cyan.invocation() == engine
    assert held_by(cyan.releases / ".lock") is None and not cyan.calls_problems()


def test_a_fresh_nodes_read_only_state_directory_is_named_read_only_not_damaged(cyan):
    # A node with no releases/ yet (a fresh node) whose state directory is read-only: releases/ cannot be made.
    state = cyan.releases.parent
    aside = state / "releases.aside-for-test"
    os.rename(cyan.releases, aside)
    try:
        run = cyan.switch(cyan.fresh(), wrap=read_only(state))
        held = subprocess.run(read_only(state) + cyan.node_argv("hold", "--acquire", "E2 benchmark"),
                              capture_output=True, text=True, timeout=BOUND_S, stdin=subprocess.DEVNULL)
        made = cyan.releases.exists()
    finally:
        os.rename(aside, cyan.releases)
    for code, text in ((run.code, run.text), (held.returncode, held.stdout + held.stderr)):
        assert code == 3 and "Traceback" not in text, text  # refused (nothing changed), not damage (5)
        assert one_line_naming(text, re.escape(str(state)), r"[Rr]ead-only file ?system"), text
    assert not made and not cyan.calls_problems()


def test_an_immutable_releases_directory_refuses_the_release_and_changes_nothing(cyan):
    bundle = cyan.fresh()
    if subprocess.run(["chattr", "+i", str(cyan.releases)], capture_output=True).returncode != 0:
        pytest.skip("this filesystem has no immutable flag (chattr +i)")
    try:
        before, engine = snapshot(cyan.releases), cyan.invocation()
        run = cyan.switch(bundle)
        after = snapshot(cyan.releases)  # release.log and outcomes.jsonl are files of their own: appended
    finally:
        subprocess.run(["chattr", "-i", str(cyan.releases)], check=True)
    assert run.code == 3 and "Traceback" not in run.text, run.text
    assert one_line_naming(run.text, rf"could not store release {bundle['id']}", r"EPERM.*nothing was changed"), run.text
    assert after == before
    assert cyan.invocation() == engine and not cyan.calls_problems()


def test_a_history_that_takes_no_appends_refuses_the_switch_before_any_drain(cyan):
    # A breaker's case: an immutable history.jsonl was found at the switch's last step (record-history), after the
    # drain, the restarts and the switch of current; every later release drained and restarted again for nothing.
    bundle = cyan.fresh()
    if subprocess.run(["chattr", "+i", str(cyan.history)], capture_output=True).returncode != 0:
        pytest.skip("this filesystem has no immutable flag (chattr +i)")
    try:
        before, engine, current = cyan.history.read_bytes(), cyan.invocation(), cyan.current()
        run = cyan.switch(bundle)
        journal = cyan.journal.exists()
    finally:
        subprocess.run(["chattr", "-i", str(cyan.history)], check=True)
    assert run.code == 3 and "Traceback" not in run.text, run.text
    assert one_line_naming(run.text, r"history\.jsonl", r"EPERM.*could not be recorded, and nothing was changed"), \
        run.text
    assert cyan.history.read_bytes() == before and not journal and cyan.current() == current
    assert cyan.invocation() == engine and not cyan.calls_problems()


@pytest.mark.parametrize("form", ["directory", "fifo"])
def test_something_other_than_a_file_where_the_historys_archive_belongs_refuses_the_switch_before_any_drain(cyan, form):
    # A breaker's case: compaction appends the older lines to history.old.jsonl; a directory there failed the switch
    # at record-history, drained, and the next release did it again.
    bundle = cyan.fresh()
    archive = cyan.history.parent / "history.old.jsonl"
    assert not os.path.lexists(archive)
    archive.mkdir() if form == "directory" else os.mkfifo(archive)
    try:
        engine, current = cyan.invocation(), cyan.current()
        run = cyan.switch(bundle)
    finally:
        archive.rmdir() if form == "directory" else archive.unlink()
    assert run.code == 5 and "Traceback" not in run.text, run.text
    assert one_line_naming(run.text, r"history\.old\.jsonl", "directory" if form == "directory" else "FIFO"), run.text
    assert cyan.invocation() == engine and cyan.current() == current and not cyan.calls_problems()


def test_a_bom_at_the_top_of_known_hosts_is_named(cyan):
    path = cyan.base / "ssh/known_hosts"
    with damaged(path):
        lines = path.read_text().splitlines(keepends=True)
        mine = [line for line in lines if ADDRESSES[CYAN] in line]
        path.write_text("\ufeff" + "".join(mine + [line for line in lines if line not in mine]))
        result = cyan.cli("status", "--node", CYAN)
    assert result.returncode == 6 and "Traceback" not in result.stdout + result.stderr  # not reached: unreachable
    assert one_line_naming(result.stdout + result.stderr, r"known_hosts:1", r"byte-order mark \(U\+FEFF"), result.stdout


@pytest.mark.parametrize("key, value", [("started_at", "1e400"), ("started_at", "1e300"), ("finished_at", "-5"),
                                        ("duration_s", "-3"), ("duration_s", "1e300")])
def test_a_time_that_is_no_time_or_a_negative_duration_is_damage_and_status_says_5(cyan, key, value):
    record = {**cyan.records()[-1], "switch": "damaged-" + uuid.uuid4().hex[:8], key: MARK}
    with damaged(cyan.history):
        with open(cyan.history, "ab") as f:
            f.write(with_literal(record, value))
        line = len(cyan.history.read_bytes().splitlines())
        listing = cyan.cli("releases", "--node", CYAN)
        status = cyan.cli("status", "--node", CYAN)
    assert listing.returncode == 0 and one_line_naming(listing.stdout, rf"history\.jsonl:{line}\b",
                                                       r"not a time|not a number of seconds|too large"), listing.stdout
    for bad in ("not a time: inf", "inf s", "-3 s", "e+300 s", "None"):
        assert bad not in listing.stdout, listing.stdout
    assert status.returncode == 5, status.stdout  # damaged node state: not 1, a failed switch
    assert one_line_naming(status.stdout, rf"history\.jsonl:{line}\b", r"skipped"), status.stdout


def test_status_exits_1_for_an_unfinished_switch_and_5_for_damage(cyan):
    healthy = cyan.cli("status", "--node", CYAN)
    assert healthy.returncode == 0, healthy.stdout
    with damaged(cyan.journal):
        cyan.journal.write_text(json.dumps(journal_document(cyan)))
        unfinished = cyan.cli("status", "--node", CYAN)
        cyan.journal.write_text("{torn")
        broken = cyan.cli("status", "--node", CYAN)
    assert unfinished.returncode == 1 and "UNFINISHED switch" in unfinished.stdout, unfinished.stdout
    assert broken.returncode == 5 and one_line_naming(broken.stdout, r"switching\.json", r"not JSON"), broken.stdout


@pytest.mark.parametrize("when", ["1e300", "-1", "ten years ahead"])
def test_a_journal_whose_start_is_no_time_is_refused(cyan, when):
    value = str(time.time() + 10 * 365 * 86400) if when == "ten years ahead" else when
    history = cyan.history.read_bytes()
    with damaged(cyan.journal):
        cyan.journal.write_bytes(with_literal(journal_document(cyan, started_at=MARK), value))
        rollback = cyan.switch(None, "--rollback")
    assert rollback.code == 5 and one_line_naming(rollback.text, r"switching\.json", r"started_at: must be a time"), \
        rollback.text
    assert cyan.history.read_bytes() == history


def test_a_record_from_the_future_is_never_copied_into_new_records_and_its_order_is_named(cyan):
    ahead = time.time() + 10 * 365 * 86400
    record = {**cyan.records()[-1], "switch": "ahead-" + uuid.uuid4().hex[:8], "finished_at": ahead}
    with damaged(cyan.history):
        with open(cyan.history, "ab") as f:
            f.write(json.dumps(record).encode() + b"\n")
        release = cyan.switch(cyan.fresh())
        written = cyan.records()[-1]
        dry = cyan.switch(None, "--rollback", "--dry-run")
    assert release.code == 0, release.text
    assert written["switch"] == release.outcome["switch"] and written["finished_at"] < time.time() + 60, written
    assert dry.code == 5 and one_line_naming(dry.text, r"history\.jsonl:\d+", r"times disagree"), dry.text


@pytest.mark.parametrize("form", ["fifo", "dangling-link", "big", "not-json", "empty-directory", "directory"])
def test_a_damaged_hold_record_is_named_with_the_nodes_code_and_hold_lift_clears_it(cyan, form):
    # A breaker's cases: the advice ("run 'flatshare hold lift'") failed with the same message, and both
    # `hold status` and `hold lift` exited 6 ("could not be reached") though the node answered, with exit 5.
    path = cyan.releases / "hold.json"
    with damaged(path):
        clear(path)
        if form == "dangling-link":
            path.symlink_to(cyan.releases / "nowhere.json")
        elif form == "big":
            make_big(path, b'{"schema": 1, ')
        elif form == "not-json":
            path.write_bytes(b"{torn")
        elif form == "empty-directory":
            path.mkdir()
        else:
            put(path, form)
        status = cyan.cli("hold", "status", "--node", "cyan")
        assert status.returncode == 5, status.stdout + status.stderr  # damaged node state, as the node said
        assert one_line_naming(status.stdout + status.stderr, r"hold\.json", r"."), status.stdout + status.stderr
        lifted = cyan.cli("hold", "lift", "--node", "cyan")
        said = lifted.stdout + lifted.stderr
        assert "Traceback" not in said, said
        if form == "directory":  # what is in it is someone's: never removed, said, the node's refusal code
            assert lifted.returncode == 3 and one_line_naming(said, r"hold\.json", r"could not remove"), said
            assert (path / "left-here").exists()
        else:
            assert lifted.returncode == 0 and "hold lifted: its damaged record was removed" in said, said
            assert not os.path.lexists(path)
            assert cyan.cli("hold", "status", "--node", "cyan").returncode == 0
