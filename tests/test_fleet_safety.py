"""One node always takes calls, whoever releases at once, and the operator is always told the truth.

Everything here runs on the real sandbox fleet (two systemd user managers, two
sshd, the stand-in engine, gateway and voice worker) on this file's own
loopback addresses. The truth each test checks is independent of what the tool
prints: the gateways' ``GET /health``, the voice drain files, systemd's
ActiveState over D-Bus, the nodes' ``history.jsonl`` and ``release.log``, the
kernel's lock table and the processes in ``/proc``.

Every test leaves the fleet serving: no journal, no drain file, serving-check OK.
"""

from __future__ import annotations

import calendar
import http.client
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import tomllib
import urllib.request
import contextlib
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import BIN, REPO, faults, loopback_pair, scratch_sandbox
from node_processes import cmdline, pids, ppid, switch_pids

from flatshare_ops.check.run import run_checks
from flatshare_ops.common.locks import held_by
from flatshare_ops.control.bundle import bundle
from flatshare_ops.control.targets import targets
from flatshare_ops.sandbox.engine_behaviour import Behaviour
from flatshare_ops.sandbox.fleet import SandboxNode
from flatshare_ops.common.systemd import ManagerAddress, connect, run_job, unit_property

ADDRESSES = loopback_pair(61)
OTHER_HOST = ADDRESSES["cyan"].rsplit(".", 1)[0] + ".9"  # in known_hosts lines for a host that is not in the fleet
NODES = ("cyan", "peacock")
ENGINE = "flatshare-engine.service"
GATEWAY = "flatshare-gateway.service"
VOICE = "flatshare-voice.service"
HOLD_FLAG = "--additional-config.make_room.decode_hold_tokens"
STEP = r"step \d+/\d+ "
#: Groups of this module's tests that run apart (tests/conftest.py, "parallel test processes"), each on a
#: fleet of its own: the race, the stalled and killed sessions, the signals and holds during a switch; the
#: rest is the module's own group.
RACE = pytest.mark.xdist_group("test_fleet_safety_race")
SESSIONS = pytest.mark.xdist_group("test_fleet_safety_sessions")
SIGNALS = pytest.mark.xdist_group("test_fleet_safety_signals")
#: Exit codes a release or rollback may end with when nothing went wrong (README "Exit codes"); 1 needs
#: a recorded reason on the node.
DOCUMENTED = {0, 3, 4}


# --- processes -------------------------------------------------------------------------------------


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def _signal(pid: int | None, sig: int) -> None:
    if pid:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _poll(check, timeout_s: float, interval_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(interval_s)


def _http_status(url: str, method: str = "GET", timeout_s: float = 2.0) -> int | None:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method=method, data=b"" if method == "POST" else None),
                                    timeout=timeout_s) as answer:
            return answer.status
    except urllib.error.HTTPError as err:
        return err.code
    except OSError:
        return None


def _serving_status_line(name: str, release: str, text: str) -> bool:
    """``flatshare status`` says NAME runs RELEASE and each of its four units is active."""
    match = re.search(rf"^{name}: release {release}; (.*)$", text, re.MULTILINE)
    units = ("flatshare.target", "flatshare-engine.service", "flatshare-gateway.service", "flatshare-voice.service")
    return match is not None and all(f"{u} active" in match.group(1) for u in units)


def _no_traceback(*texts: str) -> None:
    for text in texts:
        assert "Traceback" not in (text or ""), text


def _stamp(t: float) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(t)) + f".{int((t % 1) * 1000):03d}Z"


# --- the fleet ---------------------------------------------------------------------------------------


class Fleet:
    """This file's checkout and sandbox, and what the tests read of them."""

    _fresh: int  # the last hold value rendered fresh (set at the first render; see below)

    def __init__(self, checkout: Path, base: Path) -> None:
        self.checkout, self.base = checkout, base
        self.inventory = base / "fleet.toml"
        profile = tomllib.loads((checkout / "profiles/rtx-5060-ti-serve.toml").read_text())
        self.hold_value = profile["engine"]["make_room"]["decode_hold_tokens"]

    # -- where things are
    def node(self, name: str) -> SandboxNode:
        return SandboxNode(name, ADDRESSES[name], self.base)

    def address(self, name: str) -> ManagerAddress:
        return ManagerAddress("user", self.node(name).manager.runtime_dir)

    def releases(self, name: str) -> Path:
        return self.node(name).state_dir / "releases"

    def journal(self, name: str) -> Path:
        return self.releases(name) / "switching.json"

    def drain_file(self, name: str) -> Path:
        return self.node(name).run_dir / "voice.drain"

    def log(self, name: str) -> Path:
        return self.releases(name) / "release.log"

    def log_size(self, name: str) -> int:
        return self.log(name).stat().st_size if self.log(name).exists() else 0

    def log_since(self, name: str, offset: int) -> str:
        return self.log(name).read_bytes()[offset:].decode(errors="replace") if self.log(name).exists() else ""

    def sandbox_state(self) -> dict:
        return json.loads((self.base / "state.json").read_text())["nodes"]

    # -- commands
    def cli(self, *args: str, env: dict | None = None, timeout: float = 240, program: str = "flatshare"):
        clean = {k: v for k, v in os.environ.items() if k not in ("FLATSHARE_NODE", "FLATSHARE_INVENTORY")}
        return subprocess.run([str(BIN / program), *args], capture_output=True, text=True,
                              env={**clean, **(env or {})}, timeout=timeout, check=False)

    def argv(self, kind: str, name: str, inventory: Path | None = None, *extra: str) -> tuple[list[str], dict]:
        """(argv, extra env) of ``release --node NAME``, a local release on NAME, or ``rollback --node NAME``."""
        inv = ["--inventory", str(inventory or self.inventory), "--root", str(self.checkout)]
        if kind == "release":
            return [str(BIN / "flatshare"), "release", "--node", name, *inv, *extra], {}
        if kind == "local-release":
            return [str(BIN / "flatshare"), "release", *inv, *extra], {"FLATSHARE_NODE": name}
        if kind == "rollback":
            return [str(BIN / "flatshare"), "rollback", "--node", name, *inv, *extra], {}
        raise ValueError(kind)

    def release(self, *args: str, inventory: Path | None = None, env: dict | None = None, timeout: float = 240):
        return self.cli("release", "--inventory", str(inventory or self.inventory), "--root", str(self.checkout),
                        *args, env=env, timeout=timeout)

    def rollback(self, *args: str, inventory: Path | None = None, timeout: float = 240):
        return self.cli("rollback", "--inventory", str(inventory or self.inventory), "--root", str(self.checkout),
                        *args, timeout=timeout)

    def popen(self, argv: list[str], env: dict | None = None, new_session: bool = False) -> subprocess.Popen:
        clean = {k: v for k, v in os.environ.items() if k not in ("FLATSHARE_NODE", "FLATSHARE_INVENTORY")}
        return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**clean, **(env or {})}, start_new_session=new_session)

    # -- the checkout and the nodes' profiles
    def set_hold(self, value: int) -> None:
        result = self.cli("profiles", "set", "engine.make_room.decode_hold_tokens", str(value),
                          "--root", str(self.checkout))
        assert result.returncode == 0, result.stdout + result.stderr
        self.hold_value = value

    def hold(self, name: str) -> int:
        """decode_hold_tokens in the node's running engine's command line."""
        argv = self.engine_argv(name)
        return int(argv[argv.index(HOLD_FLAG) + 1])

    def new_hold(self, *names: str) -> None:
        """Change the checkout's profile so that each of these nodes has something to release."""
        # A value never asked for before in this module: a release that failed and was taken back is refused
        # until --retry (control/rollout.py), so no test may render one an earlier test saw fail.
        running = {self.hold(n) for n in names or NODES}
        Fleet._fresh = getattr(Fleet, "_fresh", 100)
        value = next(v for v in range(Fleet._fresh + 1, Fleet._fresh + 10) if v not in running)
        Fleet._fresh = value
        self.set_hold(value)

    @contextmanager
    def node_profile(self, names, load: str | None = None, start_timeout: int | None = None):
        """The stand-in engine's load time and the start budget in the nodes' own profiles, restored after."""
        names = [names] if isinstance(names, str) else list(names)
        originals = {n: self.node(n).profile.read_text() for n in names}
        try:
            for n, text in originals.items():
                if load is not None:
                    text = re.sub(r'FLATSHARE_STANDIN_LOAD_S = "[^"]*"', f'FLATSHARE_STANDIN_LOAD_S = "{load}"', text)
                if start_timeout is not None:
                    text = re.sub(r"(?m)^start_timeout_s = .*$", f"start_timeout_s = {start_timeout}", text)
                self.node(n).profile.write_text(text)
            yield
        finally:
            for n, text in originals.items():
                self.node(n).profile.write_text(text)

    def variant(self, label: str, transport: dict | None = None, nodes: dict[str, dict] | None = None) -> Path:
        """A copy of the inventory beside it (paths in it stay valid) with a [transport] table and node overrides."""
        data = tomllib.loads(self.inventory.read_text())
        lines = ["schema = 1", ""]
        if transport:
            lines += ["[transport]", *(f"{k} = {json.dumps(v)}" for k, v in transport.items()), ""]
        for name, node in data["nodes"].items():
            node = {**node, **(nodes or {}).get(name, {})}
            lines += [f"[nodes.{name}]", *(f"{k} = {json.dumps(v)}" for k, v in node.items()), ""]
        path = self.base / f"fleet-{label}.toml"
        path.write_text("\n".join(lines))
        return path

    # -- truth
    def expected_id(self, name: str) -> str:
        (target,) = targets(self.inventory, [name], False)
        return bundle(self.checkout, target)["id"]

    def current(self, name: str) -> str:
        return os.readlink(self.releases(name) / "current")

    def history(self, name: str) -> list[dict]:
        path = self.releases(name) / "history.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []

    def unit_state(self, name: str, unit: str) -> str:
        with connect(self.address(name)) as bus:
            state = unit_property(bus, unit, "Unit", "ActiveState")
        return state.decode() if isinstance(state, bytes) else state

    def engine_argv(self, name: str) -> list[str]:
        with connect(self.address(name)) as bus:
            pid = unit_property(bus, ENGINE, "Service", "MainPID")
        return cmdline(pid)

    def engine_invocation(self, name: str) -> bytes:
        """The engine unit's InvocationID, from systemd (it changes at every start)."""
        with connect(self.address(name)) as bus:
            return bytes(unit_property(bus, ENGINE, "Unit", "InvocationID"))

    def engine_health(self, name: str) -> int | None:
        return _http_status(f"http://{ADDRESSES[name]}:8000/health")

    def lock_holder(self, name: str) -> int | None:
        return held_by(self.releases(name) / ".lock")

    def check_ok(self, name: str) -> None:
        report = run_checks(self.node(name).state_dir, name, self.node(name).manager.runtime_dir)
        assert report.status == "OK", [(f.check, f.status, f.summary, f.details) for f in report.findings]

    def settled(self, name: str) -> None:
        """As every test leaves a node: no journal, no drain file, no lock held, serving-check OK."""
        assert _poll(lambda: self.lock_holder(name) is None, 60), f"{name}: a release still holds the lock"
        assert not self.journal(name).exists(), self.journal(name).read_text()
        assert not self.drain_file(name).exists()
        self.check_ok(name)

    def wait_log(self, name: str, offset: int, pattern: str, operator: subprocess.Popen | None = None,
                 timeout_s: float = 90) -> str:
        """Wait until the node's release.log (past ``offset``) shows ``pattern``; fail with the operator's output
        if it ends first."""
        found = _poll(lambda: re.search(pattern, self.log_since(name, offset), re.MULTILINE)
                      or (operator is not None and operator.poll() is not None), timeout_s, 0.02)
        if not isinstance(found, re.Match):
            said = ""
            if operator is not None:
                if operator.poll() is None:
                    operator.kill()
                said = operator.communicate()[0]
            pytest.fail(f"{name}: release.log never showed {pattern!r}:\n{self.log_since(name, offset)}\n"
                        f"the operator said:\n{said}")
        return found.group(0)

    # -- processes on the node
    def switch_pids(self, name: str) -> list[int]:
        """The node-side switch processes of this node (tests/node_processes.py)."""
        return switch_pids(self.node(name).state_dir)

    def session_pid(self, name: str) -> int:
        """The node's sshd session process running its release: a child of the node's sshd listener, an ancestor
        of the node-side switch."""
        listener = self.sandbox_state()[name]["sshd_pid"]
        switches = self.switch_pids(name)
        assert len(switches) == 1, f"{name}: node-side switch processes {switches}"
        (switch,) = switches
        pid = switch
        while pid and ppid(pid) not in (listener, None, 0, 1):
            pid = ppid(pid) or 0  # gone meanwhile: the walk ends, and the assertion names the switch
        assert ppid(pid) == listener, f"switch {switch} is not under {name}'s sshd listener {listener}"
        argv = " ".join(cmdline(pid))
        assert "sshd" in argv and pid != listener, argv
        return pid


def run_at_once(fleet: Fleet, commands: dict[str, tuple[list[str], str]], timeout: float = 120) -> dict:
    """Run independent commands at once (key -> (args, program)); key -> CompletedProcess."""
    results: dict = {}
    threads = [threading.Thread(target=lambda k=k, a=a, p=p: results.__setitem__(
        k, fleet.cli(*a, program=p, timeout=timeout))) for k, (a, p) in commands.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    def snapshot_switcher(checkout: Path) -> None:
        # The checkout's own flatshare_ops is the switcher a release ships (control/bundle.py): a snapshot, so
        # that every release of this module ships the same switcher.
        shutil.copytree(REPO / "flatshare_ops", checkout / "flatshare_ops",
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))

    with scratch_sandbox(tmp_path_factory, "safety", ADDRESSES, prepare=snapshot_switcher) as (_, checkout, base):
        yield Fleet(checkout, base)


# --- the monitor: does a node take calls? ----------------------------------------------------------------


class CallsMonitor(threading.Thread):
    """Samples both gateways' ``GET /health`` and both voice drain files every ``period_s``.

    A node takes calls when its gateway answers 200 and its drain file is absent.
    """

    def __init__(self, fleet: Fleet, period_s: float = 0.01) -> None:
        super().__init__(daemon=True)
        self.targets = [(n, ADDRESSES[n], fleet.drain_file(n)) for n in NODES]
        self.period_s = period_s
        self.samples: list[tuple[float, dict[str, tuple[bool, str]]]] = []
        self.max_gap_s = 0.0
        self._halt = threading.Event()

    @staticmethod
    def takes_calls(address: str, drain_file: Path) -> tuple[bool, str]:
        try:
            # A caller waits a few seconds for an answer: a gateway slow to answer on a loaded machine still
            # takes calls (one that never answers, hung, is still found out).
            conn = http.client.HTTPConnection(address, 8080, timeout=5.0)
            conn.request("GET", "/health", headers={"Connection": "close"})
            status = conn.getresponse().status
            conn.close()
        except OSError as err:
            return False, f"gateway: {type(err).__name__}"
        if status != 200:
            return False, f"gateway answered {status}"
        if drain_file.exists():
            return False, "voice.drain present"
        return True, ""

    def run(self) -> None:
        last = None
        while not self._halt.is_set():
            t = time.time()
            self.samples.append((t, {n: self.takes_calls(a, d) for n, a, d in self.targets}))
            if last is not None:
                self.max_gap_s = max(self.max_gap_s, t - last)
            last = t
            self._halt.wait(max(0.0, self.period_s - (time.time() - t)))

    def stop(self) -> None:
        self._halt.set()
        self.join(10)

    def nobody_serving(self) -> list[str]:
        return [f"{_stamp(t)}: " + ", ".join(f"{n} {why}" for n, (_, why) in state.items())
                for t, state in self.samples if not any(ok for ok, _ in state.values())]


_LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ) (.*)$")


def drain_intervals(log_text: str) -> tuple[list[tuple[int, int]], list[str]]:
    """(each drain's [start, end] in UTC seconds: the drain-voice step's start to the end of the voice drain
    (end-voice-drain done, or an early end), problems such as a drain never ended)."""
    intervals, problems, start = [], [], None
    for line in log_text.splitlines():
        match = _LOG_LINE.match(line)
        if not match:
            continue
        t = calendar.timegm(time.strptime(match.group(1), "%Y-%m-%dT%H:%M:%SZ"))
        text = match.group(2)
        if re.fullmatch(STEP + "drain-voice", text):
            if start is not None:
                problems.append(f"a drain began at {match.group(1)} while the one from {start} had not ended")
            start = t
        elif start is not None and (text == "  voice worker takes calls again"
                                    or text.startswith("  voice drain ended early")
                                    or (text.startswith("flatshare: ") and " failed: " in text)):
            intervals.append((start, t))
            start = None
    if start is not None:
        problems.append(f"a drain that began at {start} never ended in release.log")
    return intervals, problems


def overlaps(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple]:
    return [(x, y) for x in a for y in b if x[0] < y[1] and y[0] < x[1]]


# =====================================================================================================
# 5. known_hosts read as OpenSSH reads it
# =====================================================================================================


def _other_key(tmp: Path) -> tuple[str, str]:
    key = tmp / "other_host_key"
    if not key.exists():
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "other", "-f", str(key)], check=True)
    kind, blob = key.with_suffix(".pub").read_text().split()[:2]
    return kind, blob


def _known_hosts_lines(fleet: Fleet) -> dict[str, str]:
    lines = {}
    for line in (fleet.base / "ssh/known_hosts").read_text().splitlines():
        host = line.split()[0]
        lines[next(n for n, a in ADDRESSES.items() if f"[{a}]" in host)] = line
    return lines


def _hashed(line: str, tmp: Path) -> str:
    path = tmp / "to_hash"
    path.write_text(line + "\n")
    subprocess.run(["ssh-keygen", "-q", "-H", "-f", str(path)], check=True, capture_output=True)
    (hashed,) = [x for x in path.read_text().splitlines() if x.strip() and not x.startswith("#")]
    assert hashed.startswith("|1|"), hashed
    return hashed


def _known_hosts_form(form: str, fleet: Fleet, tmp: Path) -> list[str]:
    good = _known_hosts_lines(fleet)
    kind, other = _other_key(tmp)
    truncated = other[: (len(other) // 2) // 4 * 4]  # still base64, but the key blob is cut short
    forms = {
        "truncated key for another host": [f"[{OTHER_HOST}]:2222 {kind} {truncated}", f"other.example {kind} {other[:-7]}"],
        "@revoked for another host's key": [f"@revoked [{OTHER_HOST}]:2222 {kind} {other}"],
        "@cert-authority": [f"@cert-authority *.example.org,[{ADDRESSES['cyan']}]:2222 {kind} {other}"],
        "garbage": ["garbage", "this is not a known_hosts line", "@@@ ]] ssh-ed25519 ???", "\t  |1|x|y ssh-ed25519"],
        "hashed hostname for the target": [_hashed(good["cyan"], tmp)],
    }
    lines = forms[form]
    if form == "hashed hostname for the target":
        return ["# hashed by ssh-keygen -H", *lines, good["peacock"]]
    return [*lines, good["cyan"], good["peacock"]]


KNOWN_HOSTS_FORMS = ["truncated key for another host", "@revoked for another host's key", "@cert-authority",
                     "garbage", "hashed hostname for the target"]


@pytest.mark.parametrize("form", KNOWN_HOSTS_FORMS)
def test_known_hosts_lines_openssh_skips_or_handles_never_stop_a_good_connection(fleet, tmp_path, form):
    (fleet.base / "ssh/known_hosts-variant").write_text("\n".join(_known_hosts_form(form, fleet, tmp_path)) + "\n")
    inventory = fleet.variant("known-hosts", nodes={n: {"known_hosts": "ssh/known_hosts-variant"} for n in NODES})

    before = fleet.current("cyan")
    results = run_at_once(fleet, {
        "status": (["status", "--inventory", str(inventory)], "flatshare"),
        "check": (["check", "--node", "cyan", "--inventory", str(inventory)], "flatshare"),
        # A release connects (a dry run: it reaches the node's side and plans, changing nothing).
        "release": (["release", "--node", "cyan", "--dry-run", "--inventory", str(inventory),
                     "--root", str(fleet.checkout)], "flatshare"),
    })
    status, check, release = results["status"], results["check"], results["release"]
    assert status.returncode == 0, status.stdout + status.stderr
    for name in NODES:
        assert re.search(rf"^{name}: release {fleet.current(name)};", status.stdout, re.MULTILINE), status.stdout
    assert check.returncode == 0, check.stdout + check.stderr
    assert check.stdout.startswith("SERVING-CHECK OK - cyan"), check.stdout
    assert release.returncode in (0, 4), release.stdout + release.stderr
    assert re.search(r"^\[cyan [0-9:]+\] (plan for cyan|cyan: already on)", release.stdout, re.MULTILINE), release.stdout
    assert fleet.current("cyan") == before
    _no_traceback(status.stdout, status.stderr, check.stdout, check.stderr, release.stdout, release.stderr)


def test_a_revoked_target_key_is_refused_by_name(fleet):
    good = _known_hosts_lines(fleet)
    kind, blob = good["cyan"].split()[1:3]
    (fleet.base / "ssh/known_hosts-revoked").write_text(
        f"{good['cyan']}\n@revoked [{ADDRESSES['cyan']}]:2222 {kind} {blob}\n{good['peacock']}\n")
    inventory = fleet.variant("revoked", nodes={n: {"known_hosts": "ssh/known_hosts-revoked"} for n in NODES})
    before = fleet.current("cyan")

    status = fleet.cli("status", "--node", "cyan", "--inventory", str(inventory))
    assert status.returncode == 6 and re.search(r"^cyan: UNKNOWN: .*revoked", status.stdout, re.MULTILINE), status.stdout
    check = fleet.cli("check", "--node", "cyan", "--inventory", str(inventory))
    assert check.returncode == 6 and "revoked" in check.stdout, check.stdout  # unreachable, as every command says it
    fleet.new_hold("cyan")
    release = fleet.release("--node", "cyan", inventory=inventory)
    assert release.returncode == 6, release.stdout + release.stderr
    assert "revoked" in release.stdout and "refusing to connect" in release.stdout, release.stdout
    assert fleet.current("cyan") == before
    _no_traceback(status.stdout, status.stderr, check.stdout, check.stderr, release.stdout, release.stderr)
    fleet.settled("cyan")


# =====================================================================================================
# 7. Fleet answers with one node unreachable
# =====================================================================================================


def _assert_fleet_answers(fleet: Fleet, inventory: Path, reason: str) -> None:
    """check --all, status and releases: a line (or block) per node, peacock UNKNOWN by name, cyan in full."""
    check = fleet.cli("check", "--all", "--inventory", str(inventory), timeout=90)
    status = fleet.cli("status", "--inventory", str(inventory), timeout=90)
    history = fleet.cli("releases", "--inventory", str(inventory), timeout=90)
    _no_traceback(check.stdout, check.stderr, status.stdout, status.stderr, history.stdout, history.stderr)

    heads = [line for line in check.stdout.splitlines() if line.startswith("SERVING-CHECK ")]
    assert [h.split(" - ")[1].split(":")[0] for h in heads] == ["cyan", "peacock"], check.stdout
    assert heads[0].startswith("SERVING-CHECK OK - cyan"), check.stdout
    assert heads[1].startswith("SERVING-CHECK UNKNOWN - peacock") and reason in heads[1], check.stdout
    assert check.returncode == 6  # a node could not be asked: Exit.UNREACHABLE, as status, releases and hold say

    lines = status.stdout.splitlines()
    assert len([line for line in lines if re.match(r"^(cyan|peacock): ", line)]) == 2, status.stdout
    assert _serving_status_line("cyan", fleet.current("cyan"), status.stdout), status.stdout
    assert re.search(rf"^peacock: UNKNOWN: peacock: .*{re.escape(reason)}", status.stdout, re.MULTILINE), status.stdout
    assert status.returncode == 6

    lock = fleet.cli("hold", "status", "--inventory", str(inventory), timeout=90)
    assert re.search(r"^peacock: UNKNOWN: ", lock.stdout, re.MULTILINE) and "cyan: not held" in lock.stdout, lock.stdout
    assert lock.returncode == 6, lock.stdout + lock.stderr  # "not held" is not known of an unreachable node

    text = history.stdout
    assert text.index("cyan:\n") < text.index("peacock:\n"), text
    cyan_part, peacock_part = text.split("peacock:\n")
    last = fleet.history("cyan")[-1]
    assert f"{last['before'] or '(none)'} -> {last['target']}: {last['result']}" in cyan_part, text
    assert re.fullmatch(rf"  UNKNOWN: peacock: .*{re.escape(reason)}.*\n", peacock_part), text
    assert history.returncode == 6, text


@contextmanager
def _stopped(pid: int):
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def test_fleet_commands_report_a_node_on_a_closed_port_by_name_and_the_other_in_full(fleet):
    inventory = fleet.variant("closed", nodes={"peacock": {"port": 2299}})
    _assert_fleet_answers(fleet, inventory, f"cannot reach [{ADDRESSES['peacock']}]:2299")
    fleet.settled("peacock")


def test_fleet_commands_report_a_node_whose_sshd_is_stopped_by_name_and_the_other_in_full(fleet):
    inventory = fleet.variant("stopped-sshd", transport={"connect_timeout_s": 3})
    with _stopped(fleet.sandbox_state()["peacock"]["sshd_pid"]):
        _assert_fleet_answers(fleet, inventory, f"no SSH handshake with [{ADDRESSES['peacock']}]:2222 within 3 s")
    fleet.settled("peacock")


def test_a_release_whose_other_node_has_a_stopped_sshd_is_refused_and_told_so(fleet):
    inventory = fleet.variant("stopped-sshd", transport={"connect_timeout_s": 3})
    fleet.new_hold("cyan")
    before = fleet.current("cyan")
    offset = fleet.log_size("cyan")
    with _stopped(fleet.sandbox_state()["peacock"]["sshd_pid"]):
        result = fleet.release("--node", "cyan", inventory=inventory, timeout=120)
    fleet.wait_log("cyan", offset, r"release refused: cyan may not drain now")
    assert fleet.current("cyan") == before
    fleet.settled("cyan")
    _no_traceback(result.stdout, result.stderr)
    assert re.search(rf"^peacock: UNKNOWN: peacock: no SSH handshake with \[{re.escape(ADDRESSES['peacock'])}\]:2222 within 3 s",
                     result.stdout, re.MULTILINE), result.stdout
    assert result.returncode == 3, result.stdout + result.stderr
    assert "cyan may not drain now" in result.stdout


# =====================================================================================================
# 6. A hung and a frozen systemd manager
# =====================================================================================================


class HungManager:
    """A unix socket where a manager's private socket would be: it accepts and never answers."""

    def __init__(self) -> None:
        self.runtime_dir = Path(tempfile.mkdtemp(prefix="fs-hung-", dir="/tmp"))
        (self.runtime_dir / "systemd").mkdir()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(self.runtime_dir / "systemd/private"))
        self.sock.listen(64)
        self.sock.settimeout(0.2)
        self.accepted: list[socket.socket] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.done.is_set():
            try:
                conn, _ = self.sock.accept()
                self.accepted.append(conn)  # kept open, never read, never answered
            except TimeoutError:
                continue
            except OSError:
                return

    def close(self) -> None:
        self.done.set()
        self.thread.join(5)
        for conn in self.accepted:
            conn.close()
        self.sock.close()
        shutil.rmtree(self.runtime_dir, ignore_errors=True)


@contextmanager
def _unanswering_manager(fleet: Fleet, how: str):
    """(the runtime dir serving-check is pointed at, an inventory whose cyan has that manager)."""
    if how == "hung socket":
        hung = HungManager()
        try:
            yield hung.runtime_dir, fleet.variant("hung", nodes={"cyan": {"runtime_dir": str(hung.runtime_dir)}})
        finally:
            hung.close()
        return
    manager = fleet.sandbox_state()["cyan"]["manager_pid"]
    os.kill(manager, signal.SIGSTOP)
    try:
        yield fleet.node("cyan").manager.runtime_dir, fleet.inventory
    finally:
        os.kill(manager, signal.SIGCONT)


@pytest.mark.parametrize("how", ["hung socket", "stopped manager"])
def test_a_manager_that_never_answers_is_unknown_within_the_bounds(fleet, tmp_path, how):
    textfile = tmp_path / "textfile"
    textfile.mkdir()
    with _unanswering_manager(fleet, how) as (runtime_dir, inventory):
        # The three at once (each waits out the same 5 s bound).
        commands = {
            "direct": (["--json", "--textfile", str(textfile), "--deadline", "10",
                        "--state-dir", str(fleet.node("cyan").state_dir), "--runtime-dir", str(runtime_dir),
                        "--node-name", "cyan"], "serving-check"),
            "check": (["check", "--node", "cyan", "--node", "peacock", "--inventory", str(inventory)], "flatshare"),
            "status": (["status", "--inventory", str(inventory)], "flatshare"),
        }
        results = run_at_once(fleet, commands)
    direct, check_all, status = results["direct"], results["check"], results["status"]
    _no_traceback(*(r.stdout + r.stderr for r in (direct, check_all, status)))

    assert direct.returncode == 3, direct.stdout + direct.stderr
    report = json.loads(direct.stdout)
    systemd_findings = [f for f in report["findings"] if f["check"] == "systemd"]
    assert systemd_findings and systemd_findings[0]["status"] == "UNKNOWN", report
    assert "within 5 s" in systemd_findings[0]["summary"], report
    prom = (textfile / "serving_check.prom").read_text()
    assert 'flatshare_serving_check_status{node="cyan",check="systemd"} 3' in prom, prom

    assert check_all.returncode == 3, check_all.stdout
    heads = [line for line in check_all.stdout.splitlines() if line.startswith("SERVING-CHECK ")]
    assert len(heads) == 2, check_all.stdout
    assert heads[0].startswith("SERVING-CHECK UNKNOWN - cyan:") and "within 5 s" in heads[0], check_all.stdout
    assert heads[1].startswith("SERVING-CHECK OK - peacock:"), check_all.stdout

    lines = [line for line in status.stdout.splitlines() if re.match(r"^(cyan|peacock): ", line)]
    assert len(lines) == 2, status.stdout
    assert re.match(rf"^cyan: release {fleet.current('cyan')}; units unknown \(.*within 5 s", lines[0]), status.stdout
    assert _serving_status_line("peacock", fleet.current("peacock"), status.stdout), status.stdout
    for name in NODES:
        fleet.settled(name)


# =====================================================================================================
# 1. Concurrent releases and rollbacks on both nodes, watched every 10 ms
# =====================================================================================================

ROUNDS = 12
#: Values of decode_hold_tokens the rounds go through: 48 and 0 alternate; the third one makes sure a node
#: refused in one round still has something to release in the next.
HOLDS = (0, 48, 16)
KINDS = ("release", "local-release", "rollback")


def _round_commands(rng: random.Random) -> list[tuple[str, str]]:
    """Releases over SSH, local releases and rollbacks on both nodes (each node at least once)."""
    commands = [(rng.choice(KINDS[:2]), "cyan"), (rng.choice(KINDS[:2]), "peacock")]
    for _ in range(rng.randint(1, 3)):
        commands.append((rng.choice(KINDS), rng.choice(NODES)))
    rng.shuffle(commands)
    return commands


def _run_at_once(fleet: Fleet, commands: list[tuple[str, str]], rng: random.Random) -> list[dict]:
    runs = [{"kind": kind, "node": node, "jitter": rng.uniform(0.0, 1.0)} for kind, node in commands]

    def one(run: dict) -> None:
        time.sleep(run["jitter"])
        argv, env = fleet.argv(run["kind"], run["node"])
        run["started"] = time.time()
        try:
            run["result"] = fleet.cli(*argv[1:], env=env, timeout=240)
        except subprocess.TimeoutExpired as err:
            run["result"] = err
        run["ended"] = time.time()

    threads = [threading.Thread(target=one, args=(run,)) for run in runs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return runs


@RACE
def test_concurrent_releases_and_rollbacks_always_leave_a_node_taking_calls(fleet):
    seed = int(os.environ.get("FLEET_SAFETY_SEED", "20261130"))
    rng = random.Random(seed)
    history_lengths = {n: len(fleet.history(n)) for n in NODES}
    monitor = CallsMonitor(fleet)
    problems: list[str] = []
    summary: list[str] = []
    # A 2.5 s engine load: a switch's drain lasts seconds, so racing releases would overlap if let through.
    with fleet.node_profile(NODES, load="2.5"):
        # Both nodes on the slower engine first, released over SSH (so a release of theirs names the shipped
        # switcher: see test_a_switcher_in_use_is_not_pruned_by_another_switch).
        fleet.set_hold(HOLDS[-1])
        seed_release = fleet.release("--all")
        assert seed_release.returncode in (0, 4), seed_release.stdout + seed_release.stderr
        offsets = {n: fleet.log_size(n) for n in NODES}
        monitor.start()
        try:
            for number in range(ROUNDS):
                fleet.set_hold(HOLDS[number % len(HOLDS)])
                began = time.time()
                runs = _run_at_once(fleet, _round_commands(rng), rng)
                for run in runs:
                    result = run["result"]
                    what = f"round {number} {run['kind']} {run['node']}"
                    if isinstance(result, subprocess.TimeoutExpired):
                        problems.append(f"{what}: still running after 240 s")
                        continue
                    summary.append(f"{what}: exit {result.returncode}")
                    output = result.stdout + result.stderr
                    if "Traceback" in output:
                        problems.append(f"{what}: traceback:\n{output}")
                    if result.returncode == 1:
                        failed = [r for r in fleet.history(run["node"])
                                  if r.get("result") == "failed" and r.get("finished_at", 0) >= began]
                        if not failed or not failed[-1].get("reason"):
                            problems.append(f"{what}: exit 1 without a recorded reason:\n{output}")
                    elif result.returncode not in DOCUMENTED:
                        problems.append(f"{what}: exit {result.returncode}:\n{output}")
                assert not problems, "\n".join(problems)
                for name in NODES:
                    if fleet.journal(name).exists():  # an exit 1 with its reason: the next release finishes it
                        finish = fleet.release("--node", name)
                        assert finish.returncode == 0, finish.stdout + finish.stderr
                    fleet.settled(name)
        finally:
            monitor.stop()

    nobody = monitor.nobody_serving()
    assert not nobody, (f"{len(nobody)} sample(s) with no node taking calls (seed {seed}):\n"
                        + "\n".join(nobody[:50]) + "\n" + "\n".join(summary))
    intervals = {}
    for name in NODES:
        intervals[name], log_problems = drain_intervals(fleet.log_since(name, offsets[name]))
        assert not log_problems, f"{name}: {log_problems}"
    both = overlaps(intervals["cyan"], intervals["peacock"])
    assert not both, f"drains overlapped (release.log, UTC seconds): {both}"
    for name in NODES:
        assert "Traceback" not in fleet.log_since(name, offsets[name]), f"{name}'s release.log has a traceback"
    switched = {n: [r for r in fleet.history(n)[history_lengths[n]:] if r.get("served")] for n in NODES}
    assert all(switched.values()), f"a node never switched in {ROUNDS} rounds: {summary}"
    assert any(": exit 3" in line for line in summary), f"no release was ever refused: the races never met {summary}"
    print(f"\nstress: seed {seed}, {len(monitor.samples)} samples, largest gap {monitor.max_gap_s * 1000:.0f} ms, "
          f"drains cyan {len(intervals['cyan'])} peacock {len(intervals['peacock'])}; " + "; ".join(summary))


# =====================================================================================================
# 2. A stalled SSH session: the silence bound, then the reconnect; a slow engine is not a stall
# =====================================================================================================


def _release_in_background(fleet: Fleet, name: str, inventory: Path | None = None, *extra: str,
                           new_session: bool = False) -> subprocess.Popen:
    argv, env = fleet.argv("release", name, inventory, *extra)
    return fleet.popen(argv, env, new_session=new_session)


def _finish(process: subprocess.Popen, timeout_s: float = 180) -> str:
    """The operator's output once it ended by itself (the timeout is only a safety net: it kills and fails)."""
    try:
        out, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        out, _ = process.communicate()
        pytest.fail(f"the operator did not end by itself within {timeout_s:g} s:\n{out}")
    return out


@SESSIONS
@pytest.mark.parametrize("still_switching", [False, True], ids=["node done in time", "node still switching"])
def test_a_stalled_ssh_session_ends_at_the_silence_bound_and_reports_what_the_node_did(fleet, still_switching):
    name = "cyan"
    # The reconnect bound: several of the follow-up's status answers (each a new SSH session) fit in it
    # on a loaded machine.
    inventory = fleet.variant("stall", transport={"silence_s": 5, "reconnect_s": 10})
    fleet.new_hold(name)
    offset = fleet.log_size(name)
    # Still switching: the node's switch is stopped (SIGSTOP) while it waits for the new engine's /health,
    # which loads for 5 s: a node slowed down by a fault, never by the machine's load. It holds its lock and
    # journal when the reconnect bound ends, and goes on when it is let go (its start budget is 60 s).
    marker = r"waiting for http://\S+/health to answer 200" if still_switching else STEP + "restart-engine"
    with fleet.node_profile(name, load="5" if still_switching else None):
        expected = fleet.expected_id(name)
        operator = _release_in_background(fleet, name, inventory)
        session = switch = None
        try:
            fleet.wait_log(name, offset, marker, operator)
            session = fleet.session_pid(name)
            if still_switching:
                (switch,) = fleet.switch_pids(name)
                os.kill(switch, signal.SIGSTOP)
            os.kill(session, signal.SIGSTOP)  # the session stalls: no byte reaches the operator any more
            out = _finish(operator, 120)
            if still_switching:
                assert fleet.lock_holder(name) == switch  # true: the node's side still holds its lock
        finally:
            _signal(switch, signal.SIGCONT)
            _signal(session, signal.SIGCONT)
            if operator.poll() is None:
                operator.kill()
        _no_traceback(out)
        assert re.search(rf"^\[{name} [0-9:]+\] flatshare: {name}: the node said nothing for 5 s \(the silence bound\)",
                         out, re.MULTILINE), out
        if not still_switching:
            assert f"{name}: the node says: released {expected}" in out, out
            assert operator.returncode == 0, out
        else:
            assert re.search(rf"^{name}: the node is still switching after 10 s \(the reconnect bound\): "
                             rf"switch \S+ -> {expected} ", out, re.MULTILINE), out
            assert operator.returncode == 7, out
        # What the node did, from its own history.
        assert _poll(lambda: fleet.history(name)[-1]["target"] == expected, 90)
        last = fleet.history(name)[-1]
        assert (last["target"], last["result"]) == (expected, "released"), last
        assert fleet.current(name) == expected
        # The history record comes before the switch's last acts (the journal's removal, the prune): it ends when
        # it lets go of its lock (the kernel's lock table).
        assert _poll(lambda: fleet.lock_holder(name) is None, 90), fleet.lock_holder(name)
    fleet.settled(name)


@SESSIONS
def test_an_engine_load_of_two_and_a_half_silence_bounds_does_not_trip_the_bound(fleet):
    # Legitimately slow: the stand-in engine loads for 15 s, the silence bound is 6 s (production's ratio is
    # the same kind: a load of minutes, a bound of seconds). The node reports progress every 2 s meanwhile
    # (a third of the bound, control/rollout.py's progress_cadence): three reports per bound, so a report or
    # two delayed by a loaded machine does not trip it.
    name = "cyan"
    inventory = fleet.variant("slow-engine", transport={"silence_s": 6})
    with fleet.node_profile(name, load="15", start_timeout=45):
        expected = fleet.expected_id(name)
        result = fleet.release("--node", name, inventory=inventory, timeout=240)
    _no_traceback(result.stdout, result.stderr)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "silence bound" not in result.stdout
    # The node said it was still waiting, every 2 s, all through the load.
    assert len(re.findall(r"still waiting for http://\S+/health to answer 200", result.stdout)) >= 5, result.stdout
    assert fleet.current(name) == expected and fleet.history(name)[-1]["result"] == "released"
    fleet.settled(name)


# =====================================================================================================
# 3. A killed SSH session
# =====================================================================================================


@SESSIONS
def test_a_killed_ssh_session_is_followed_up_and_the_node_released_is_reported_released(fleet):
    name = "peacock"
    fleet.new_hold(name)
    expected = fleet.expected_id(name)
    offset = fleet.log_size(name)
    operator = _release_in_background(fleet, name)
    try:
        fleet.wait_log(name, offset, STEP + "restart-engine", operator)
        os.kill(fleet.session_pid(name), signal.SIGKILL)
        out = _finish(operator, 120)
    finally:
        if operator.poll() is None:
            operator.kill()
    _no_traceback(out)
    assert f"{name}: the node says: released {expected}" in out, out
    assert operator.returncode == 0, out
    assert not re.search(r"^(\[peacock [0-9:]+\] )?peacock: .*\bfailed\b", out, re.MULTILINE), out
    last = fleet.history(name)[-1]
    assert (last["target"], last["result"]) == (expected, "released")
    fleet.settled(name)


@SESSIONS
def test_a_session_killed_during_the_automatic_rollback_is_followed_up_and_reports_both_parts(fleet):
    # The new engine never answers within its start budget (it loads for 30 s, the budget is 4 s): the node rolls
    # itself back, and the operator's session is killed while it does. The follow-up asks the node about the
    # switch id the operator knows and reports both parts as the node recorded them.
    name = "peacock"
    served, before = fleet.current(name), len(fleet.history(name))
    fleet.new_hold(name)
    offset = fleet.log_size(name)
    with fleet.node_profile(name, load="30", start_timeout=4):
        operator = _release_in_background(fleet, name)
        try:
            fleet.wait_log(name, offset, r"rolling back to \S+ by itself", operator)
            os.kill(fleet.session_pid(name), signal.SIGKILL)
            out = _finish(operator, 180)
        finally:
            if operator.poll() is None:
                operator.kill()
    _no_traceback(out)
    assert operator.returncode == 9, out  # rolled back automatically, as the node says
    assert "unreachable" not in out and "no record of switch" not in out, out
    assert re.search(rf"^{name}: the node says: rolled back automatically to {served}: restart-engine failed: ", out,
                     re.MULTILINE), out
    records = fleet.history(name)[before:]
    assert [r["result"] for r in records] == ["failed", "rolled back"], records
    assert len({r["switch"] for r in records}) == 1, records  # both parts under the id the operator knows
    # The summary's row says where it went and came back from, as the node's answer records it.
    assert re.search(rf"^\s+{name}\s+{served} -> {records[0]['target']} -> {served}\s", out, re.MULTILINE), out
    assert fleet.current(name) == served
    fleet.settled(name)


# =====================================================================================================
# 4. Signals: Ctrl-C and SIGTERM to the operator; SIGTERM to the node's side in each wait
# =====================================================================================================


@SIGNALS
@pytest.mark.parametrize("sig, code, word", [(signal.SIGINT, 130, "Ctrl-C"), (signal.SIGTERM, 143, "SIGTERM")])
def test_interrupting_the_operator_leaves_the_switching_node_to_finish_and_says_so(fleet, sig, code, word):
    fleet.new_hold("cyan")
    expected = fleet.expected_id("cyan")
    peacock_before = fleet.current("peacock")
    peacock_records = len(fleet.history("peacock"))
    offset = fleet.log_size("cyan")
    operator = fleet.popen([str(BIN / "flatshare"), "release", "--all", "--inventory", str(fleet.inventory),
                            "--root", str(fleet.checkout)], new_session=True)
    try:
        fleet.wait_log("cyan", offset, STEP + "restart-engine", operator)
        if sig == signal.SIGINT:
            os.killpg(operator.pid, sig)  # Ctrl-C: the terminal's whole foreground group
        else:
            os.kill(operator.pid, sig)
        out = _finish(operator, 60)
    finally:
        if operator.poll() is None:
            operator.kill()
    _no_traceback(out)
    assert operator.returncode == code, out
    said = [line for line in out.splitlines() if line.startswith("interrupted:")]
    assert len(said) == 1 and word in said[0] and "carries on" in said[0], out
    assert re.search(r"^cyan: switching on the node when interrupted \(step [a-z-]+\) \(it carries on", out,
                     re.MULTILINE), out
    assert re.search(r"^peacock: not started$", out, re.MULTILINE), out
    # cyan finishes its switch on its own; peacock was never touched.
    assert _poll(lambda: (fleet.history("cyan")[-1]["target"], fleet.history("cyan")[-1]["result"])
                 == (expected, "released"), 60), fleet.history("cyan")[-1]
    assert fleet.current("peacock") == peacock_before and len(fleet.history("peacock")) == peacock_records
    for name in NODES:
        fleet.settled(name)


@SIGNALS
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_signal_between_the_engines_stop_and_its_start_gives_calls_back_with_the_engine_started_again(fleet, sig):
    # A breaker's kind: an early end after the switch stopped the engine but before it asked for its start left
    # the engine and the gateway stopped for good (nothing loading to wait for), and the other node's releases
    # were refused until a person released this one.
    name = "cyan"
    fleet.new_hold(name)
    offset = fleet.log_size(name)
    before = fleet.engine_invocation(name)
    argv, env = fleet.argv("local-release", name)
    operator = fleet.popen(argv, {**env, **faults(signal_after_job=f"stop {ENGINE}", signal=sig)})
    try:
        out = _finish(operator, 120)
    finally:
        if operator.poll() is None:
            operator.kill()
    log = fleet.log_since(name, offset)
    _no_traceback(out, log)
    assert operator.returncode == 1, out
    assert re.search(rf"{ENGINE} was stopped by this switch and is not running: starting it again", log), log
    # The node takes calls again with no person: a new engine process answering, the gateway active, no drain.
    assert fleet.engine_invocation(name) != before
    assert fleet.engine_health(name) == 200
    assert _poll(lambda: fleet.unit_state(name, GATEWAY) == "active", 30), fleet.unit_state(name, GATEWAY)
    assert not fleet.drain_file(name).exists()
    last = fleet.history(name)[-1]
    assert last["result"] == "failed" and last["step"] == "restart-engine" and last["calls"] == "given back", last
    result = fleet.release("--node", name)  # the next release finishes the switch
    assert result.returncode == 0, result.stdout + result.stderr
    fleet.settled(name)


def _hold_voice_call(name: str, seconds: int) -> None:
    assert _http_status(f"http://{ADDRESSES[name]}:8090/calls/start?seconds={seconds}&turns=1", "POST") == 200


def _hold_gateway_request(name: str, seconds: int) -> threading.Thread:
    thread = threading.Thread(target=_http_status, args=(f"http://{ADDRESSES[name]}:8080/v1/chat?hold={seconds}",
                                                        "POST", seconds + 10), daemon=True)
    thread.start()
    _poll(lambda: json.loads(urllib.request.urlopen(f"http://{ADDRESSES[name]}:8080/stats", timeout=2).read())
          ["in_flight"] > 0, 5)
    return thread


WAITS = {
    # wait -> (what the node prints when it begins that wait, the engine's load time)
    "voice drain": (r"voice worker draining: 1 call\(s\) in progress", None),
    "gateway stop job": (r"stop flatshare-gateway.service: waiting for systemd's job", None),
    # 5 s: the engine still loads when the signal comes (some 0.3-1.5 s into the wait), loaded machine or not.
    "engine /health": (r"waiting for http://\S+/health to answer 200", "5"),
}
ENGINE_HEALTH_WAIT = WAITS["engine /health"][0]


@SIGNALS
@pytest.mark.parametrize("wait, sig", [*((w, "SIGTERM") for w in WAITS), ("engine /health", "SIGINT")])
def test_sigterm_to_the_node_side_in_a_wait_ends_the_switch_by_the_early_end_rule(fleet, wait, sig):
    name = "cyan"
    marker, load = WAITS[wait]
    fleet.new_hold(name)
    offset = fleet.log_size(name)
    held = None
    with fleet.node_profile(name, load=load):
        if wait == "voice drain":
            _hold_voice_call(name, 10)  # the drain waits for it (up to the voice drain timeout, 20 s)
        if wait == "gateway stop job":
            held = _hold_gateway_request(name, 10)  # the gateway's drain waits for it (up to 5 s)
        argv, env = fleet.argv("local-release", name)
        operator = fleet.popen(argv, env)
        try:
            fleet.wait_log(name, offset, marker, operator)
            time.sleep(0.3)  # inside the wait
            (switch,) = fleet.switch_pids(name)
            os.kill(switch, getattr(signal, sig))
            out = _finish(operator, 120)
        finally:
            if operator.poll() is None:
                operator.kill()
        _no_traceback(out, fleet.log_since(name, offset))
        assert operator.returncode == 1, out
        # The drain file is gone within a few seconds.
        assert _poll(lambda: not fleet.drain_file(name).exists(), 5), "the drain file stayed"
        log = fleet.log_since(name, offset)
        if wait == "engine /health":
            # The engine was still loading: the early end waits for it (within what is left of its start
            # budget) and then starts the gateway: the node takes calls again without a person.
            assert re.search(r"the engine is still starting: waiting for http://\S+/health", log), log
        assert fleet.engine_health(name) == 200
        assert _poll(lambda: fleet.unit_state(name, GATEWAY) == "active", 30), fleet.unit_state(name, GATEWAY)
        last = fleet.history(name)[-1]
        assert last["result"] == "failed" and last["reason"].startswith(f"interrupted by {sig}"), last
        assert last["calls"] == "given back", last
        shown = fleet.cli("status", "--node", name, "--inventory", str(fleet.inventory))
        assert re.search(rf"^  last switch: .*failed at \S+: interrupted by {sig}( \(Ctrl-C\))?; calls: given back", shown.stdout,
                         re.MULTILINE), shown.stdout  # status says what became of it
        assert f"interrupted by {sig}" in out
        assert fleet.lock_holder(name) is None
        if held is not None:
            held.join(20)
        # The next release is not refused for the lock, and finishes the switch.
        result = fleet.release("--node", name)
    _no_traceback(result.stdout, result.stderr)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "being released by" not in result.stdout
    assert fleet.history(name)[-1]["result"] == "released"
    fleet.settled(name)


@SIGNALS
def test_a_resumed_switch_interrupted_again_records_the_time_it_ran(fleet):
    # A breaker's case: a switch resumed by the next release and interrupted by SIGTERM was recorded as taking
    # 0.245 s though it ran for over a second. Each run's record counts from when that run took the lock.
    name = "cyan"
    fleet.new_hold(name)
    durations = []
    with fleet.node_profile(name, load="5"):
        for run in ("first", "resumed"):
            offset = fleet.log_size(name)
            argv, env = fleet.argv("local-release", name)
            operator = fleet.popen(argv, env)
            try:
                fleet.wait_log(name, offset, ENGINE_HEALTH_WAIT, operator)
                seen = time.monotonic()  # the run has held the lock since before this line
                time.sleep(1.2)
                (switch,) = fleet.switch_pids(name)
                os.kill(switch, signal.SIGTERM)
                ran_at_least = time.monotonic() - seen
                out = _finish(operator, 120)
            finally:
                if operator.poll() is None:
                    operator.kill()
            _no_traceback(out, fleet.log_since(name, offset))
            assert operator.returncode == 1, out
            last = fleet.history(name)[-1]
            assert last["result"] == "failed" and last["reason"] == "interrupted by SIGTERM", last
            assert (last["resumed"] > 0) is (run == "resumed"), last
            assert last["duration_s"] >= ran_at_least, (run, last["duration_s"], ran_at_least)
            assert abs(last["duration_s"] - (last["finished_at"] - last["started_at"])) < 0.01, last
            durations.append(last["duration_s"])
            assert _poll(lambda: fleet.unit_state(name, GATEWAY) == "active", 30), fleet.unit_state(name, GATEWAY)
    result = fleet.release("--node", name)
    assert result.returncode == 0, result.stdout + result.stderr
    fleet.settled(name)


# =====================================================================================================
# 8. Rolling back the fleet's last rollout
# =====================================================================================================


def test_rollback_all_returns_each_node_of_a_failed_rollout_to_what_it_ran_before(fleet):
    sync = fleet.release("--all")
    assert sync.returncode in (0, 4), sync.stdout + sync.stderr
    before = {n: fleet.current(n) for n in NODES}
    hold_before = fleet.hold_value
    fleet.new_hold(*NODES)
    # peacock's engine takes longer to load than its start budget allows: its switch fails mid-way.
    with fleet.node_profile("peacock", load="30", start_timeout=4):
        rollout = fleet.release("--all", "--no-auto-rollback", timeout=240)
    _no_traceback(rollout.stdout, rollout.stderr)
    assert rollout.returncode == 1, rollout.stdout
    assert fleet.current("cyan") != before["cyan"] and fleet.history("cyan")[-1]["result"] == "released"
    failed = fleet.history("peacock")[-1]
    assert failed["result"] == "failed" and failed["step"] == "restart-engine", failed
    rollout_id = failed["rollout"]
    assert fleet.history("cyan")[-1]["rollout"] == rollout_id

    result = fleet.rollback("--all")
    _no_traceback(result.stdout, result.stderr)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "undo-rollout of peacock, cyan" in result.stdout, result.stdout
    for name in NODES:
        assert fleet.current(name) == before[name], name
        last = fleet.history(name)[-1]
        assert (last["result"], last["after"]) == ("rolled back", before[name]), last
    # peacock (the failed node) first, then cyan.
    assert fleet.history("peacock")[-1]["finished_at"] <= fleet.history("cyan")[-1]["started_at"]
    for name in NODES:
        fleet.settled(name)
    # The undo is part of the rollout it undid: run again, it has nothing left to undo (a breaker's case: the
    # second `rollback --all` undid the undo, back to the failed rollout's releases).
    again = fleet.rollback("--all")
    _no_traceback(again.stdout, again.stderr)
    assert again.returncode == 4, again.stdout + again.stderr
    assert all(fleet.current(name) == before[name] for name in NODES), again.stdout
    fleet.set_hold(hold_before)  # the checkout back to what both nodes run


def test_rollback_all_leaves_alone_a_node_that_never_switched_in_the_rollout(fleet):
    sync = fleet.release("--all")
    assert sync.returncode in (0, 4), sync.stdout + sync.stderr
    before = {n: fleet.current(n) for n in NODES}
    peacock_records = len(fleet.history("peacock"))
    with fleet.node_profile("cyan", load="1.5"):  # only cyan's render changes
        rollout = fleet.release("--all")
        _no_traceback(rollout.stdout, rollout.stderr)
        assert rollout.returncode == 0, rollout.stdout
        assert re.search(r"^\[peacock [0-9:]+\] peacock: already on \S+; nothing to do", rollout.stdout,
                         re.MULTILINE), rollout.stdout
        assert fleet.current("cyan") != before["cyan"] and fleet.current("peacock") == before["peacock"]

        result = fleet.rollback("--all")
    _no_traceback(result.stdout, result.stderr)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "peacock: its last switch is not part of rollout" in result.stdout, result.stdout
    assert fleet.current("cyan") == before["cyan"]
    assert fleet.history("cyan")[-1]["result"] == "rolled back"
    assert fleet.current("peacock") == before["peacock"] and len(fleet.history("peacock")) == peacock_records
    for name in NODES:
        fleet.settled(name)


# =====================================================================================================
# The shipped switcher of a release that has not taken the lock yet
# =====================================================================================================


def _entry_point(fleet: Fleet, name: str) -> int | None:
    """The node's ``flatshare-node switch`` entry point while it still reads the bundle (before it runs the switcher)."""
    state_dir = str(fleet.node(name).state_dir)
    for pid in pids():
        argv = cmdline(pid)
        if "switch" in argv and state_dir in argv and any(a.endswith("/flatshare-node") for a in argv):
            return pid
    return None


@SIGNALS
@pytest.mark.parametrize("kept_when", [
    "just now",
    "two hours ago",
])
def test_a_switcher_in_use_is_not_pruned_by_another_switch(fleet, tmp_path, kept_when):
    from conftest import faults

    from flatshare_ops.control.bundle import source, switcher

    name = "peacock"
    fleet.new_hold(name)
    # Another checkout of the same release whose code differs (one more file): a switcher no stored release names.
    other = shutil.copytree(fleet.checkout, tmp_path / "other-checkout")
    (other / "flatshare_ops" / "MARKER").write_text(f"{time.time()}\n")
    digest = switcher(source(other))["sha256"]
    switcher_dir = fleet.releases(name) / ".switchers" / digest
    release_from_other = [str(BIN / "flatshare"), "release", "--node", name, "--inventory", str(fleet.inventory),
                          "--root", str(other)]
    if kept_when == "two hours ago":
        # A dry run from that checkout keeps its switcher on the node (and stores nothing)...
        dry = fleet.cli(*release_from_other[1:], "--dry-run")
        assert dry.returncode == 0 and switcher_dir.is_dir(), dry.stdout + dry.stderr
        old = time.time() - 7200  # ...two hours ago
        for path in [switcher_dir, *switcher_dir.rglob("*")]:
            os.utime(path, (old, old), follow_symlinks=False)
    offset = fleet.log_size(name)
    # A: a local release that holds the node's lock (its serving-check step waits until B is caught).
    go = tmp_path / "go"
    argv, env = fleet.argv("local-release", name)
    first = fleet.popen(argv, {**env, **faults(sleep_in_step="serving-check", seconds=120, until=str(go))})
    second = stopped = None
    try:
        fleet.wait_log(name, offset, STEP + "serving-check", first)
        # B: a release of the same node over SSH, from the other checkout; stopped as soon as its entry point
        # has kept the switcher (its zip that runs written, or the directory touched: in use now) and goes on to
        # run it (before it reaches the lock). Caught by polling: a B that got past (to the lock, which A holds, and
        # its refusal) before it was stopped is asked again (the case then not tried).
        def kept(since: float) -> bool:
            try:
                return (switcher_dir / "run.json").is_file() and switcher_dir.stat().st_mtime >= since
            except OSError:
                return False

        for _ in range(5):
            began = time.time() - 1  # file times may lag the clock by a tick
            second = fleet.popen(release_from_other)
            entry = _poll(lambda: _entry_point(fleet, name), 60, 0.005)
            assert entry, "the second release's entry point never started"
            assert _poll(lambda: kept(began) or not _alive(entry), 60, 0.0005)
            _signal(entry, signal.SIGSTOP)
            if kept(began) and cmdline(entry):
                stopped = entry
                break
            _signal(entry, signal.SIGCONT)
            said = _finish(second, 120)
            assert "Traceback" not in said and second.returncode in (0, 3, 4), said
            second = None
        assert stopped, "the second release was never caught running its switcher"
        go.touch()  # A goes on to its end, and its prune
        out = _finish(first, 120)
        assert first.returncode == 0, out
        # B still lives, stopped, and runs from its kept switcher: it must still be there.
        assert _alive(stopped)
        assert list(switcher_dir.glob("run-*.zip")), \
            f"{switcher_dir} was removed while a release ran from it"
    finally:
        go.touch()
        _signal(stopped, signal.SIGCONT)
        if first.poll() is None:
            first.communicate(timeout=120)
        if second is not None:
            said = _finish(second, 120)
            assert "Traceback" not in said and second.returncode in (0, 3, 4), said
    fleet.settled(name)


@SIGNALS
def test_ctrl_c_while_a_node_waits_for_admission_says_what_the_node_will_do(fleet):
    name = "cyan"
    fleet.new_hold(name)
    before = fleet.current(name)
    records = len(fleet.history(name))
    offset = fleet.log_size(name)
    operator = fleet.popen(fleet.argv("release", name)[0], new_session=True)
    manager = fleet.sandbox_state()["peacock"]["manager_pid"]
    try:
        fleet.wait_log(name, offset, "asking the operator's side for admission", operator)
        with _stopped(manager):  # the probe of peacock waits for its manager (5 s): cyan waits for the answer
            time.sleep(1.0)
            os.killpg(operator.pid, signal.SIGINT)
            out = _finish(operator, 60)
            refusal = fleet.wait_log(name, offset, r"^.*release refused: cyan may not drain now: .*$")
    finally:
        if operator.poll() is None:
            operator.kill()
    _no_traceback(out)
    assert operator.returncode == 130, out
    assert fleet.current(name) == before and len(fleet.history(name)) == records  # nothing changed
    fleet.settled(name)
    summary = [line for line in out.splitlines() if line.startswith(f"{name}: ")]
    assert summary and "carries on" not in summary[-1], out
    assert summary[-1].startswith(f"{name}: was asking for admission to drain: without an answer it refuses"), out
    assert "within 60 s" not in refusal and "the operator's side went away" in refusal, refusal


@SIGNALS
def test_sigterm_after_the_switch_is_recorded_does_not_unsay_the_release(fleet):
    name = "cyan"
    fleet.new_hold(name)
    expected = fleet.expected_id(name)
    # Unpacked switchers left over from long ago, that the prune at the end of the switch removes; the prune
    # takes a while (tests/faults: it waits 30 s first, as a prune of many does).
    leftovers = fleet.releases(name) / ".switchers"
    old = time.time() - 7200
    for n in range(3):
        directory = leftovers / f"{n:064x}"
        directory.mkdir(parents=True)
        for f in range(20):
            (directory / f"m{f}.py").touch()
        os.utime(directory, (old, old))
    offset = fleet.log_size(name)
    argv, env = fleet.argv("local-release", name)
    operator = fleet.popen(argv, {**env, **faults(wait_in_prune=30)})
    try:
        fleet.wait_log(name, offset, rf"{name}: released {expected}$", operator)
        (switch,) = fleet.switch_pids(name)
        assert any(leftovers.glob("0" * 60 + "*")), "the prune was already over"
        os.kill(switch, signal.SIGTERM)  # the switch is recorded; the node is pruning
        out = _finish(operator, 120)
    finally:
        if operator.poll() is None:
            operator.kill()
        shutil.rmtree(leftovers / ("0" * 64), ignore_errors=True)
        for directory in leftovers.glob("0" * 40 + "*"):
            shutil.rmtree(directory, ignore_errors=True)
    _no_traceback(out)
    last = fleet.history(name)[-1]
    assert (last["target"], last["result"]) == (expected, "released")
    fleet.settled(name)
    assert "nothing was changed" not in fleet.log_since(name, offset), out
    assert operator.returncode == 0, out


SLOW_PARSE = Path(__file__).resolve().parent / "test_fleet_safety_slow"


@SESSIONS
def test_a_slow_preflight_is_not_taken_for_a_stalled_session(fleet):
    name = "cyan"
    inventory = fleet.variant("slow-preflight", transport={"silence_s": 5})
    fleet.new_hold(name)
    expected = fleet.expected_id(name)
    argv, env = fleet.argv("local-release", name, inventory)
    # The preflight runs vLLM with the engine's own PYTHONPATH (the serve module's directory): the slow start
    # goes there for this test only.
    slow = fleet.node(name).state_dir / "module" / "sitecustomize.py"
    slow.write_bytes((SLOW_PARSE / "sitecustomize.py").read_bytes())
    try:
        result = fleet.cli(*argv[1:], env={**env, "FLEET_SAFETY_SLOW_PARSE_S": "12"})
    finally:
        slow.unlink()
    _no_traceback(result.stdout, result.stderr)
    fleet.settled(name)
    assert "silence bound" not in result.stdout, result.stdout
    assert result.returncode == 0, result.stdout + result.stderr
    assert fleet.current(name) == expected


@SIGNALS
def test_an_operator_interrupted_during_the_preflight_says_nothing_changed_there_and_the_node_refuses(fleet):
    # A breaker's case: Ctrl-C while the node was only in its preflight, and the summary said "switching on the
    # node when interrupted (it carries on)": nothing had changed there, and without its operator the node
    # refuses at its go-ahead (a single node's release asks one before its admission to drain and any change).
    # The node says where its switch stands (typed Progress messages).
    name = "cyan"
    fleet.new_hold(name)
    before, invocation = fleet.current(name), fleet.engine_invocation(name)
    offset = fleet.log_size(name)
    slow = fleet.node(name).state_dir / "module" / "sitecustomize.py"
    slow.write_bytes((SLOW_PARSE / "sitecustomize.py").read_bytes())
    argv, env = fleet.argv("release", name)
    operator = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True, env={**os.environ, **env, "FLEET_SAFETY_SLOW_PARSE_S": "12"})
    try:
        fleet.wait_log(name, offset, r"preflight: can the new engine start\?", operator)
        os.killpg(operator.pid, signal.SIGINT)
        out = _finish(operator, 60)
        assert _poll(lambda: fleet.lock_holder(name) is None, 120), "the node's switch never ended"
    finally:
        if operator.poll() is None:
            operator.kill()
        slow.unlink()
    _no_traceback(out, fleet.log_since(name, offset))
    assert operator.returncode == 130, out
    assert re.search(rf"^{name}: deciding on the node when interrupted \(its checks and preflight, before any "
                     r"change\)", out, re.MULTILINE), out
    assert "switching on the node" not in out, out
    # What the node did, by its own records and systemd's: nothing changed, its engine never restarted.
    assert fleet.current(name) == before and fleet.engine_invocation(name) == invocation
    log = fleet.log_since(name, offset)
    assert not re.search(r"step \d+/\d+ ", log) and "went away before answering the go-ahead request" in log, log
    fleet.settled(name)


def test_two_releases_started_at_once_with_wait_both_finish_one_after_the_other(fleet):
    # Issue 34: single-node releases of cyan and peacock started together each saw the other "being released"
    # and were both refused (exit 3); one had to be run again by hand. With --wait each asks again until the
    # other's release ended.
    fleet.new_hold()
    expected = {name: fleet.expected_id(name) for name in NODES}
    starts = {name: len(fleet.history(name)) for name in NODES}
    operators = {name: fleet.popen(fleet.argv("release", name, None, "--wait", "4m")[0]) for name in NODES}
    outs = {name: _finish(process, 300) for name, process in operators.items()}
    for name, process in operators.items():
        _no_traceback(outs[name])
        assert process.returncode == 0, outs[name]
        records = fleet.history(name)[starts[name]:]
        assert records and (records[-1]["result"], records[-1]["after"]) == ("released", expected[name]), records
    assert any(re.search(r"waiting \(--wait\): .*refused: .*; asking again in \d+ s", o) for o in outs.values()), outs
    # A node always took calls, by systemd's own clock: each gateway's last stop (ActiveExitTimestamp: it
    # answers 503 from then) to its start again (ActiveEnterTimestamp), microseconds of CLOCK_REALTIME, never
    # overlap. (The history records' started_at counts from when the run took its own node's lock, before its
    # preflight and its admission to drain: a run may take it while the other's switch is ending; seen in a
    # full run, 0.9 s before the other's record.)
    windows = {}
    for name in NODES:
        with connect(fleet.address(name)) as bus:
            windows[name] = tuple(int(unit_property(bus, GATEWAY, "Unit", which))
                                  for which in ("ActiveExitTimestamp", "ActiveEnterTimestamp"))
    (a0, a1), (b0, b1) = windows.values()
    assert 0 < a0 < a1 and 0 < b0 < b1, windows  # each gateway stopped and started again in its switch
    assert a1 <= b0 or b1 <= a0, windows
    for name in NODES:
        fleet.settled(name)


# =====================================================================================================
# 9. Admission judges "takes calls" by what callers meet (the gateway), never by our own files
# =====================================================================================================


def _main_pid(fleet: Fleet, name: str, unit: str) -> int:
    with connect(fleet.address(name)) as bus:
        return int(unit_property(bus, unit, "Service", "MainPID"))


def _refused_without_draining(fleet: Fleet, name: str, result, offset: int) -> str:
    """``name``'s release was refused (exit 3), and its node never drained: release.log shows no drain step,
    its gateway kept its process and the drain file never appeared."""
    log = fleet.log_since(name, offset)
    _no_traceback(result.stdout, result.stderr, log)
    assert result.returncode == 3, result.stdout + result.stderr
    assert "may not drain now" in result.stdout, result.stdout
    assert not re.search(r"step \d+/\d+ (drain-voice|stop-gateway)", log), log
    return log


def _engine_behaves(name: str, **fields) -> None:
    """The stand-in engine's behaviour (sandbox/engine_behaviour.py) set on ``name``'s engine."""
    request = urllib.request.Request(f"http://{ADDRESSES[name]}:8000/flatshare-standin/behaviour", method="POST",
                                     data=json.dumps(fields).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as answer:
        assert answer.status == 200


def test_release_all_preflights_every_node_at_once_and_refuses_before_any_drain(fleet):
    # Issue 34: peacock's preflight ran only after cyan was drained, switched and analysed: a release peacock
    # cannot start was found with cyan already switched. The fleet's preflight runs first, on every node at once.
    fleet.new_hold()
    profile = fleet.node("peacock").profile
    original = profile.read_text()
    model = re.search(r'^model = "([^"]+)"$', original, re.MULTILINE)
    assert model, original
    before = {name: (fleet.current(name), fleet.engine_invocation(name), len(fleet.history(name))) for name in NODES}
    offsets = {name: fleet.log_size(name) for name in NODES}
    try:
        profile.write_text(original.replace(model.group(0), 'model = "/nonexistent/flatshare-model"'))
        refused = fleet.release("--all", timeout=240)
    finally:
        profile.write_text(original)
    out = refused.stdout + refused.stderr
    _no_traceback(out)
    assert refused.returncode == 3, out
    assert ("the fleet's preflight found peacock cannot take this release, so no node was drained: peacock: release "
            "refused before draining: peacock: the model path /nonexistent/flatshare-model does not exist") in out, out
    # Neither node changed (systemd's InvocationID, the current link, the history), and cyan never drained.
    for name in NODES:
        assert (fleet.current(name), fleet.engine_invocation(name), len(fleet.history(name))) == before[name], name
        assert not re.search(r"step \d+/\d+ ", fleet.log_since(name, offsets[name])), fleet.log_since(name, offsets[name])
    # The same rollout once peacock can take it: each switch reuses the preflight the rollout ran first.
    offsets = {name: fleet.log_size(name) for name in NODES}
    released = fleet.release("--all", timeout=300)
    assert released.returncode == 0, released.stdout + released.stderr
    for name in NODES:
        log = fleet.log_since(name, offsets[name])
        assert f"preflight of {name}: passed" in released.stdout, released.stdout  # the fleet's, first
        assert f"{name}: preflight passed in " not in log, log  # the switch ran none of its own...
        assert f"{name}: preflight: reused the one passed at " in log, log  # ...it reused the fleet's
        assert fleet.history(name)[-1]["result"] == "released"
        fleet.settled(name)


def _kill_sessions(fleet: Fleet, name: str, count: int, stop: threading.Event, killed: list[int]) -> None:
    """SIGKILL the sshd session process above each of ``name``'s node-side switches as it appears (a dropped SSH
    connection), ``count`` sessions at most, until ``stop``; the killed ones go into ``killed``."""
    listener = fleet.sandbox_state()[name]["sshd_pid"]
    while not stop.is_set() and len(killed) < count:
        for switch in fleet.switch_pids(name):
            pid = switch
            while pid and ppid(pid) not in (listener, None, 0, 1):
                pid = ppid(pid) or 0
            if pid and ppid(pid) == listener and pid not in killed and "sshd" in " ".join(cmdline(pid)):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                killed.append(pid)
        time.sleep(0.05)


@pytest.mark.parametrize("drops", [1, 2])
def test_a_preflight_whose_connection_drops_is_asked_again_and_refuses_the_rollout_if_it_never_answers(fleet, drops):
    # A breaker's case: peacock's SSH session killed during the fleet's preflight was "not asked (no answer); its
    # switch runs its own", and cyan drained before peacock's own switch refused. A preflight changes nothing:
    # it is asked again on a fresh connection; a node that still cannot be asked refuses the whole rollout.
    fleet.new_hold()
    before = {name: (fleet.current(name), fleet.engine_invocation(name), len(fleet.history(name))) for name in NODES}
    offsets = {name: fleet.log_size(name) for name in NODES}
    slow = fleet.node("peacock").state_dir / "module" / "sitecustomize.py"
    slow.write_bytes((SLOW_PARSE / "sitecustomize.py").read_bytes())  # each preflight of peacock takes seconds
    stop, killed = threading.Event(), []
    killer = threading.Thread(target=_kill_sessions, args=(fleet, "peacock", drops, stop, killed))
    killer.start()
    try:
        result = fleet.release("--all", env={"FLEET_SAFETY_SLOW_PARSE_S": "4"}, timeout=300)
    finally:
        stop.set()
        killer.join()
        slow.unlink()
    out = result.stdout + result.stderr
    _no_traceback(out)
    assert len(killed) == drops, (killed, out)
    if drops == 2:
        assert result.returncode == 3, out
        assert re.search(r"^preflight of peacock: could not be asked \(.*; asked again: .*\)$", out, re.MULTILINE), out
        assert "the fleet's preflight found peacock cannot take this release, so no node was drained" in out, out
        for name in NODES:  # nothing changed, and cyan never drained
            assert (fleet.current(name), fleet.engine_invocation(name), len(fleet.history(name))) == before[name]
            assert not re.search(r"step \d+/\d+ ", fleet.log_since(name, offsets[name]))
    else:
        assert result.returncode == 0, out
        assert "preflight of peacock: passed" in out and "could not be asked" not in out, out
        for name in NODES:
            assert fleet.history(name)[-1]["result"] == "released"
    for name in NODES:
        fleet.settled(name)


def _running(name: str) -> float | None:
    """The engine's own ``vllm:num_requests_running`` (its /metrics, read by prometheus_client's parser)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"http://{ADDRESSES[name]}:8000/metrics", timeout=5) as answer:
            text = answer.read().decode()
    except OSError:
        return None
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "vllm:num_requests_running")


def test_a_node_whose_carrier_lacks_the_room_waits_for_it_with_wait_and_then_drains(fleet):
    # Issue 34: admission counted nodes, not load: a release moved a busy node's calls onto a card already full.
    # cyan's profile gives its carriers 4 seats (seats_share 0.125 of peacock's max_num_seqs 32); peacock runs 4
    # requests and cyan 1: 5 for 4 seats, refused with the numbers; --wait asks again until peacock's end.
    from flatshare_ops.common.completions import post_completion, request_body

    fleet.new_hold("cyan")
    profile = fleet.node("cyan").profile
    original = profile.read_text()
    assert "[release" not in original  # the node's profile overrides the checkout's; this test adds a table
    held = []
    try:
        profile.write_text(original + "\n[release.admission]\nseats_share = 0.125\n")
        for name, count, seconds in (("peacock", 4, 15), ("cyan", 1, 20)):
            _engine_behaves(name, ttft_s=seconds)  # read as each request is seated: these hold their seats
            for i in range(count):
                thread = threading.Thread(target=post_completion, daemon=True, args=(
                    f"http://{ADDRESSES[name]}:8000", request_body("hold a seat", 1), f"seat-{name}-{i}", 90))
                thread.start()
                held.append(thread)
            assert _poll(lambda: _running(name) == count, 30), _running(name)
            _engine_behaves(name, ttft_s=0.02)  # every later call (the admission's own) answers at once
        result = fleet.release("--node", "cyan", "--wait", "3m", timeout=300)
    finally:
        profile.write_text(original)
        for name in NODES:
            _engine_behaves(name, ttft_s=0.02)
    out = result.stdout + result.stderr
    _no_traceback(out)
    assert result.returncode == 0, out
    assert ("the nodes that would carry cyan's calls lack the room: peacock 4 running + 0 waiting of max_num_seqs "
            "32; cyan moves 1 running + 0 waiting: 5 requests for 4 seats ([release.admission] seats_share 0.125)"
            in out), out
    assert re.search(r"waiting \(--wait\): .*lack the room.*; asking again in \d+ s", out), out
    last = fleet.history("cyan")[-1]
    assert last["result"] == "released", last
    for thread in held:
        thread.join(90)
    _released_again(fleet, "cyan")  # its profile back as it was


#: A breaker's cases: peacock's gateway and engine answer /health 200 while every call through it fails.
CALLS_FAIL = {"every call ends in an error event": {"error_share": 1},
              # longer than the probe call's bound (node/calls.py CALL_TIMEOUT_S, 10 s)
              "every call hangs before its first token": {"ttft_s": 12}}


@pytest.mark.parametrize("fault", ["hung gateway (SIGSTOP)", "gateway unit stopped", *CALLS_FAIL])
def test_admission_counts_the_other_nodes_gateway_as_what_callers_meet(fleet, fault):
    # peacock's engine answers /health and its drain file is absent: only what its gateway gives callers fails.
    fleet.new_hold("cyan")
    before, gateway_pid = fleet.current("cyan"), _main_pid(fleet, "cyan", GATEWAY)
    offset = fleet.log_size("cyan")
    monitor = CallsMonitor(fleet)
    if fault in CALLS_FAIL:
        _engine_behaves("peacock", **CALLS_FAIL[fault])
        undo = lambda: _engine_behaves("peacock", **Behaviour().as_dict())  # noqa: E731
    elif fault.startswith("hung"):
        pid = _main_pid(fleet, "peacock", GATEWAY)
        os.kill(pid, signal.SIGSTOP)
        undo = lambda: os.kill(pid, signal.SIGCONT)  # noqa: E731
    else:
        from flatshare_ops.common import systemd

        systemd.job(fleet.address("peacock"), "stop", GATEWAY, 60)
        assert _poll(lambda: fleet.unit_state("peacock", GATEWAY) == "inactive", 30)
        undo = lambda: fleet.cli("release", "--node", "peacock", "--inventory", str(fleet.inventory),  # noqa: E731
                                 "--root", str(fleet.checkout))
    monitor.start()
    try:
        assert fleet.engine_health("peacock") == 200
        result = fleet.release("--node", "cyan", timeout=120)
        # While peacock's gateway fails callers, cyan is the only node taking calls: it must never drain.
        assert all(state["cyan"][0] for _, state in monitor.samples), "cyan stopped taking calls"
    finally:
        monitor.stop()
        undo()
    # peacock's gateway answers again (a process continued after SIGSTOP, or started anew) before it is checked,
    # and the probe's hung call has ended there (an engine request running with no voice turn is a WARNING).
    assert _poll(lambda: _http_status(f"http://{ADDRESSES['peacock']}:8080/health") == 200, 30)
    assert _poll(lambda: re.search(r"^vllm:num_requests_running\{[^}]*\} 0(\.0)?$", urllib.request.urlopen(
        f"http://{ADDRESSES['peacock']}:8000/metrics", timeout=5).read().decode(), re.MULTILINE), 30)
    _refused_without_draining(fleet, "cyan", result, offset)
    assert re.search(r"^admission for cyan: peacock: does not take calls \(.*gateway.*\)", result.stdout, re.MULTILINE), result.stdout
    if fault in CALLS_FAIL:  # its /health said 200: the call through it is what failed
        assert re.search(r"^admission for cyan: peacock: does not take calls \(a call through its gateway \S+ failed", result.stdout,
                         re.MULTILINE), result.stdout
    assert fleet.current("cyan") == before and _main_pid(fleet, "cyan", GATEWAY) == gateway_pid
    for name in NODES:
        assert _poll(lambda: fleet.unit_state(name, GATEWAY) == "active", 30)
        fleet.settled(name)


def _probe_answer(fleet: Fleet, name: str, state_dir: Path | None = None) -> dict:
    """The node's own probe (``flatshare-node probe``), run as the operator's side runs it."""
    node = fleet.node(name)
    probe = subprocess.run([str(BIN / "python"), "-m", "flatshare_ops.node", "probe", "--node", name,
                            "--state-dir", str(state_dir or node.state_dir), "--scope", "user",
                            "--runtime-dir", str(node.manager.runtime_dir)], capture_output=True, text=True, timeout=60)
    return json.loads(probe.stdout)


def test_a_nodes_probe_reports_one_id_whatever_path_reached_it_and_another_nodes_differs(fleet, tmp_path):
    # The id that tells one node from another whatever name, port or SSH host key reached it (node/probe.py
    # node_identity): the machine's id and the state directory's device and inode, as os.stat gives them.
    alias = tmp_path / "cyan-state"
    alias.symlink_to(fleet.node("cyan").state_dir)
    direct, through_alias, other = (_probe_answer(fleet, "cyan"), _probe_answer(fleet, "cyan", alias),
                                    _probe_answer(fleet, "peacock"))
    st = os.stat(fleet.node("cyan").state_dir)
    assert direct["node_id"].endswith(f":{st.st_dev}:{st.st_ino}"), direct
    assert direct["node_id"] == through_alias["node_id"] != other["node_id"], (direct, other)


def test_a_hung_gateway_is_not_taking_calls_in_the_nodes_own_probe_within_its_bound(fleet):
    pid = _main_pid(fleet, "peacock", GATEWAY)
    with _stopped(pid):
        probe = subprocess.run([str(BIN / "python"), "-m", "flatshare_ops.node", "probe", "--node", "peacock",
                                "--state-dir", str(fleet.node("peacock").state_dir), "--scope", "user",
                                "--runtime-dir", str(fleet.node("peacock").manager.runtime_dir)],
                               capture_output=True, text=True, timeout=60)
    answer = json.loads(probe.stdout)
    assert answer["takes_calls"] is False, answer
    # The probe's own bound fired (it never waits on a hung gateway), and it says so.
    assert any("gateway" in p and "did not answer within 2 s" in p for p in answer["problems"]), answer
    fleet.settled("peacock")


@pytest.mark.parametrize("damage", ["active release moved away", "active serving.json emptied",
                                    "active release moved away, the new release moves the gateway"])
def test_a_serving_node_whose_active_release_is_damaged_still_asks_for_admission(fleet, damage):
    # cyan serves (engine, gateway, voice worker all up) but its own record of that is damaged; peacock's
    # gateway is hung, so cyan is the last node taking calls and must not drain. When the new release's
    # gateway address is not where the running gateway answers, nothing answers there: that proves nothing.
    profile = fleet.node("cyan").profile
    original_profile = profile.read_text()
    if "moves the gateway" in damage:
        profile.write_text(original_profile.replace(":8080\"", ":8089\""))
        assert profile.read_text() != original_profile
    else:
        fleet.new_hold("cyan")
    current = fleet.current("cyan")
    directory = fleet.releases("cyan") / current
    aside = directory.with_name(current + ".aside")
    serving = directory / "serving.json"
    original = serving.read_bytes()
    offset = fleet.log_size("cyan")
    peacock_gateway = _main_pid(fleet, "peacock", GATEWAY)
    try:
        if damage == "active release moved away":
            directory.rename(aside)
        else:
            serving.write_bytes(b"")
        with _stopped(peacock_gateway):
            result = fleet.release("--node", "cyan", timeout=120)
    finally:
        if aside.exists():
            aside.rename(directory)
        serving.write_bytes(original)
        profile.write_text(original_profile)
    log = _refused_without_draining(fleet, "cyan", result, offset)
    assert "no admission needed" not in log, log
    assert "cyan: asking the operator's side for admission to drain" in log, log
    # Where the running gateway answers is systemd's word (the loaded unit's environment), not the damaged files':
    # it answers callers there, so cyan asks even when the new release moves its gateway.
    for name in NODES:
        fleet.settled(name)


@contextmanager
def _release_waiting_in(fleet: Fleet, name: str, step: str, offset: int, go: Path):
    """A local release of ``name`` whose ``step`` waits until ``go`` exists (tests/faults), entered once the
    node's log (past ``offset``) shows the step begun; yields the operator's process. On the way out ``go`` is
    touched and the release left to end by itself (killed only past a safety net), and the node's lock waited
    for: a test that failed inside never leaves its release running into the next test."""
    argv, env = fleet.argv("local-release", name)
    operator = fleet.popen(argv, {**env, **faults(sleep_in_step=step, seconds=120, until=str(go))})
    try:
        fleet.wait_log(name, offset, rf"{STEP}{step}$", operator)
        yield operator
    finally:
        go.touch()
        if operator.poll() is None:
            try:
                operator.communicate(timeout=180)
            except subprocess.TimeoutExpired:
                operator.kill()
        _poll(lambda: fleet.lock_holder(name) is None, 180)


def _asked_and_refused(fleet: Fleet, name: str, result, offset: int) -> str:
    """``name``'s drain was asked for (never judged free of calls) and refused, and it never drained."""
    log = _refused_without_draining(fleet, name, result, offset)
    assert "no admission needed" not in log and f"{name}: asking the operator's side for admission to drain" in log, log
    return log


def _released_again(fleet: Fleet, name: str) -> None:
    """``name`` released once more (its profile back as it was), then both nodes as every test leaves them."""
    again = fleet.release("--node", name, timeout=120)
    assert again.returncode == 0, again.stdout + again.stderr
    _gateways_back_and_settled(fleet)


def _gateways_back_and_settled(fleet: Fleet) -> None:
    for name in NODES:
        assert _poll(lambda: fleet.unit_state(name, GATEWAY) == "active", 30)
        fleet.settled(name)


@contextmanager
def _hand_started_gateway(name: str):
    """The node's gateway unit stopped and a gateway of the same kind started by hand on its address: callers
    are served there while systemd says the unit is inactive."""
    fleet_address = ADDRESSES[name]
    env = {**os.environ, "FLATSHARE_ENGINE_URL": f"http://{fleet_address}:8000",
           "FLATSHARE_GATEWAY_URL": f"http://{fleet_address}:8080"}
    process = subprocess.Popen([str(BIN / "python"), "-m", "flatshare_ops.sandbox.gateway"], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        yield process
    finally:
        process.terminate()
        process.wait(30)


#: States in which a part of cyan looks "not serving" while its gateway answers 200: callers are served there.
OWN_STATES = ["voice unit stopped", "stale voice drain file", "gateway unit stopped, a gateway answering by hand",
              "its gateway stalled"]


@pytest.mark.parametrize("state", OWN_STATES)
def test_a_node_whose_gateway_serves_asks_for_admission_whatever_its_units_and_files_say(fleet, state):
    # peacock's gateway is hung: cyan is the last node callers are served at. Whatever else cyan shows (a unit
    # stopped, a drain file left behind, its unit's gateway replaced by one started by hand, its own gateway too
    # slow to answer the bound), what callers meet decides: its drain must be admitted, and it is refused.
    fleet.new_hold("cyan")
    offset = fleet.log_size("cyan")
    served = fleet.current("cyan")
    peacock_gateway = _main_pid(fleet, "peacock", GATEWAY)
    with connect(fleet.address("cyan")) as bus:
        if state == "voice unit stopped":
            run_job(bus, "stop", VOICE, 30)
        if state.startswith("gateway unit stopped"):
            run_job(bus, "stop", GATEWAY, 30)
    cyan_gateway = _main_pid(fleet, "cyan", GATEWAY)
    try:
        if state == "stale voice drain file":
            fleet.drain_file("cyan").write_text("left behind\n")
        with contextlib.ExitStack() as stack:
            if state.startswith("gateway unit stopped"):
                stack.enter_context(_hand_started_gateway("cyan"))
                assert _poll(lambda: _http_status(f"http://{ADDRESSES['cyan']}:8080/health") == 200, 30)
            stack.enter_context(_stopped(peacock_gateway))
            if state == "its gateway stalled":
                stack.enter_context(_stopped(cyan_gateway))
            result = fleet.release("--node", "cyan", timeout=120)
    finally:
        fleet.drain_file("cyan").unlink(missing_ok=True)
    log = _asked_and_refused(fleet, "cyan", result, offset)
    if state == "its gateway stalled":
        assert re.search(r"cyan: whether it takes calls could not be established \(.*:8080/health did not answer "
                         r"within 2 s", log), log
    assert fleet.current("cyan") == served
    _released_again(fleet, "cyan")  # the units started again (a whole switch when a unit is down)


def test_a_gateway_systemd_is_starting_again_may_serve_so_the_node_does_not_drain_unasked(fleet):
    # A breaker's case: cyan's gateway killed (Restart=on-failure starts it again after RestartSec=2s) while peacock
    # took no calls; one refused connection made cyan "not serving" and it drained unasked, and no node took calls
    # until its switch ended. Refused while systemd runs the unit or starts it again is unknown: the drain asks.
    # Read at the node's own judge (node/calls.py served_here), against the real manager, in the 2 s window.
    from flatshare_ops.node.calls import served_here
    from flatshare_ops.node.context import NodeContext

    node = fleet.node("cyan")
    ctx = NodeContext("cyan", node.state_dir, ManagerAddress("user", node.manager.runtime_dir))
    current = fleet.current("cyan")
    serving = json.loads((fleet.releases("cyan") / current / "serving.json").read_text())

    def sub_state() -> str:
        with connect(fleet.address("cyan")) as bus:
            return unit_property(bus, GATEWAY, "Unit", "SubState").decode()

    seen = None
    for _ in range(3):  # the window is systemd's RestartSec (2 s); a loaded machine may miss it once
        assert _poll(lambda: fleet.unit_state("cyan", GATEWAY) == "active", 30)
        os.kill(_main_pid(fleet, "cyan", GATEWAY), signal.SIGKILL)
        if not _poll(lambda: sub_state() == "auto-restart", 2, 0.01):
            continue
        calls = served_here(ctx, [current], serving)
        if sub_state() == "auto-restart":  # systemd had not started it again while it was asked
            seen = calls
            break
    assert seen is not None, "systemd's auto-restart window was never seen"
    assert seen.takes is None, seen
    assert any("refused" in r and "activating (auto-restart)" in r for r in seen.reasons), seen.reasons
    # Stopped by systemd (inactive, nothing to start it again), the same refused connection is "not served".
    assert _poll(lambda: _http_status(f"http://{ADDRESSES['cyan']}:8080/health") == 200, 30)
    with connect(fleet.address("cyan")) as bus:
        run_job(bus, "stop", GATEWAY, 30)
    try:
        stopped = served_here(ctx, [current], serving)
        assert stopped.takes is False, stopped
    finally:
        with connect(fleet.address("cyan")) as bus:
            run_job(bus, "start", GATEWAY, 30)
    _gateways_back_and_settled(fleet)


def test_a_gateway_draining_for_a_restart_systemd_runs_may_serve_so_the_node_does_not_drain_unasked(fleet):
    # A breaker's case: cyan's gateway restarted (systemctl restart --no-block) while a request was in flight: its
    # stop drains it, /health answers 503, and it serves again a moment later. "Answered 503" made cyan "not
    # serving" and it drained unasked with peacock down. With a job queued systemd starts it again: unknown.
    from flatshare_ops.node.calls import served_here
    from flatshare_ops.node.context import NodeContext

    node = fleet.node("cyan")
    ctx = NodeContext("cyan", node.state_dir, ManagerAddress("user", node.manager.runtime_dir))
    current = fleet.current("cyan")
    serving = json.loads((fleet.releases("cyan") / current / "serving.json").read_text())
    assert _poll(lambda: _http_status(f"http://{ADDRESSES['cyan']}:8080/health") == 200, 30)  # serving first
    held = _hold_gateway_request("cyan", 8)  # the gateway's drain waits for it (up to its 5 s drain timeout)
    subprocess.run(["systemctl", "--user", "restart", "--no-block", GATEWAY], check=True, timeout=30,
                   env={**os.environ, "XDG_RUNTIME_DIR": str(node.manager.runtime_dir)})
    assert _poll(lambda: _http_status(f"http://{ADDRESSES['cyan']}:8080/health") == 503, 5), "no drain seen"
    seen = served_here(ctx, [current], serving)
    held.join(20)
    assert seen.takes is None, seen
    assert any("answered 503" in r and "a job queued" in r for r in seen.reasons), seen.reasons
    _gateways_back_and_settled(fleet)


def test_a_drain_that_waits_for_calls_decides_its_admission_again_and_a_refusal_changes_nothing(fleet):
    # Two breakers' cases: cyan admitted (peacock served), then its voice drain waited for a call to end while
    # peacock's gateway went down: cyan stopped its gateway 10 s later on the old admission (no node took calls),
    # and, once that was decided again at the gateway's stop, its voice worker had still been drained the whole
    # wait (a drained worker takes no calls) and the refusal left a journal for a whole switch. An admission
    # older than ADMISSION_FRESH_S is decided again while the drain waits: refused, the drain ends, the journal
    # goes, nothing is recorded (nothing changed), exit 3 like any refusal.
    from flatshare_ops.node.steps import ADMISSION_FRESH_S

    fleet.new_hold("cyan")
    served, since = fleet.current("cyan"), len(fleet.history("cyan"))
    offset = fleet.log_size("cyan")
    cyan_gateway, peacock_gateway = _main_pid(fleet, "cyan", GATEWAY), _main_pid(fleet, "peacock", GATEWAY)
    call_s = int(ADMISSION_FRESH_S) + 15
    _hold_voice_call("cyan", call_s)  # the drain waits for it (the voice drain timeout is 20 s)
    argv, env = fleet.argv("release", "cyan")
    operator = fleet.popen(argv, env)
    try:
        fleet.wait_log("cyan", offset, r"waiting for the voice worker", operator)
        with _stopped(peacock_gateway):
            out = _finish(operator, 120)
    finally:
        if operator.poll() is None:
            operator.kill()
    log = fleet.log_since("cyan", offset)
    _no_traceback(out, log)
    assert operator.returncode == 3, out
    assert "cyan: admitted to drain" in log, log  # the first admission: peacock served then
    assert re.search(r"the admission to drain was decided \d+ s ago \(more than 5 s\): deciding it again while the "
                     r"voice worker drains", log), log
    assert re.search(r"not admitted while the voice worker drains: release refused: cyan may not drain now: 0 other "
                     r"node\(s\) take calls.*nothing was changed", out), out
    assert "left behind" not in log.split("deciding it again")[1], log  # its own drain, not one left behind
    assert not re.search(r"step \d+/\d+ stop-gateway", log), log
    # cyan kept serving: its gateway never stopped (the same process), its voice drain ended well before the call
    # did, nothing switched, nothing to finish, nothing recorded.
    assert _main_pid(fleet, "cyan", GATEWAY) == cyan_gateway and fleet.unit_state("cyan", GATEWAY) == "active"
    assert not fleet.drain_file("cyan").exists() and fleet.current("cyan") == served
    assert not fleet.journal("cyan").exists() and len(fleet.history("cyan")) == since
    assert json.loads((fleet.drain_file("cyan").parent / "voice.status").read_text())["state"] != "drained"
    _released_again(fleet, "cyan")


def test_a_node_whose_current_link_is_gone_asks_where_its_running_gateway_answers(fleet):
    # A breaker's case: releases/current removed (status calls it damage) and the new release moving the gateway
    # to :8089: neither our link nor the new release names :8080, where the gateway systemd runs answers callers.
    # Where it answers is the loaded unit's own environment (systemd's word): cyan asks, and is refused.
    profile = fleet.node("cyan").profile
    original = profile.read_text()
    link = fleet.releases("cyan") / "current"
    served = fleet.current("cyan")
    fleet.new_hold("cyan")
    offset = fleet.log_size("cyan")
    try:
        profile.write_text(original.replace(':8080"', ':8089"'))
        link.unlink()
        with _stopped(_main_pid(fleet, "peacock", GATEWAY)):
            result = fleet.release("--node", "cyan", timeout=120)
    finally:
        profile.write_text(original)
        if not link.is_symlink():
            os.symlink(served, link)
    _asked_and_refused(fleet, "cyan", result, offset)
    assert fleet.current("cyan") == served
    _gateways_back_and_settled(fleet)


def test_an_automatic_rollback_after_calls_came_back_asks_for_its_own_drain(fleet, tmp_path):
    # A breaker's case: serving-check CRITICAL after the switch gave calls back (the engine says 0.33.0), and
    # peacock's gateway hung meanwhile: the rollback's drain is a new drain of the last node callers are served
    # at. It is asked for, refused, and the node keeps serving (the failed switch ends by the early-end rule).
    profile = fleet.node("cyan").profile
    original = profile.read_text()
    assert "[engine.environment]\n" in original
    fleet.new_hold("cyan")
    offset = fleet.log_size("cyan")
    go = tmp_path / "go"  # serving-check waits until peacock is hung
    peacock_gateway = _main_pid(fleet, "peacock", GATEWAY)
    try:
        profile.write_text(original.replace("[engine.environment]\n",
                                            '[engine.environment]\nFLATSHARE_STANDIN_VERSION = "0.33.0"\n'))
        with _release_waiting_in(fleet, "cyan", "serving-check", offset, go) as operator:
            assert _poll(lambda: _http_status(f"http://{ADDRESSES['cyan']}:8080/health") == 200, 30)  # calls came back
            with _stopped(peacock_gateway):
                go.touch()
                out = _finish(operator, 120)
    finally:
        profile.write_text(original)
    log = fleet.log_since("cyan", offset)
    _no_traceback(out, log)
    assert "CRITICAL vllm_release" in log, log
    assert "automatic rollback refused: cyan may not drain now" in out, out
    assert operator.returncode == 1, out
    # The rollback never drained: no step of it ran, and cyan answered callers throughout.
    assert not re.search(r"step \d+/11 (drain-voice|stop-gateway)", log), log
    assert _poll(lambda: _http_status(f"http://{ADDRESSES['cyan']}:8080/health") == 200, 30)
    _released_again(fleet, "cyan")


def test_one_health_answer_missed_under_load_is_no_verdict_on_the_release(fleet, tmp_path):
    # A CI run's case: the switch's serving-check found the stand-in engine's /health past its 2 s bound once,
    # on a loaded machine, and failed the release. The engine stopped (SIGSTOP) through the first check only:
    # the step checks again, finds it serving, and the release ends well.
    fleet.new_hold("cyan")
    offset = fleet.log_size("cyan")
    go = tmp_path / "go"
    with _release_waiting_in(fleet, "cyan", "serving-check", offset, go) as operator:
        engine = _main_pid(fleet, "cyan", ENGINE)
        with _stopped(engine):
            go.touch()
            fleet.wait_log("cyan", offset, r"serving-check CRITICAL: checking again in 2 s \(2 of 3", operator)
        out = _finish(operator, 120)
    _no_traceback(out, fleet.log_since("cyan", offset))
    assert operator.returncode == 0, out
    assert "CRITICAL health" in fleet.log_since("cyan", offset)
    last = fleet.history("cyan")[-1]
    assert (last["result"], last["after"]) == ("released", fleet.current("cyan")), last
    _gateways_back_and_settled(fleet)


def test_a_profile_whose_gateway_url_names_another_node_is_refused_before_any_node_is_asked(fleet):
    # A breaker's case: peacock's profile named cyan's gateway as its own (its gateway listening on its own
    # address all the same); its probe then answered for cyan's gateway. The release is refused, nothing changes.
    profile = fleet.node("peacock").profile
    original = profile.read_text()
    before = fleet.current("peacock")
    assert f'url = "http://{ADDRESSES["peacock"]}:8080"' in original
    profile.write_text(original.replace(f'url = "http://{ADDRESSES["peacock"]}:8080"',
                                        f'url = "http://{ADDRESSES["cyan"]}:8080"'))
    try:
        result = fleet.release("--node", "peacock", timeout=120)
    finally:
        profile.write_text(original)
    _no_traceback(result.stdout, result.stderr)
    assert result.returncode == 3, result.stdout + result.stderr
    assert (f"release refused: peacock's gateway.url http://{ADDRESSES['cyan']}:8080" in result.stderr + result.stdout
            and f"does not name {ADDRESSES['peacock']}" in result.stderr + result.stdout), result
    assert fleet.current("peacock") == before
    fleet.settled("peacock")


def test_a_node_serving_from_an_interrupted_switch_asks_for_admission_though_its_current_release_is_silent(fleet):
    # A switch that moves cyan's gateway to :8089 is killed after its gateway came back (on :8089), before
    # releases/current moved: the active release's :8080 refuses, the interrupted switch's :8089 serves callers.
    profile = fleet.node("cyan").profile
    original = profile.read_text()
    fleet.new_hold("cyan")
    try:
        profile.write_text(original.replace(':8080"', ':8089"'))
        killed = fleet.cli("release", "--inventory", str(fleet.inventory), "--root", str(fleet.checkout),
                           env={**faults(kill_after_step="end-voice-drain"), "FLATSHARE_NODE": "cyan"})
        assert "the node-side command ended without its outcome" in killed.stdout, killed.stdout + killed.stderr
        assert _poll(lambda: _http_status(f"http://{ADDRESSES['cyan']}:8089/health") == 200, 30)
        assert _http_status(f"http://{ADDRESSES['cyan']}:8080/health") is None  # nothing listens there
        fleet.new_hold("cyan")  # the next run replaces the interrupted switch: it drains again
        offset = fleet.log_size("cyan")
        with _stopped(_main_pid(fleet, "peacock", GATEWAY)):
            result = fleet.release("--node", "cyan", timeout=120)
        _asked_and_refused(fleet, "cyan", result, offset)
    finally:
        profile.write_text(original)
    _released_again(fleet, "cyan")


def test_the_voice_worker_systemd_runs_is_drained_and_probed_where_it_watches_whatever_current_says(fleet):
    # Two breakers' cases. A release moving peacock's layout.run_dir could never drain its running voice worker
    # (the drain file went where the worker does not watch). And that switch killed after the worker restarted
    # on the new run_dir left releases/current naming the old one's drain file: with the running worker drained
    # (its own file present), peacock was probed "takes calls" and cyan drained with both workers drained.
    # Where the worker watches is systemd's word: its loaded unit's FLATSHARE_DRAIN_FILE.
    profile = fleet.node("peacock").profile
    original = profile.read_text()
    old_run, new_run = fleet.drain_file("peacock").parent, fleet.drain_file("peacock").parent.with_name("flatshare2")
    assert f'run_dir = "{old_run}"' in original
    fleet.new_hold("peacock")
    offset = fleet.log_size("peacock")
    try:
        profile.write_text(original.replace(f'run_dir = "{old_run}"', f'run_dir = "{new_run}"'))
        _hold_voice_call("peacock", 3)  # the running worker has a call: the drain must reach it where it watches
        killed = fleet.cli("release", "--inventory", str(fleet.inventory), "--root", str(fleet.checkout),
                           env={**faults(kill_after_step="end-voice-drain"), "FLATSHARE_NODE": "peacock"})
        assert "the node-side command ended without its outcome" in killed.stdout, killed.stdout + killed.stderr
        log = fleet.log_since("peacock", offset)
        assert f"the running voice worker watches {old_run / 'voice.drain'} (its loaded unit's): draining it there" \
            in log and "voice worker drained" in log, log
        served = json.loads((fleet.releases("peacock") / "current/serving.json").read_text())
        assert served["voice"]["drain_file"] == str(old_run / "voice.drain")  # current was never moved
        # The worker systemd runs now watches the new run_dir: drained there, by hand, it takes no calls.
        (new_run / "voice.drain").write_text("by hand\n")
        assert _poll(lambda: json.loads((new_run / "voice.status").read_text()).get("state") == "drained", 10)
        answer = _probe_answer(fleet, "peacock")
        assert answer["takes_calls"] is False and any(str(new_run / "voice.drain") in p for p in answer["problems"]), answer
        fleet.new_hold("cyan")
        cyan_offset = fleet.log_size("cyan")
        result = fleet.release("--node", "cyan", timeout=120)
        _refused_without_draining(fleet, "cyan", result, cyan_offset)
        assert re.search(rf"^admission for cyan: peacock: does not take calls \(.*{re.escape(str(new_run / 'voice.drain'))} is present",
                         result.stdout, re.MULTILINE), result.stdout
    finally:
        (new_run / "voice.drain").unlink(missing_ok=True)
        profile.write_text(original)
    _released_again(fleet, "peacock")  # replaces the interrupted switch: back on the old run_dir
    assert not (new_run / "voice.drain").exists() and not (old_run / "voice.drain").exists()
    fleet.settled("cyan")


# =====================================================================================================
# 10. An operator's hold taken while a release switches the node
# =====================================================================================================


@SIGNALS
@pytest.mark.parametrize("step", ["drain-voice", "restart-engine", "serving-check"])
def test_a_hold_taken_while_a_release_switches_the_node_says_it_goes_on_and_stops_the_next(fleet, tmp_path, step):
    name = "cyan"
    fleet.new_hold(name)
    offset = fleet.log_size(name)
    go = tmp_path / "go"  # the step waits until the hold is taken
    with _release_waiting_in(fleet, name, step, offset, go) as operator:
        switcher = fleet.lock_holder(name)
        assert switcher, "no release holds the lock"
        held = fleet.cli("hold", "place", "--node", name, "-m", "E2 benchmark", "--inventory", str(fleet.inventory))
        go.touch()
        out = _finish(operator, 120)
    try:
        _no_traceback(held.stdout, held.stderr, out)
        assert held.returncode == 0, held.stdout + held.stderr
        assert re.search(rf"^{name}: note: a release is switching it now \(.*pid {switcher}\b.*\); the hold does "
                         "not stop that switch", held.stdout, re.MULTILINE), held.stdout
        record = json.loads((fleet.releases(name) / "hold.json").read_text())
        assert f"pid {switcher}" in record["during_release"], record
        # The running switch went on to its end; the next release is refused by the hold.
        assert operator.returncode == 0, out
        assert fleet.history(name)[-1]["result"] == "released"
        fleet.new_hold(name)
        refused = fleet.release("--node", name)
        assert refused.returncode == 3 and f"{name} is held by" in refused.stdout, refused.stdout
    finally:
        fleet.cli("hold", "lift", "--node", name, "--inventory", str(fleet.inventory))
    fleet.settled(name)


# =====================================================================================================
# 11. A connection kept from the start of a run is reopened, never reported from
# =====================================================================================================


def _kill_sessions_of(fleet: Fleet, name: str) -> list[int]:
    """SIGKILL every sshd session process of ``name``'s sshd listener (the operator's kept connection)."""
    listener = fleet.sandbox_state()[name]["sshd_pid"]
    sessions = [pid for pid in pids() if ppid(pid) == listener]
    for pid in sessions:
        _signal(pid, signal.SIGKILL)
    return sessions


KEPT = {
    # what runs -> (the command, whose release.log to watch, the line there when the other node's kept connection
    # is killed, whose connection is killed)
    "release --node cyan, during cyan's preflight (the admission probe of peacock is next)":
        (["--node", "cyan"], "cyan", r"cyan: preflight: can the new engine start", "peacock"),
    "release --all, during cyan's engine load (peacock's switch is next)":
        (["--all"], "cyan", r"waiting for http://\S+/health to answer 200", "peacock"),
    # (--all preflights every node first: peacock's switch reuses that preflight, at the same place)
    "release --all, during peacock's preflight (the admission probe of cyan, switched already, is next)":
        (["--all"], "peacock", r"peacock: preflight: (can the new engine start|reused the one passed)", "cyan"),
    "release --all, during peacock's engine load (the rollout's summary of cyan is next)":
        (["--all"], "peacock", r"waiting for http://\S+/health to answer 200", "cyan"),
}


@SESSIONS
@pytest.mark.parametrize("case", list(KEPT))
def test_a_kept_connection_killed_while_another_node_switches_is_reopened_not_reported(fleet, case):
    which, watched, marker, killed_on = KEPT[case]
    fleet.new_hold(*NODES)
    offset = fleet.log_size(watched)
    before = {n: len(fleet.history(n)) for n in NODES}
    monitor = CallsMonitor(fleet)
    monitor.start()
    try:
        with fleet.node_profile(watched, load="3"):
            operator = fleet.popen([str(BIN / "flatshare"), "release", *which, "--inventory", str(fleet.inventory),
                                    "--root", str(fleet.checkout)])
            try:
                fleet.wait_log(watched, offset, marker, operator)
                killed = _kill_sessions_of(fleet, killed_on)
                out = _finish(operator, 180)
            finally:
                if operator.poll() is None:
                    operator.kill()
    finally:
        monitor.stop()
    _no_traceback(out)
    assert killed, f"no session of the operator's on {killed_on} to kill"
    assert operator.returncode == 0, out
    assert "unreachable" not in out and "UNKNOWN" not in out, out
    assert not monitor.nobody_serving(), monitor.nobody_serving()[:5]  # a node took calls at every sample
    switched = NODES if "--all" in which else ("cyan",)
    for name in NODES:
        expected = ["released"] if name in switched else []
        assert [r["result"] for r in fleet.history(name)[before[name]:]] == expected, (name, out)
        fleet.settled(name)

