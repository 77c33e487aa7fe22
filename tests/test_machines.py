"""Cyan and peacock as real Debian 12 machines (systemd as PID 1, journald, the service user, a real reboot),
taken through PRODUCTION.md's runbook from nothing with vLLM 0.32.0's real engine (issue 32).

The machines (``flatshare sandbox up --machines``) hold step 1 of the runbook and nothing more; everything
else is the tool's, through SSH, as on a production node: doctor, bootstrap with the host key, pin-module,
the first releases, serving-check from its own timer (its textfile scraped by Debian's node_exporter), a
reboot during calls, a make-room release of one machine and its rollback. Truth is read inside the machines
(``nsenter``: systemctl, journalctl, /proc, the files) and from node_exporter, never from what the tool says.

The tests share one pair of machines and run in order; each leaves them serving. CI runs the tier
(``make test``); ``-m "not machines"`` skips it.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import urllib.request
from pathlib import Path

import pytest

from conftest import REPO, calls_to, copy_checkout, installed_files, loopback_pair, run_cli, without_canaries
from flatshare_ops.common.poll import poll_until
from flatshare_ops.sandbox import machines
from flatshare_ops.sandbox.node_profile import module_pin

pytestmark = pytest.mark.machines

ADDRESSES = loopback_pair(84)
ENGINE = "flatshare-engine.service"
#: A release of real engines on 2 CPUs beside the rest of the suite (seconds).
CLI_TIMEOUT_S = 900


class Machines:
    """The scratch checkout, the machines' directory and helpers that look inside a machine."""

    def __init__(self, checkout: Path, base: Path) -> None:
        self.checkout, self.base, self.inventory = checkout, base, base / "fleet.toml"

    def cli(self, *args: str, timeout: float = CLI_TIMEOUT_S) -> subprocess.CompletedProcess:
        return run_cli(*args, "--inventory", str(self.inventory), timeout=timeout)

    def release(self, *args: str) -> subprocess.CompletedProcess:
        return self.cli("release", "--root", str(self.checkout), *args)

    def machine(self, name: str) -> machines.Machine:
        return machines.Machine(name, ADDRESSES[name], self.base)

    def run(self, name: str, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """``argv`` inside the machine, as its root."""
        keeper = json.loads((self.base / "machines.json").read_text())["machines"][name]["keeper_pid"]
        return machines.run_in(self.machine(name), keeper, list(argv), timeout)

    def file(self, name: str, path: str) -> Path:
        return self.machine(name).root / path.lstrip("/")

    def current(self, name: str) -> str:
        return self.file(name, "/var/lib/flatshare/releases/current").readlink().name

    def history(self, name: str) -> list[dict]:
        text = self.file(name, "/var/lib/flatshare/releases/history.jsonl").read_text()
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def show(self, name: str, unit: str, *props: str) -> dict[str, str]:
        done = self.run(name, "systemctl", "show", *(f"--property={p}" for p in props), unit)
        return dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)

    def health(self, name: str, port: int = 8000) -> int:
        try:
            with urllib.request.urlopen(f"http://{ADDRESSES[name]}:{port}/health", timeout=5) as answer:
                return answer.status
        except OSError:
            return 0

    def set_hold(self, node: str, value: int) -> None:
        profile = self.base / node / "profile.toml"
        done = run_cli("profiles", "set", "engine.make_room.decode_hold_tokens", str(value), "--profile",
                       str(profile), "--root", str(self.checkout))
        assert done.returncode == 0, done.stdout + done.stderr


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Two fresh machines: step 1 of the runbook only (no flatshare-ops, no service user, no units)."""
    scratch = tmp_path_factory.mktemp("machines")
    checkout = copy_checkout(REPO, scratch / "checkout")
    base = scratch / "m:1"  # a colon in the path (nspawn's --bind-ro=SOURCE:DEST escapes it)
    try:
        machines.up(base, REPO, checkout / "profiles/rtx-5060-ti-serve.toml", ADDRESSES, echo=lambda _l: None)
        without_canaries(base)  # the canary's analysis has its own tests (test_canary, test_real_engine)
        yield Machines(checkout, base)
    finally:
        machines.down(base, echo=lambda _l: None)


def _fingerprint(pub: Path) -> str:
    """SHA256:... of an OpenSSH public key file, as ssh-keygen -lf prints it (the node's console, runbook step 3)."""
    done = subprocess.run(["ssh-keygen", "-lf", str(pub)], capture_output=True, text=True, check=True)
    return done.stdout.split()[1]


def test_the_runbook_takes_two_fresh_debian_machines_to_serving_as_the_service_user(fleet):
    # 2. doctor: the machines' keys are not known yet.
    doctor = fleet.cli("doctor")
    assert re.search(r"FAIL\s+cyan known_hosts", doctor.stdout), doctor.stdout
    for name in ("cyan", "peacock"):
        # 3. the dry run shows the key and stops (exit 3), with the fingerprint the machine's own file has.
        fingerprint = _fingerprint(fleet.machine(name).host_key)
        dry = fleet.cli("node", "bootstrap", "--node", name, "--dry-run")
        assert dry.returncode == 3 and fingerprint in dry.stdout, dry.stdout + dry.stderr
        # 4. bootstrap, accepting that key.
        done = fleet.cli("node", "bootstrap", "--node", name, "--accept-host-key", fingerprint)
        assert done.returncode == 0, done.stdout + done.stderr
        assert fleet.run(name, "id", "-u", "flatshare").returncode == 0
        # The node side is installed without the sandbox (pip's record in the machine): the stand-in gateway and
        # voice worker run from the operator's package, bound read-only into the machine.
        installed = installed_files(fleet.file(name, "/opt/flatshare-ops/.venv"))
        assert "flatshare_ops/node/entry.py" in installed, installed
        assert not [f for f in installed if f.startswith("flatshare_ops/sandbox/")], installed
    # 5. pin the module the node built: the sha256 of the file in the machine, computed here.
    built = fleet.file("cyan", "/var/lib/flatshare/module/flatshare_make_room_serve.py").read_bytes()
    assert hashlib.sha256(built).hexdigest() == module_pin("vllm")
    for name in ("cyan", "peacock"):  # the profile the inventory names for the node is the one pinned
        pinned = run_cli("profiles", "pin-module", "--from-node", name, "--inventory", str(fleet.inventory),
                         "--root", str(fleet.checkout))
        assert pinned.returncode == 0, pinned.stdout + pinned.stderr
        assert f'sha256 = "{module_pin("vllm")}"' in (fleet.base / name / "profile.toml").read_text()
    # 6. the first releases (the rollout's node by node, no analysis: without_canaries).
    released = fleet.release("--all")
    assert released.returncode == 0, released.stdout[-3000:] + released.stderr[-3000:]
    for name in ("cyan", "peacock"):
        state = fleet.show(name, ENGINE, "ActiveState", "MainPID", "User", "StateDirectory", "Environment",
                           "KillMode", "UnitFileState")
        assert state["ActiveState"] == "active" and state["User"] == "flatshare", state
        assert state["StateDirectory"] == "flatshare/engine" and state["KillMode"] == "control-group", state
        assert "HOME=/var/lib/flatshare/engine" in state["Environment"].split(), state
        # The engine runs as flatshare (the kernel's view), and keeps vLLM's caches in its home.
        uid = fleet.run(name, "id", "-u", "flatshare").stdout.strip()
        status = fleet.run(name, "cat", f"/proc/{state['MainPID']}/status").stdout
        assert re.search(rf"^Uid:\s+{uid}\s", status, re.M), status
        cache = fleet.file(name, "/var/lib/flatshare/engine/.cache/vllm")
        assert cache.is_dir() and str(cache.stat().st_uid) == uid
        assert any((cache / "torch_compile_cache").rglob("*")), "torch.compile kept nothing in the engine's home"
        journal = fleet.run(name, "journalctl", "--unit", ENGINE, "--no-pager", "-o", "cat").stdout
        assert "Error saving model info cache" not in journal and "Permission denied" not in journal
        assert "PermissionError" not in journal
        # 7. check: OK over SSH.
        check = fleet.cli("check", "--node", name)
        assert check.returncode == 0, check.stdout + check.stderr
    assert fleet.show("cyan", "flatshare.target", "UnitFileState")["UnitFileState"] == "enabled"


def _scrape(name: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{ADDRESSES[name]}:{machines.NODE_EXPORTER_PORT}/metrics", timeout=10) as r:
        text = r.read().decode()
    found = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            found[key] = float(value)
    return found


def test_serving_check_from_its_timer_writes_the_textfile_node_exporter_reads_and_reads_the_journal(fleet):
    textfiles = {name: fleet.file(name, "/var/lib/prometheus/node-exporter/serving_check.prom")
                 for name in ("cyan", "peacock")}
    # A breaker's case: serving-check once run from root's crontab left a root-owned textfile, which the timer's
    # runs as flatshare can never replace (the directory is sticky). Bootstrap gives it back to the service user.
    assert fleet.run("cyan", "sh", "-c", "echo '# root was here' > /var/lib/prometheus/node-exporter/serving_check.prom"
                     " && chown root:root /var/lib/prometheus/node-exporter/serving_check.prom").returncode == 0
    again = fleet.cli("node", "bootstrap", "--node", "cyan")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "serving_check.prom was root's" in again.stdout, again.stdout
    since = {name: path.stat().st_mtime if path.exists() else 0.0 for name, path in textfiles.items()}
    # The timer runs serving-check.service every 60 s, as the service user (nothing is started by hand).
    assert poll_until(lambda: all(p.exists() and p.stat().st_mtime > since[n] for n, p in textfiles.items()), 150, 1.0), \
        {n: fleet.run(n, "systemctl", "status", "serving-check.service", "--no-pager").stdout for n in textfiles}
    for name, textfile in textfiles.items():
        uid = fleet.run(name, "id", "-u", "flatshare").stdout.strip()
        assert str(textfile.stat().st_uid) == uid  # written by serving-check as flatshare, not by root
        metrics = _scrape(name)
        assert metrics["node_textfile_scrape_error"] == 0
        statuses = {k: v for k, v in metrics.items() if k.startswith("flatshare_serving_check_status{")}
        assert statuses and set(statuses.values()) == {0.0}, statuses
        # The turn count comes from the engine's lines in the journal (real vLLM has no make-room counter):
        # OK means the check's user read them.
        assert metrics[f'flatshare_serving_check_status{{check="turn_hints",node="{name}"}}'] == 0
        last = fleet.show(name, "serving-check.service", "Result", "ExecMainStatus")
        assert last == {"Result": "success", "ExecMainStatus": "0"}, last


def _served(name: str) -> float:
    """Requests the node's engine finished since it started (vLLM's own ``vllm:request_success_total``), 0 when
    it does not answer."""
    try:
        with urllib.request.urlopen(f"http://{ADDRESSES[name]}:8000/metrics", timeout=5) as answer:
            text = answer.read().decode()
    except OSError:
        return 0.0
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total{"))


def test_a_reboot_of_cyan_during_calls_is_a_real_one_and_it_serves_again_by_itself(fleet):
    keeper = json.loads((fleet.base / "machines.json").read_text())["machines"]["cyan"]["keeper_pid"]
    pid1 = machines.init_pid(keeper)  # the machine's PID 1, as this machine numbers it: a new one after a reboot
    invocation = fleet.show("cyan", ENGINE, "InvocationID")["InvocationID"]
    served = _served("cyan")
    # Two seats, each pausing 1 s: calls dial cyan all through its reboot (a minute or more), and peacock, which
    # answers them meanwhile, is not kept busy for nothing.
    with calls_to(ADDRESSES, [(("cyan", "peacock"), 2)], tokens=8, timeout_s=120, join_s=180, pause_s=1.0) as reports:
        assert poll_until(lambda: _served("cyan") > served, 60, 0.2)  # the calls reach cyan's engine
        machines.reboot(fleet.base, "cyan", echo=lambda _l: None)
        assert poll_until(lambda: fleet.health("cyan") == 200 and fleet.health("cyan", 8080) == 200, 300, 1.0)
        assert poll_until(lambda: _served("cyan") > 0, 120, 0.5)  # the new boot's engine answers calls again
    bad = [r.line() for r in reports if not r.ended_well]
    assert reports and not bad, bad
    # Calls that dialled cyan while it was down were answered by peacock.
    assert any(r.gateway == "peacock" and any(a["gateway"] == "cyan" for a in r.attempts) for r in reports)
    assert machines.init_pid(keeper) not in (None, pid1)  # systemd-nspawn booted the machine again
    assert fleet.show("cyan", ENGINE, "InvocationID")["InvocationID"] != invocation  # started by the new boot
    # Production's torch.compile found its compiled model in the engine's home after the reboot, kept from the
    # boot before. (vLLM 0.32.0's CPU build then fails to load it, "'function' object has no attribute
    # 'finalize_loading'", and compiles again from inductor's cache, also there: docs/reference/machines.md.)
    boot = fleet.run("cyan", "journalctl", "--boot", "--unit", ENGINE, "--no-pager", "-o", "cat").stdout
    kept = "/var/lib/flatshare/engine/.cache/vllm/torch_compile_cache/torch_aot_compile/"
    found = [line for line in boot.splitlines() if kept in line and "saved AOT compiled function" not in line]
    assert any("Directly load AOT compilation from path" in line or "due to a load failure from" in line
               for line in found), "\n".join(line for line in boot.splitlines() if "AOT" in line)
    check = fleet.cli("check", "--node", "cyan")
    assert check.returncode == 0, check.stdout + check.stderr


def test_the_preflight_runs_as_the_engines_user_and_refuses_a_cache_it_cannot_write_before_any_drain(fleet):
    cache = "/var/lib/flatshare/engine/.cache/vllm"
    invocation = fleet.show("cyan", ENGINE, "InvocationID")["InvocationID"]
    assert fleet.run("cyan", "chown", "root:root", cache).returncode == 0
    fleet.set_hold("cyan", 7)
    try:
        refused = fleet.release("--node", "cyan")
        assert refused.returncode == 3, refused.stdout[-2000:] + refused.stderr[-2000:]
        assert fleet.show("cyan", ENGINE, "InvocationID")["InvocationID"] == invocation  # nothing restarted
        assert fleet.health("cyan", 8080) == 200  # never drained
    finally:
        fleet.run("cyan", "chown", "-R", "flatshare:flatshare", cache)
        fleet.set_hold("cyan", 48)


def test_a_make_room_release_and_its_rollback_on_a_machine(fleet):
    # One machine is enough: the fleet's release --all and rollback --all of a make-room change, with calls, the
    # canary's analysis and the golden answers, run on the real engines in test_real_engine. What only a machine
    # says: a running engine replaced and brought back under systemd as PID 1, as the service user.
    before = fleet.current("cyan")
    pid = fleet.show("cyan", ENGINE, "MainPID")["MainPID"]
    argv = fleet.run("cyan", "cat", f"/proc/{pid}/cmdline").stdout.split("\0")
    old = argv[argv.index("--additional-config.make_room.decode_hold_tokens") + 1]  # 0 after the README's example
    new = "48" if old == "0" else "0"
    fleet.set_hold("cyan", int(new))
    released = fleet.release("--node", "cyan")
    assert released.returncode == 0, released.stdout[-3000:] + released.stderr[-3000:]
    assert fleet.current("cyan") != before
    state = fleet.show("cyan", ENGINE, "MainPID", "User")
    assert state["User"] == "flatshare", state
    argv = fleet.run("cyan", "cat", f"/proc/{state['MainPID']}/cmdline").stdout.split("\0")
    assert argv[argv.index("--additional-config.make_room.decode_hold_tokens") + 1] == new
    rolled = fleet.cli("rollback", "--node", "cyan", "--root", str(fleet.checkout))
    assert rolled.returncode == 0, rolled.stdout[-3000:] + rolled.stderr[-3000:]
    assert fleet.current("cyan") == before
    assert fleet.history("cyan")[-1]["result"] == "rolled back"
    pid = fleet.show("cyan", ENGINE, "MainPID")["MainPID"]
    argv = fleet.run("cyan", "cat", f"/proc/{pid}/cmdline").stdout.split("\0")
    assert argv[argv.index("--additional-config.make_room.decode_hold_tokens") + 1] == old
    fleet.set_hold("cyan", int(old))
    # vLLM's sockets between its API server and engine core (VLLM_RPC_BASE_PATH, $TMPDIR) go to the engine's own
    # /tmp (PrivateTmp=: /tmp/systemd-private-BOOT-UNIT-X/tmp here), which systemd removes at each stop: after the
    # engine's starts (the first release, the two here) only the running engine's are left, in its own (without
    # it: three more sockets in /tmp at every start, left for good).
    assert fleet.show("cyan", ENGINE, "PrivateTmp") == {"PrivateTmp": "yes"}
    sockets = fleet.run("cyan", "find", "/tmp", "-xdev", "-type", "s").stdout.split()
    private = fleet.run("cyan", "find", "/tmp", "-maxdepth", "1", "-name", f"systemd-private-*-{ENGINE}-*").stdout.split()
    assert len(private) == 1 and sockets and all(s.startswith(private[0] + "/") for s in sockets), (private, sockets)


def test_up_again_says_to_boot_again_a_machine_booted_without_the_stand_ins(fleet):
    # A machine an earlier flatshare-ops booted has no mount point for the stand-ins (nspawn makes it at boot):
    # its gateway and voice worker would not start once bootstrap installs the node side without the sandbox.
    point = fleet.file("peacock", machines.STAND_INS + "/flatshare_ops")
    inside = fleet.run("peacock", "test", "-f", machines.STAND_INS + "/flatshare_ops/sandbox/gateway.py")
    assert point.is_dir() and inside.returncode == 0  # bound: the machine sees the operator's package there
    point.rmdir()  # the host's side of the mount point only: the machine keeps its mount
    try:
        with pytest.raises(machines.SandboxError) as refused:
            machines.up(fleet.base, REPO, fleet.checkout / "profiles/rtx-5060-ti-serve.toml", ADDRESSES,
                        echo=lambda _l: None)
        assert str(refused.value) == (
            f"peacock: it was booted by an earlier flatshare-ops, without the stand-in gateway and voice worker at "
            f"{machines.STAND_INS}; boot it again: 'flatshare sandbox down --dir {fleet.base}', then bring the "
            "machines up again")
    finally:
        point.mkdir()
    assert fleet.health("peacock", 8080) == 200  # nothing was stopped


def test_down_shuts_down_a_machine_whose_keeper_died_and_status_says_so_first(fleet):
    # A breaker's kind: the keeper (which boots a machine again after its reboot) killed, its machine still
    # running; 'sandbox down' then acted only through the keeper and left the machine running for good.
    import os
    import signal
    import socket

    keeper = json.loads((fleet.base / "machines.json").read_text())["machines"]["peacock"]["keeper_pid"]
    init = machines.init_pid(keeper)
    namespace = os.readlink(f"/proc/{init}/ns/pid")  # the machine's PID namespace, as the kernel names it
    os.kill(keeper, signal.SIGKILL)
    assert poll_until(lambda: not Path(f"/proc/{keeper}").exists() or
                      "Z" in Path(f"/proc/{keeper}/stat").read_text().split()[2], 30)
    socket.create_connection((ADDRESSES["peacock"], 22), timeout=5).close()  # the machine runs on without it

    said = run_cli("sandbox", "status", "--dir", str(fleet.base))
    assert said.returncode == 1, said.stdout + said.stderr
    assert "peacock: machine running without its keeper" in said.stdout, said.stdout
    assert re.search(r"^cyan: machine (running|degraded|starting), sshd up", said.stdout, re.MULTILINE), said.stdout

    down = run_cli("sandbox", "down", "--dir", str(fleet.base))
    assert down.returncode == 0, down.stdout + down.stderr

    def in_namespace() -> list[str]:
        found = []
        for proc in Path("/proc").iterdir():
            try:
                if proc.name.isdigit() and os.readlink(proc / "ns/pid") == namespace:
                    found.append(proc.name)
            except OSError:
                pass
        return found

    assert in_namespace() == [], in_namespace()
    with pytest.raises(OSError):
        socket.create_connection((ADDRESSES["peacock"], 22), timeout=2).close()
    after = run_cli("sandbox", "status", "--dir", str(fleet.base))
    assert after.returncode == 1 and "--machines" in after.stdout, after.stdout + after.stderr
