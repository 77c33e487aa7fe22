"""From the sandbox to production: a node survives a reboot, an operator's hold, the release carries its own
switcher, the system-scope path runs through its own bus, and the first-node runbook works on a fresh node."""

from __future__ import annotations

import json
import urllib.request
import re
import shutil
import zipfile
from pathlib import Path

import pytest

from conftest import installed_files, loopback_pair, run_cli, without_canaries
from flatshare_ops.common.http import wait_for_200
from flatshare_ops.config.profile import load_profile
from flatshare_ops.common.poll import poll_until
from flatshare_ops.sandbox.fleet import reboot
from flatshare_ops.common.systemd import connect, unit_property
from release_fleet import ENGINE, GATEWAY, VOICE, sandbox_fleet

ADDRESSES = loopback_pair(17)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    with sandbox_fleet(tmp_path_factory, ADDRESSES) as f:
        yield f


def _active(fleet, name: str) -> dict[str, bytes]:
    with connect(fleet.address(name)) as bus:
        return {u: unit_property(bus, u, "Unit", "ActiveState") for u in (ENGINE, GATEWAY, VOICE, "serving-check.timer")}


def test_a_released_node_serves_again_after_a_reboot_of_its_systemd(fleet):
    name = "peacock"
    fleet.set_hold(48 if fleet.hold(name) == "0" else 0)
    assert fleet.release("--node", name).returncode == 0
    node = fleet.node(name)
    reboot(fleet.base, name, echo=lambda _l: None)
    assert not node.run_dir.exists() or not (node.run_dir / "voice.status").exists()  # /run was cleared
    assert wait_for_200(f"http://{node.address}:8000/health", 60) == 200
    assert poll_until(lambda: set(_active(fleet, name).values()) == {b"active"}, 30), _active(fleet, name)
    assert poll_until(lambda: (node.run_dir / "voice.status").exists(), 10)  # the RuntimeDirectory came back
    fleet.settled(name)


def test_an_operators_hold_refuses_releases_and_rollbacks_to_its_node_and_is_not_a_drain(fleet):
    inventory = ["--inventory", str(fleet.inventory)]
    held = run_cli("hold", "place", "--node", "cyan", "-m", "E2 benchmark", *inventory)
    assert held.returncode == 0, held.stdout + held.stderr
    try:
        again = run_cli("hold", "place", "--node", "cyan", "-m", "twice", *inventory)
        assert again.returncode == 3 and "already held" in again.stderr + again.stdout
        status = run_cli("hold", "status", *inventory)
        assert "cyan: held by" in status.stdout and "E2 benchmark" in status.stdout and "peacock: not held" in status.stdout
        # The fleet's status says it too, as a field of the node's answer (and a held node is no unwell one: exit 0).
        overview = run_cli("status", "--json", *inventory)
        assert overview.returncode == 0, overview.stdout + overview.stderr
        answers = json.loads(overview.stdout)
        assert "E2 benchmark" in answers["cyan"]["hold"] and answers["peacock"]["hold"] is None, answers
        old = run_cli("lock", "status", *inventory)  # the old spelling is gone (issue 33): a usage error
        assert old.returncode == 2 and not old.stdout, old.stdout + old.stderr
        fleet.set_hold(next(v for v in (0, 48, 7) if str(v) not in (fleet.hold("cyan"), fleet.hold("peacock"))))
        before = fleet.current("cyan")
        refused = fleet.release("--node", "cyan")
        assert refused.returncode == 3 and "cyan is held by" in refused.stdout and "E2 benchmark" in refused.stdout
        rollback = run_cli("rollback", "--node", "cyan", *inventory, "--root", str(fleet.checkout))
        assert rollback.returncode == 3 and "E2 benchmark" in rollback.stdout
        assert fleet.current("cyan") == before
        # Not a drain: peacock's release is admitted while cyan is held (cyan takes calls).
        other = fleet.release("--node", "peacock")
        assert other.returncode == 0, other.stdout
        assert "cyan: takes calls, no release holds it" in other.stdout
    finally:
        lifted = run_cli("hold", "lift", "--node", "cyan", *inventory)
    assert lifted.returncode == 0 and "hold lifted" in lifted.stdout
    assert run_cli("hold", "lift", "--node", "cyan", *inventory).returncode == 4
    assert fleet.release("--node", "cyan").returncode == 0
    fleet.settled("cyan")


def test_the_release_carries_the_checkouts_own_switcher(fleet):
    import shutil

    from conftest import REPO

    code = fleet.checkout / "flatshare_ops"
    shutil.copytree(REPO / "flatshare_ops", code, ignore=shutil.ignore_patterns("__pycache__"))
    cli = code / "node/cli.py"
    anchor = "    ctx = _context(args)\n    stdin = _Stdin()\n"
    assert anchor in cli.read_text()
    cli.write_text(cli.read_text().replace(anchor, '    print("MARKER: this checkout\'s switcher", flush=True)\n' + anchor))
    try:
        # A value no other test releases: a release already stored keeps the switcher it was first stored with
        # (its id is its rendered files'), so the change must render a release the node has never stored,
        # whatever value the checkout's profile holds (after the README's own example it holds 0).
        fleet.set_hold(31 if fleet.hold("cyan") != "31" else 30)
        result = fleet.release("--node", "cyan")  # over SSH: nothing is reinstalled on the node
        assert result.returncode == 0, result.stdout
        assert re.search(r"^\[cyan [0-9:]+\] MARKER: this checkout's switcher", result.stdout, re.MULTILINE), result.stdout
        releases = fleet.node("cyan").state_dir / "releases"
        shipped = (releases / "current/switcher").read_text().strip()
        note = json.loads((releases / ".switchers" / shipped / "run.json").read_text())
        kept = zipfile.ZipFile(releases / ".switchers" / shipped / f"run-{note['sha256']}.zip")  # what runs there
        assert kept.read("flatshare_ops/node/cli.py").decode().count("MARKER") == 1
    finally:
        shutil.rmtree(code)
    fleet.set_hold(48 if fleet.hold("cyan") == "0" else 0)
    again = fleet.release("--node", "cyan")
    assert again.returncode == 0 and "MARKER" not in again.stdout
    fleet.settled("cyan")


def test_a_release_whose_own_serving_check_gives_no_report_is_checked_by_the_nodes_installed_one(fleet):
    # A breaker's case: a checkout whose serving-check printed nothing made the release's step UNKNOWN, and its
    # automatic rollback ran the same serving-check: it failed too, and the release that served was recorded as
    # failed. The node's installed serving-check (its timer's) checks when the shipped one gives no report.
    import shutil

    from conftest import REPO

    code = fleet.checkout / "flatshare_ops"
    shutil.copytree(REPO / "flatshare_ops", code, ignore=shutil.ignore_patterns("__pycache__"))
    (code / "check/cli.py").write_text("def main():\n    print('nothing a report could be made of')\n")
    try:
        fleet.set_hold(33 if fleet.hold("cyan") != "33" else 32)  # a release the node never stored
        result = fleet.release("--node", "cyan")
    finally:
        shutil.rmtree(code)
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"^\[cyan [0-9:]+\]   note: the release's own serving-check gave no report \(exit 0: nothing a "
                     r"report could be made of\): the node's installed serving-check \(its timer's\) checked instead$",
                     result.stdout, re.MULTILINE), result.stdout
    assert fleet.history("cyan")[-1]["result"] == "released"
    fleet.set_hold(48 if fleet.hold("cyan") == "0" else 0)
    assert fleet.release("--node", "cyan").returncode == 0
    fleet.settled("cyan")


@pytest.mark.parametrize("header, message", [
    ({"protocol": 99}, "the release's switcher speaks protocol 99, this node's entry point runs protocol 1 at most"),
    ({"lock_sha256": "0" * 64}, "needs the dependencies of a requirements.lock with sha256 " + "0" * 64),
])
def test_a_bundle_the_nodes_entry_point_cannot_run_is_refused_in_one_line(fleet, header, message):
    from flatshare_ops.control import commands
    from flatshare_ops.control.bundle import bundle
    from flatshare_ops.control.targets import targets

    (target,) = targets(fleet.inventory, ["peacock"], False)
    payload = {**bundle(fleet.checkout, target), **header}
    before = fleet.current("peacock")
    conn = target.connect()
    try:
        result = conn.run(commands.switch(target.spec, "refuse-me"), stdin=(json.dumps(payload) + "\n").encode())
    finally:
        conn.close()
    assert result.status == 3, result.output
    lines = [row for row in result.output.splitlines() if not row.startswith("::flatshare:")]
    assert len(lines) == 1 and message in lines[0], result.output
    assert fleet.current("peacock") == before


def _old_generation(package: Path) -> dict:
    """This checkout's switcher, zipped as a release ships it from code whose common/protocol.py defines no
    GENERATION (a switcher from before generations were written down): its description says generation 1."""
    import shutil

    from conftest import REPO
    from flatshare_ops.control.bundle import switcher

    code = package / "flatshare_ops"
    shutil.copytree(REPO / "flatshare_ops", code, ignore=shutil.ignore_patterns("__pycache__"))
    protocol_file = code / "common/protocol.py"
    text = protocol_file.read_text()
    assert "\nGENERATION = 2\n" in text
    protocol_file.write_text(text.replace("\nGENERATION = 2\n", "\n"))
    return switcher(code)


def test_a_switcher_older_than_the_node_runs_is_refused_and_a_stored_one_is_not_run(fleet, tmp_path):
    # A breaker's case: a release from a checkout before the admission fixes ran its own (older) switcher, which
    # drained the last serving node; and a rollback ran the stored switcher of the release it left, as old.
    from flatshare_ops.control import commands
    from flatshare_ops.control.bundle import bundle
    from flatshare_ops.control.targets import targets
    from flatshare_ops.node.entry import OLDEST_GENERATION

    assert OLDEST_GENERATION == 2
    old = _old_generation(tmp_path)
    (target,) = targets(fleet.inventory, ["peacock"], False)
    fleet.set_hold(48 if fleet.hold("peacock") == "0" else 0)  # a release with something to do
    payload = {**bundle(fleet.checkout, target), "switcher": old}
    before, records = fleet.current("peacock"), len(fleet.history("peacock"))
    releases = fleet.node("peacock").state_dir / "releases"
    conn = target.connect()
    try:
        result = conn.run(commands.switch(target.spec, "old-switcher"), stdin=(json.dumps(payload) + "\n").encode())
    finally:
        conn.close()
    assert result.status == 3, result.output
    lines = [row for row in result.output.splitlines() if not row.startswith("::flatshare:")]
    assert len(lines) == 1 and ("the release's switcher is generation 1, older than this node runs (2" in lines[0]), lines
    assert fleet.current("peacock") == before and len(fleet.history("peacock")) == records
    assert not (releases / ".switchers" / old["sha256"]).exists()  # never kept, so never run
    # The active release's stored switcher made old (as a release from an older checkout left it): the commands
    # without a bundle (here status) run the installed code instead, and say so.
    import base64

    data = base64.b64decode(old["zip_b64"])
    stored = releases / ".switchers" / old["sha256"]
    stored.mkdir(parents=True)
    (stored / "switcher.zip").write_bytes(data)
    pointer = releases / "current" / "switcher"
    kept = pointer.read_bytes()
    pointer.write_text(old["sha256"] + "\n")
    conn = target.connect()
    try:
        status = conn.run(commands.status(target.spec))
    finally:
        conn.close()
        pointer.write_bytes(kept)
        shutil.rmtree(stored)
    assert status.status == 0, status.output + status.errors
    assert (f"the active release's switcher {stored} is generation 1, older than this node runs (2): running the "
            "installed flatshare-ops instead") in status.errors, status.errors
    fleet.settled("peacock")


def _bus_owner(socket) -> int:
    """The pid owning org.freedesktop.systemd1 on the bus at ``socket`` (asked of the bus itself)."""
    from flatshare_ops.common.systemd import dbuslib

    lib = dbuslib()
    bus = lib.DBusAddress(f"unix:path={socket}".encode())
    bus.open()
    try:
        return int(bus.call_method(b"org.freedesktop.DBus", b"/org/freedesktop/DBus", b"org.freedesktop.DBus",
                                   b"GetConnectionUnixProcessID",
                                   lib.apply_signature(b"s", [b"org.freedesktop.systemd1"])).body)
    finally:
        bus.close()


@pytest.mark.xdist_group("test_production_path_system_scope")  # a fleet of its own: runs apart
def test_the_system_scope_path_runs_through_a_bus_of_its_own(tmp_path_factory):
    """Production's scope: the tool reaches systemd on the system bus (DBUS_SYSTEM_BUS_ADDRESS), here a
    sandbox node's own bus where its manager owns org.freedesktop.systemd1."""
    from pathlib import Path

    from conftest import REPO, copy_checkout
    from flatshare_ops.sandbox.fleet import SandboxNode, down, up

    addresses = loopback_pair(19)
    root = tmp_path_factory.mktemp("system-scope")
    checkout = copy_checkout(REPO, root / "checkout")
    base = root / "sandbox"
    try:  # an 'up' that fails half-way is brought down too
        up(base, checkout / "profiles/rtx-5060-ti-serve.toml", addresses, echo=lambda _l: None,
           system_scope=("peacock",))
        without_canaries(base)
        node = SandboxNode("peacock", addresses["peacock"], base, "system")
        state = json.loads((base / "state.json").read_text())
        assert _bus_owner(node.bus) == state["nodes"]["peacock"]["manager_pid"]
        assert not Path("/run/dbus/system_bus_socket").exists()  # no other system bus to reach by mistake
        assert 'scope = "system"' in (base / "fleet.toml").read_text()
        hold = load_profile(checkout / "profiles/rtx-5060-ti-serve.toml").profile.engine.make_room.decode_hold_tokens
        hold = "7" if hold != 7 else "8"  # a change, whatever the checkout's profile holds
        set_ = run_cli("profiles", "set", "engine.make_room.decode_hold_tokens", hold, "--root", str(checkout))
        assert set_.returncode == 0, set_.stderr
        inventory = ["--inventory", str(base / "fleet.toml"), "--root", str(checkout)]
        released = run_cli("release", "--node", "peacock", *inventory)
        assert released.returncode == 0, released.stdout + released.stderr
        checked = run_cli("check", "--node", "peacock", "--inventory", str(base / "fleet.toml"))
        assert checked.returncode == 0, checked.stdout
        argv = json.loads((node.state_dir / "releases/current/serving.json").read_text())["engine"]["argv"]
        assert argv[argv.index("--additional-config.make_room.decode_hold_tokens") + 1] == hold
        # Its boot: the manager and everything it ran killed (a power loss), then 'up' again. A system-scope
        # release's flatshare.target is WantedBy=multi-user.target, which the node's boot pulls in, as a system
        # manager's does; 'up' returns once the node serves.
        from flatshare_ops.sandbox.manager import stop_manager

        stop_manager(node.manager.name, json.loads((base / "state.json").read_text())["nodes"]["peacock"]["manager_pid"])
        said: list[str] = []
        up(base, checkout / "profiles/rtx-5060-ti-serve.toml", addresses, echo=said.append)
        assert "peacock: its release serves (its units active, the engine and the gateway answer /health)" in said, said
        for port in (8000, 8080):
            with urllib.request.urlopen(f"http://{addresses['peacock']}:{port}/health", timeout=5) as answer:
                assert answer.status == 200
    finally:
        down(base, echo=lambda _l: None)


@pytest.mark.xdist_group("test_production_path_runbook")  # a fleet of its own: runs apart
def test_the_first_node_runbook_brings_a_fresh_node_to_serving(tmp_path_factory):
    """PRODUCTION.md, "The first node: a runbook", step by step on a node with only sshd, its manager and
    an engine venv."""
    import subprocess

    from conftest import REPO, copy_checkout
    from flatshare_ops.sandbox.fleet import SandboxNode, down, up

    addresses = loopback_pair(21)
    root = tmp_path_factory.mktemp("runbook")
    checkout = copy_checkout(REPO, root / "checkout")
    base = root / "sandbox"
    up(base, checkout / "profiles/rtx-5060-ti-serve.toml", addresses, echo=lambda _l: None, bare=("cyan",))
    without_canaries(base)
    env = {"FLATSHARE_INVENTORY": str(base / "fleet.toml")}

    def flatshare(*args: str):
        return run_cli(*args, "--root", str(checkout), env=env) if args[0] not in ("check", "hold") \
            else run_cli(*args, env=env)

    node = SandboxNode("cyan", addresses["cyan"], base, bare=True)
    try:
        doctor = run_cli("doctor", "--root", str(checkout), env=env)
        assert doctor.returncode == 1 and "FAIL  cyan known_hosts" in doctor.stdout, doctor.stdout
        dry = flatshare("node", "bootstrap", "--node", "cyan", "--dry-run")
        assert dry.returncode == 3, dry.stdout
        # The fingerprint shown is the node's own, as ssh-keygen computes it from the node's host key.
        keygen = subprocess.run(["ssh-keygen", "-lf", str(node.ssh_dir / "ssh_host_ed25519_key.pub")],
                                capture_output=True, text=True, check=True).stdout.split()[1]
        assert f"--accept-host-key {keygen}" in dry.stdout
        assert not (node.ops_dir / ".venv").exists()  # the dry run changed nothing
        boot = flatshare("node", "bootstrap", "--node", "cyan", "--accept-host-key", keygen)
        assert boot.returncode == 0, boot.stdout + boot.stderr
        assert "FAIL" not in boot.stdout and (node.ops_dir / ".venv/bin/flatshare-node").exists()
        # What the node installed has its node side and no sandbox (the stand-ins run on the operator's machine):
        # pip's own record of the install, and the files there.
        installed = installed_files(node.ops_dir / ".venv")
        assert "flatshare_ops/node/entry.py" in installed and "flatshare_ops/check/run.py" in installed, installed
        assert not [f for f in installed if f.startswith("flatshare_ops/sandbox/")], installed
        assert not next((node.ops_dir / ".venv/lib").glob("python3*/site-packages/flatshare_ops/sandbox"), None)
        on_node = subprocess.run([str(node.ops_dir / ".venv/bin/flatshare"), "sandbox", "status", "--dir", str(base)],
                                 capture_output=True, text=True, timeout=60)
        assert on_node.returncode == 2 and "Traceback" not in on_node.stderr, on_node.stdout + on_node.stderr
        assert on_node.stderr.strip().splitlines() == [
            "flatshare: this install of flatshare-ops has no sandbox (a node's install leaves it out): run "
            "'flatshare sandbox' from a checkout, after 'make setup'"], on_node.stderr
        again = flatshare("node", "bootstrap", "--node", "cyan")  # idempotent
        assert again.returncode == 0 and "done  host key" not in again.stdout, again.stdout
        pin = flatshare("profiles", "pin-module", "--from-node", "cyan")
        assert pin.returncode == 0, pin.stdout + pin.stderr
        first = flatshare("release", "--node", "cyan")
        assert first.returncode == 0, first.stdout + first.stderr
        assert flatshare("check", "--node", "cyan").returncode == 0
        # "Run it again at any time": on a serving node too, without rebuilding the module under the engine.
        serving_again = flatshare("node", "bootstrap", "--node", "cyan")
        assert serving_again.returncode == 0 and "(not rebuilt)" in serving_again.stdout, serving_again.stdout
        assert flatshare("check", "--node", "cyan").returncode == 0
        reboot(base, "cyan", echo=lambda _l: None)
        assert wait_for_200(f"http://{node.address}:8000/health", 60) == 200
        assert poll_until(lambda: flatshare("check", "--node", "cyan").returncode == 0, 30)
        before = json.loads((node.state_dir / "releases/current/serving.json").read_text())["profile"]["sha256"]
        retain = load_profile(checkout / "profiles/rtx-5060-ti-serve.toml").profile.engine.make_room.retain_s
        retain = "29" if retain != 29 else "28"  # a change, whatever the checkout's profile holds
        assert run_cli("profiles", "set", "engine.make_room.retain_s", retain, "--root", str(checkout)).returncode == 0
        assert flatshare("release", "--node", "cyan").returncode == 0
        back = flatshare("rollback", "--node", "cyan")
        assert back.returncode == 0, back.stdout
        now = json.loads((node.state_dir / "releases/current/serving.json").read_text())["profile"]["sha256"]
        assert now == before and flatshare("check", "--node", "cyan").returncode == 0
    finally:
        down(base, echo=lambda _l: None)


# --- the operator's SSH config: a node behind a bastion ------------------------------------------------------


@pytest.fixture
def bastion(fleet, tmp_path):
    """A third sshd that only forwards (no command runs there), on the module's third address; yields
    (its address, its host key's public line, its log)."""
    import subprocess

    from conftest import loopback_nodes
    from flatshare_ops.common.poll import poll_until

    address = loopback_nodes(17, ("cyan", "peacock", "bastion"))["bastion"]
    key = tmp_path / "bastion_host_ed25519_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    log = tmp_path / "bastion.log"
    config = tmp_path / "sshd_config"
    config.write_text(f"ListenAddress {address}:2222\nHostKey {key}\nPidFile {tmp_path / 'sshd.pid'}\n"
                      f"AuthorizedKeysFile {fleet.base / 'ssh/authorized_keys'}\nPermitRootLogin prohibit-password\n"
                      "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
                      "AllowTcpForwarding yes\nPermitTTY no\nForceCommand /bin/false\nLogLevel DEBUG1\n")
    sshd = subprocess.Popen(["/usr/sbin/sshd", "-D", "-e", "-f", str(config)], stderr=log.open("wb"))
    try:
        import socket

        def listening():
            try:
                socket.create_connection((address, 2222), timeout=0.2).close()
                return True
            except OSError:
                return False

        assert poll_until(listening, 10)
        yield address, " ".join(key.with_suffix(".pub").read_text().split()[:2]), log
    finally:
        sshd.terminate()
        sshd.wait(10)


def _behind_bastion(fleet, tmp_path, bastion_address: str, bastion_key: str) -> Path:
    """An inventory whose cyan is the SSH config alias ``cyan-behind`` (no port, user or identity of its own),
    reached through ``jump-host``; its known_hosts lists the bastion as ``bastion_key``. Returns its path."""
    import tomlkit

    node = fleet.node("cyan")
    ssh_config = tmp_path / "ssh_config"
    ssh_config.write_text(
        f"Host cyan-behind\n  HostName {node.address}\n  Port 2222\n  User root\n"
        f"  IdentityFile {fleet.base / 'ssh/id_ed25519'}\n  ProxyJump jump-host\n"
        f"Host jump-host\n  HostName {bastion_address}\n  Port 2222\n  User root\n"
        f"  IdentityFile {fleet.base / 'ssh/id_ed25519'}\n")
    known = tmp_path / "known_hosts"
    known.write_text((fleet.base / "ssh/known_hosts").read_text() + f"[{bastion_address}]:2222 {bastion_key}\n")
    doc = tomlkit.parse(fleet.inventory.read_text())
    cyan = doc["nodes"]["cyan"]
    for key in ("port", "user", "identity"):
        del cyan[key]
    cyan["host"] = "cyan-behind"
    cyan["profile"] = str(fleet.base / cyan["profile"])
    cyan["runtime_dir"] = str(fleet.base / cyan["runtime_dir"])
    for name in doc["nodes"]:
        doc["nodes"][name]["known_hosts"] = str(known)
    doc["nodes"]["peacock"]["profile"] = str(fleet.base / doc["nodes"]["peacock"]["profile"])
    doc["nodes"]["peacock"]["runtime_dir"] = str(fleet.base / doc["nodes"]["peacock"]["runtime_dir"])
    doc["nodes"]["peacock"]["identity"] = str(fleet.base / doc["nodes"]["peacock"]["identity"])
    doc.setdefault("transport", tomlkit.table())["ssh_config"] = str(ssh_config)
    inventory = tmp_path / "fleet.toml"
    inventory.write_text(tomlkit.dumps(doc))
    return inventory


def test_a_release_reaches_a_node_behind_a_bastion_named_only_in_the_operators_ssh_config(fleet, bastion, tmp_path):
    address, key, log = bastion
    inventory = _behind_bastion(fleet, tmp_path, address, key)
    fleet.set_hold(next(v for v in (0, 48, 7) if str(v) != fleet.hold("cyan")))
    done = run_cli("release", "--node", "cyan", "--inventory", str(inventory), "--root", str(fleet.checkout),
                   timeout=fleet.cli_timeout_s)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert fleet.current("cyan") == fleet.expected_id("cyan")
    # The bastion's own sshd forwarded to cyan's sshd (its debug log), and ran no command.
    forwarded = log.read_text()
    assert f"server_request_direct_tcpip: originator 127.0.0.1 port 0, target {fleet.node('cyan').address} port 2222" \
        in forwarded, forwarded[-2000:]
    fleet.settled("cyan")


def test_a_bastion_whose_host_key_is_not_the_known_one_is_refused(fleet, bastion, tmp_path):
    import subprocess

    address, _key, log = bastion
    other = tmp_path / "other"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    inventory = _behind_bastion(fleet, tmp_path, address, " ".join(other.with_suffix(".pub").read_text().split()[:2]))
    before = fleet.current("cyan")
    done = run_cli("status", "--node", "cyan", "--inventory", str(inventory))
    assert done.returncode == 6, done.stdout + done.stderr  # unreachable: the same code in every command
    assert f"{address}" in done.stdout + done.stderr and "host key" in (done.stdout + done.stderr).lower()
    seen = log.read_text()
    assert "KEX done [preauth]" in seen and "Accepted publickey" not in seen  # we stopped before authenticating
    assert fleet.current("cyan") == before
