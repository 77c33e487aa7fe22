"""The node's release lock (adr/0011): exclusive whatever happens to the files in releases/, and read right
(held, by whom) on every filesystem, without ever taking it.

Truth is the kernel's, read independently of the reading under test: each holder's own open files and
their locks (``/proc/PID/fd``, ``/proc/PID/fdinfo``: the ``lock:`` lines the kernel shows for the
descriptor that holds a lock) and the processes' command lines; the history's bytes on disk.

The stress test runs on a sandbox fleet of its own (loopback block 79).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import BIN, REPO, loopback_pair

from flatshare_ops.check.run import release_state
from flatshare_ops.common.locks import release_holder
from flatshare_ops.errors import Refused
from flatshare_ops.node.context import NodeContext
from flatshare_ops.node.lock import node_lock
from flatshare_ops.node.probe import probe
from flatshare_ops.common.systemd import ManagerAddress

ADDRESSES = loopback_pair(79)

#: A child that takes the node's lock with the real code, says so, and holds it until its stdin closes.
HOLDER = r"""
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from flatshare_ops.node.context import NodeContext
from flatshare_ops.node.lock import node_lock
from flatshare_ops.common.systemd import ManagerAddress
with node_lock(NodeContext("cyan", Path(sys.argv[2]), ManagerAddress("user", None)), "test-release"):
    print("locked", flush=True)
    sys.stdin.read()
"""

#: A switcher from before adr/0011: filelock on releases/.lock only.
OLD_HOLDER = r"""
import sys
from filelock import FileLock
lock = FileLock(sys.argv[1])
lock.acquire(timeout=0)
print("locked", flush=True)
sys.stdin.read()
"""


def _context(state: Path) -> NodeContext:
    return NodeContext("cyan", state, ManagerAddress("user", None))


@contextmanager
def holding(argv_tail: list[str], code: str = HOLDER):
    """A child process holding a lock (``code``); yields it once it said ``locked``."""
    child = subprocess.Popen([sys.executable, "-c", code, *argv_tail], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert child.stdin is not None and child.stdout is not None and child.stderr is not None  # all three PIPE
    try:
        assert child.stdout.readline().strip() == "locked", child.stderr.read()
        yield child
    finally:
        child.stdin.close()
        child.wait(10)


def held_locks(pid: int) -> dict[str, list[str]]:
    """The kernel's per-descriptor view of the locks process ``pid`` holds: open file -> its ``lock:`` lines."""
    found = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            lines = [line for line in Path(f"/proc/{pid}/fdinfo/{fd}").read_text().splitlines()
                     if line.startswith("lock:")]
        except OSError:
            continue
        if lines:
            found[target] = lines
    return found


# --- the reading, on this machine's filesystems ------------------------------------------------------------


@pytest.mark.parametrize("where", ["sandbox filesystem", "tmpfs"])
def test_a_held_release_lock_reads_held_by_its_holder_and_free_once_it_exits(where, tmp_path):
    base = tmp_path if where == "sandbox filesystem" else Path(f"/dev/shm/flatshare-test-lock-{os.getpid()}")
    state = base / "state"
    (state / "releases").mkdir(parents=True)
    try:
        with holding([str(REPO), str(state)]) as child:
            kernel = held_locks(child.pid)
            assert any("FLOCK" in line and "WRITE" in line for line in kernel.get(str(state), [])), kernel
            assert release_holder(state) == child.pid
            answer = probe(_context(state))
            assert answer["locked"] is True and f"pid {child.pid}" in answer["holder"]
            in_progress, _ = release_state(state / "releases")
            assert in_progress is not None and f"pid {child.pid}" in in_progress.summary
        assert release_holder(state) is None
        assert probe(_context(state))["locked"] is False
        assert release_state(state / "releases") == (None, None)
    finally:
        if where == "tmpfs":
            shutil.rmtree(base, ignore_errors=True)


#: Run in a mount namespace of its own (unshare -m): mount FILESYSTEM, hold the lock in a child, read it.
IN_NAMESPACE = r"""
import json, os, subprocess, sys
from pathlib import Path
repo, kind, scratch = sys.argv[1], sys.argv[2], Path(sys.argv[3])
sys.path.insert(0, repo)
from flatshare_ops.common.locks import held_by, lock_table_key, release_holder

def run(*argv):
    subprocess.run(argv, check=True, capture_output=True)

mnt = scratch / "mnt"
mnt.mkdir()
if kind == "overlayfs":
    # lower layer on this machine's filesystem, upper on a tmpfs, xino off: a file from the lower layer
    # has the lower layer's st_dev, the lock table the overlay's superblock device.
    lower, top = scratch / "lower", scratch / "top"
    (lower / "state/releases").mkdir(parents=True)
    (lower / "state/releases/.lock").touch()
    top.mkdir()
    run("mount", "-t", "tmpfs", "tmpfs", str(top))
    (top / "upper").mkdir(); (top / "work").mkdir()
    run("mount", "-t", "overlay", "overlay", "-o",
        f"lowerdir={lower},upperdir={top}/upper,workdir={top}/work,xino=off", str(mnt))
    state = mnt / "state"
elif kind == "xfs":
    # an xfs on a loop device (sparse: mkfs.xfs wants more than 300 MB); stat() and the lock table agree there
    image = scratch / "xfs.img"
    with open(image, "wb") as f:
        f.truncate(320 << 20)
    run("mkfs.xfs", "-q", str(image))
    run("mount", "-o", "loop", str(image), str(mnt))
    state = mnt / "state"
    (state / "releases").mkdir(parents=True)
else:
    # a btrfs on a loop device; the state directory in a subvolume, whose st_dev is its own
    image = scratch / "btrfs.img"
    with open(image, "wb") as f:
        f.truncate(128 << 20)
    run("mkfs.btrfs", "-q", str(image))
    run("mount", "-o", "loop", str(image), str(mnt))
    run("btrfs", "subvolume", "create", str(mnt / "sub"))
    state = mnt / "sub/state"
    (state / "releases").mkdir(parents=True)
holder = subprocess.Popen([sys.executable, "-c", sys.argv[4], repo, str(state)], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True)
assert holder.stdout.readline().strip() == "locked"

def stat_key(path):
    st = os.stat(path)
    return f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"

lock_file = state / "releases/.lock"
kernel = {}
for fd in os.listdir(f"/proc/{holder.pid}/fd"):
    info = Path(f"/proc/{holder.pid}/fdinfo/{fd}").read_text()
    if "lock:" in info:
        kernel[os.readlink(f"/proc/{holder.pid}/fd/{fd}")] = [l for l in info.splitlines() if l.startswith("lock:")]
answer = {"pid": holder.pid, "table": open("/proc/locks").read(), "kernel": kernel,
          "stat": {"state": stat_key(state), "lock": stat_key(lock_file)},
          "key": {"state": lock_table_key(state), "lock": lock_table_key(lock_file)},
          "release_holder": release_holder(state), "lock_file_holder": held_by(lock_file)}
holder.stdin.close()
holder.wait(10)
answer["after"] = release_holder(state)
print(json.dumps(answer))
"""


@pytest.mark.parametrize("kind", ["overlayfs", "btrfs", "xfs"])
def test_the_lock_reads_right_where_stat_and_the_lock_table_name_the_file_differently(kind, tmp_path):
    """On overlayfs (layers on two filesystems, xino off) a lower-layer file's ``st_dev`` is its layer's; on a
    btrfs subvolume every ``st_dev`` is the subvolume's: the lock table names the superblock's device. A
    reading by ``stat()`` says "free" there for a held lock; this one must find the holder. On xfs (a node's
    filesystem as often as ext4) the two agree, and the holder is found all the same."""
    if os.geteuid() != 0:
        pytest.skip("mounting a filesystem in a mount namespace needs root here")
    tool, package = {"btrfs": ("mkfs.btrfs", "btrfs-progs"), "xfs": ("mkfs.xfs", "xfsprogs")}.get(kind, (None, None))
    if tool and not shutil.which(tool):
        pytest.skip(f"{tool} is not installed (Debian's {package}; scripts/setup.sh installs it)")
    result = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable, "-c", IN_NAMESPACE,
                             str(REPO), kind, str(tmp_path), HOLDER], capture_output=True, text=True, timeout=120)
    if result.returncode != 0 and ("mount" in result.stderr or "unshare" in result.stderr):
        pytest.skip(f"this machine does not allow a {kind} mount here: {result.stderr.strip()[-300:]}")
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    if kind == "xfs":
        assert seen["stat"] == seen["key"] and seen["key"]["state"] in seen["table"]
    else:
        differing = "lock" if kind == "overlayfs" else "state"
        # The case is real: what stat() says is not how the kernel's table names the file, which it does name.
        assert seen["stat"][differing] != seen["key"][differing]
        assert seen["stat"][differing] not in seen["table"] and seen["key"][differing] in seen["table"]
    assert any(line for lines in seen["kernel"].values() for line in lines)  # the holder's own view: it locks
    assert seen["release_holder"] == seen["pid"]
    assert seen["lock_file_holder"] == seen["pid"]
    assert seen["after"] is None


# --- exclusive whatever happens to releases/ -------------------------------------------------------------


def _rename_lock_away(releases: Path) -> None:
    os.rename(releases / ".lock", releases / ".lock.away")


def _remove_lock(releases: Path) -> None:
    (releases / ".lock").unlink()


def _replace_lock(releases: Path) -> None:
    (releases / ".lock.new").write_bytes(b"")
    os.replace(releases / ".lock.new", releases / ".lock")


def _replace_lock_json(releases: Path) -> None:
    (releases / "lock.json").unlink()
    (releases / "lock.json").write_text(json.dumps({"host": "elsewhere", "pid": 1, "user": "nobody",
                                                    "release": "0" * 16, "started_at": 0}))


def _restore_releases_from_backup(releases: Path) -> None:
    backup = releases.with_name("releases.backup")
    shutil.copytree(releases, backup, symlinks=True)
    shutil.rmtree(releases)
    os.rename(backup, releases)


@pytest.mark.parametrize("interfere", [_rename_lock_away, _remove_lock, _replace_lock, _replace_lock_json,
                                       _restore_releases_from_backup])
def test_a_second_release_is_refused_whatever_was_done_to_the_files_of_releases(interfere, tmp_path):
    state = tmp_path / "state"
    (state / "releases").mkdir(parents=True)
    with holding([str(REPO), str(state)]) as child:
        interfere(state / "releases")
        with pytest.raises(Refused) as refused:
            with node_lock(_context(state), "second"):
                pytest.fail("a second process took the node's lock while another held it")
        assert f"pid {child.pid}" in str(refused.value)
        assert release_holder(state) == child.pid
        assert str(state) in held_locks(child.pid)  # the holder still holds the lock on the state directory


def test_a_switcher_from_before_the_state_directory_lock_and_a_new_one_exclude_each_other(tmp_path):
    from filelock import FileLock, Timeout

    state = tmp_path / "state"
    (state / "releases").mkdir(parents=True)
    with holding([str(state / "releases/.lock")], OLD_HOLDER) as old:
        with pytest.raises(Refused, match=f"pid {old.pid}"):
            with node_lock(_context(state), "new"):
                pytest.fail("a new switcher took the node while an old one held releases/.lock")
        assert release_holder(state) == old.pid  # readers see an old switcher too
    with holding([str(REPO), str(state)]):
        with pytest.raises(Timeout):
            FileLock(str(state / "releases/.lock")).acquire(timeout=0)  # what an old switcher does


def test_flatshare_node_lock_check_reads_a_childs_lock_here(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    result = subprocess.run([str(BIN / "flatshare-node"), "lock-check", "--node", "cyan", "--state-dir", str(state)],
                            capture_output=True, text=True, timeout=60)
    answer = json.loads(result.stdout)
    assert result.returncode == 0 and answer["ok"] is True, answer
    fstype = subprocess.run(["findmnt", "-n", "-o", "FSTYPE", "--target", str(state)], capture_output=True,
                            text=True, check=True).stdout.strip()
    assert answer["filesystem"] == fstype
    assert sorted(p.name for p in state.iterdir()) == []  # its scratch directory is gone


# --- the stress test: two releases at once on one node, the files of releases/ interfered with -----------


class SwitchMonitor(threading.Thread):
    """Samples /proc as fast as it can: which node-side switch processes of the node hold a lock on the lock's
    files (their descriptors of the state directory or of ``releases/.lock*`` with a ``lock:`` line in fdinfo),
    and which have the journal (``releases/switching.json`` or its temporary file) open."""

    def __init__(self, state: Path) -> None:
        super().__init__(daemon=True)
        self.spellings = {str(state).encode(), os.path.realpath(state).encode()}
        self.state = os.path.realpath(state)
        self.releases = os.path.join(self.state, "releases")
        self.stopping = threading.Event()
        self.samples = self.holding = 0
        self.holders_seen: set[int] = set()
        self.current: set[int] = set()  # the last sample's holders
        self.violations: list[str] = []

    def run(self) -> None:
        while not self.stopping.is_set():
            self.sample()
            time.sleep(0.002)

    def switches(self):
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"switch" in argv and self.spellings & set(argv):
                yield int(entry)

    @staticmethod
    def parent(pid: int) -> int | None:
        try:
            return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return None

    def sample(self) -> None:
        holders, writers = set(), set()
        found = set(self.switches())
        # A switch's forked child (a bounded helper: it shares the switch's open files, locks included) is that
        # switch, not another: each process counts as its topmost ancestor among the switch processes.
        root = {}
        for pid in found:
            top, seen = pid, {pid}
            while (up := self.parent(top)) in found and up not in seen:
                top = up
                seen.add(up)
            root[pid] = top
        for pid in found:
            try:
                fds = os.listdir(f"/proc/{pid}/fd")
            except OSError:
                continue
            for fd in fds:
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                path = target.removesuffix(" (deleted)")
                if path == self.state or path.startswith(self.releases + "/.lock"):
                    try:
                        if "lock:" in Path(f"/proc/{pid}/fdinfo/{fd}").read_text():
                            holders.add(root[pid])
                    except OSError:
                        pass
                name = os.path.basename(path)
                if os.path.dirname(path) == self.releases and (name == "switching.json"
                                                               or name.startswith(".switching.json.")):
                    writers.add(root[pid])
        self.samples += 1
        self.current = holders
        self.holding += bool(holders)
        self.holders_seen |= holders
        if len(holders) > 1:
            self.violations.append(f"switch processes {sorted(holders)} hold the node's lock at once")
        if len(writers) > 1:
            self.violations.append(f"switch processes {sorted(writers)} write the journal at once")


class Interferer(threading.Thread):
    """At random moments, does to the files of ``releases/`` what a person, a cleanup job or a restore might:
    renames the lock file away, removes it, replaces it, restores it from a copy, removes and recreates
    ``lock.json``. Counts what it did while a switch held the lock (the ``monitor``'s last sample)."""

    def __init__(self, releases: Path, monitor: SwitchMonitor, seed: int) -> None:
        super().__init__(daemon=True)
        self.releases, self.monitor, self.random = releases, monitor, random.Random(seed)
        self.stopping = threading.Event()
        self.done: list[str] = []
        self.during_switch = 0

    def run(self) -> None:
        actions = [self.rename_lock_away, self.remove_lock, self.replace_lock, self.restore_lock,
                   self.recreate_lock_json]
        n = 0
        while not self.stopping.wait(self.random.uniform(0.02, 0.4)):
            n += 1
            action = self.random.choice(actions)
            switching = bool(self.monitor.current)
            try:
                action(n)
            except OSError:
                continue  # the file was not there at that moment: nothing done
            self.done.append(action.__name__)
            self.during_switch += switching

    def rename_lock_away(self, n: int) -> None:
        os.rename(self.releases / ".lock", self.releases / f".lock.moved-{n}")

    def remove_lock(self, n: int) -> None:
        os.unlink(self.releases / ".lock")

    def replace_lock(self, n: int) -> None:
        (self.releases / f".lock.new-{n}").write_bytes(b"")
        os.replace(self.releases / f".lock.new-{n}", self.releases / ".lock")

    def restore_lock(self, n: int) -> None:
        backup = self.releases.parent / "lock-backup"
        if backup.exists():
            shutil.copy2(backup, self.releases / f".lock.restored-{n}")
            os.replace(self.releases / f".lock.restored-{n}", self.releases / ".lock")
        else:
            shutil.copy2(self.releases / ".lock", backup)

    def recreate_lock_json(self, n: int) -> None:
        path = self.releases / "lock.json"
        kept = path.read_bytes()
        path.unlink()
        time.sleep(self.random.uniform(0, 0.2))
        path.write_bytes(kept if n % 2 else b'{"host": "backup", "pid": 1}\n')


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    from release_fleet import sandbox_fleet

    with sandbox_fleet(tmp_path_factory, ADDRESSES) as f:
        yield f


def _switch_intervals(fleet, name: str) -> list[tuple[float, float, str]]:
    return sorted((r["started_at"], r["finished_at"], r.get("switch", "")) for r in fleet.history(name)
                  if isinstance(r.get("started_at"), (int, float)) and isinstance(r.get("finished_at"), (int, float)))


def test_two_releases_at_once_never_run_two_switches_whatever_happens_to_releases(fleet):
    """Rounds of two releases of cyan started at once (each round a new render), while the interferer works
    on releases/ and the monitor samples /proc: at most one switch ever holds the lock or writes the journal,
    and no two recorded switches overlap in time."""
    state = fleet.node("cyan").state_dir
    monitor = SwitchMonitor(state)
    interferer = Interferer(state / "releases", monitor, seed=20)
    before = len(fleet.history("cyan"))
    env = {k: v for k, v in os.environ.items() if k not in ("FLATSHARE_INVENTORY",)}
    env["FLATSHARE_NODE"] = "cyan"
    argv = [str(BIN / "flatshare"), "release", "--inventory", str(fleet.inventory), "--root", str(fleet.checkout)]
    monitor.start()
    interferer.start()
    outcomes = []
    try:
        running = int(fleet.hold("cyan"))  # whatever the operator's profile holds: six values other than it
        for value in [v for v in range(31, 38) if v != running][:6]:
            fleet.set_hold(value)
            releases = [subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                        for _ in range(2)]
            results = [(r.wait(240), r.stdout.read()) for r in releases]
            outcomes.append((sorted(code for code, _ in results), "\n".join(out for _, out in results)))
            assert fleet.hold("cyan") == str(value)  # the running engine's argv (/proc)
    finally:
        interferer.stopping.set()
        interferer.join(10)
        monitor.stopping.set()
        monitor.join(10)
        for leftover in [*(state / "releases").glob(".lock.*"), state / "lock-backup"]:
            leftover.unlink(missing_ok=True)
    assert not monitor.violations, monitor.violations[:5]
    for codes, output in outcomes:
        # one switched; the other was refused (the lock was held) or found nothing to do (it came after)
        assert codes in ([0, 3], [0, 4]), output
    assert len(monitor.holders_seen) >= 6 and monitor.holding > 20, (monitor.holders_seen, monitor.holding)
    assert interferer.during_switch >= 12, interferer.done  # the files were interfered with while switches ran
    raced = [codes for codes, _ in outcomes].count([0, 3])
    assert raced >= 3, outcomes  # most rounds raced for the lock while a switch held it
    intervals = _switch_intervals(fleet, "cyan")[before:]
    assert len(intervals) >= 6
    for (_, end, first), (start, _, second) in zip(intervals, intervals[1:]):
        assert start >= end, f"switches {first} and {second} overlap in time"
    fleet.settled("cyan")


def test_doctor_says_on_each_node_whether_the_lock_reading_works_there(fleet):
    result = subprocess.run([str(BIN / "flatshare"), "doctor", "--inventory", str(fleet.inventory), "--root",
                             str(fleet.checkout)], capture_output=True, text=True, timeout=120)
    for name in ("cyan", "peacock"):
        (line,) = [line for line in result.stdout.splitlines() if f" {name} lock reading:" in line]
        state = fleet.node(name).state_dir
        assert line.startswith("ok ") and str(state) in line, result.stdout
        assert not list(state.glob(".lock-check-*"))  # the child's scratch directory is gone


def test_doctor_says_whether_serving_checks_timer_runs_it_and_how_its_last_run_ended(fleet):
    # A breaker's kind: serving-check run by its timer failed on a node (a textfile it could not write) and
    # nothing the operator runs said so; doctor now reads the timer's runs as the node's systemd records them.
    import re

    from flatshare_ops.common.systemd import job, properties

    address = fleet.address("cyan")

    def doctor() -> str:
        done = subprocess.run([str(BIN / "flatshare"), "doctor", "--inventory", str(fleet.inventory), "--root",
                               str(fleet.checkout)], capture_output=True, text=True, timeout=120)
        return done.stdout

    def ended_run() -> tuple[dict, str] | None:
        """systemd's record of the last run and doctor's words, read while no run is under way (the timer may
        start one at any moment; its start clears the run before's exit), or None."""
        job(address, "start", "serving-check.service", 60)  # one run now, as the timer's
        got = properties(address, [("serving-check.service", "Service", "ExecMainStatus"),
                                   ("serving-check.timer", "Unit", "ActiveState")])
        said = doctor()
        return (got, said) if "serving-check is running now" not in said else None

    from flatshare_ops.common.poll import poll_until

    found = poll_until(ended_run, 300, 1.0)
    assert found, "serving-check was running each time doctor asked"
    got, said = found
    verdict = {0: "OK", 1: "WARNING", 2: "CRITICAL", 3: "UNKNOWN"}[got["serving-check.service/ExecMainStatus"]]
    assert got["serving-check.timer/ActiveState"] == "active", got
    line = re.search(r"^(\S+)\s+cyan serving-check: (.*)$", said, re.MULTILINE)
    assert line and line.group(2).startswith("serving-check.timer active; last run ") \
        and line.group(2).endswith(f"ago: {verdict}"), said
    assert line.group(1) == ("ok" if verdict in ("OK", "WARNING", "CRITICAL") else "WARN"), said
    # --json: one document on stdout, the same items as the lines (now on stderr), exit code inside it.
    done = subprocess.run([str(BIN / "flatshare"), "doctor", "--json", "--inventory", str(fleet.inventory), "--root",
                           str(fleet.checkout)], capture_output=True, text=True, timeout=120)
    document = json.loads(done.stdout)
    assert document["code"] == done.returncode
    assert [f"{i['state']:5} {i['item']}: {i['detail']}" for i in document["items"]] == done.stderr.splitlines()
    assert {"state": "ok", "item": "cyan serving-check"}.items() <= next(
        i for i in document["items"] if i["item"] == "cyan serving-check").items()
    try:
        job(address, "stop", "serving-check.timer", 30)
        said = doctor()
        assert re.search(r"^WARN\s+cyan serving-check: serving-check.timer is inactive: nothing runs serving-check",
                         said, re.MULTILINE), said
        assert re.search(r"^ok\s+peacock serving-check: serving-check.timer active", said, re.MULTILINE), said
    finally:
        job(address, "start", "serving-check.timer", 30)
