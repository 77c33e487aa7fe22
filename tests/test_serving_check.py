"""serving-check on the sandbox fleet: OK when all matches, and each kind of drift made for real
gives the right status, names the right thing and exits with the right code."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import TEST_ADDRESSES, run_cli
from flatshare_ops.check.checks import check_flags
from flatshare_ops.check.report import CRITICAL, OK, UNKNOWN
from flatshare_ops.common.http import wait_for_200
from flatshare_ops.common.vllm_argv import differences, read_argv
from flatshare_ops.render.systemd_escape import exec_command
from flatshare_ops.sandbox.fleet import SandboxNode
from flatshare_ops.common.systemd import ManagerAddress, connect, daemon_reload, run_job

ENGINE = "flatshare-engine.service"


def _node(sandbox: Path, name: str = "cyan") -> SandboxNode:
    return SandboxNode(name, TEST_ADDRESSES[name], sandbox)


def _check(sandbox: Path, *extra: str, name: str = "cyan"):
    node = _node(sandbox, name)
    return run_cli("--state-dir", str(node.state_dir), "--runtime-dir", str(node.manager.runtime_dir),
                   "--node-name", name, *extra, program="serving-check")


def _restart(sandbox: Path, unit: str = ENGINE, name: str = "cyan") -> None:
    node = _node(sandbox, name)
    with connect(ManagerAddress("user", node.manager.runtime_dir)) as bus:
        daemon_reload(bus)
        run_job(bus, "restart", unit, 60)
    assert wait_for_200(f"http://{node.address}:8000/health", 30) == 200


class DropIn:
    """A drop-in on a node's unit for the length of a test; removed (and the unit restarted) after."""

    def __init__(self, sandbox: Path, unit: str, text: str, name: str = "cyan", link: bool = False):
        self.sandbox, self.unit, self.name = sandbox, unit, name
        node = _node(sandbox, name)
        self.directory = node.manager.unit_dir / f"{unit}.d"
        self.path = self.directory / "50-test.conf"
        self.directory.mkdir(exist_ok=True)
        self.target: Path | None
        if link:
            self.target = node.root / "bench/e2-point.conf"
            self.target.parent.mkdir(exist_ok=True)
            self.target.write_text(text)
            self.path.symlink_to(self.target)
        else:
            self.target = None
            self.path.write_text(text)

    def remove(self, restart: bool = True) -> None:
        self.path.unlink(missing_ok=True)
        if self.target:
            self.target.unlink(missing_ok=True)
        if restart:
            _restart(self.sandbox, self.unit, self.name)
        else:
            with connect(ManagerAddress("user", _node(self.sandbox, self.name).manager.runtime_dir)) as bus:
                daemon_reload(bus)


def _serving(sandbox: Path, name: str = "cyan") -> dict:
    return json.loads((_node(sandbox, name).state_dir / "releases/current/serving.json").read_text())


def test_ok_when_everything_matches(sandbox):
    result = _check(sandbox)
    assert result.returncode == 0, result.stdout
    first = result.stdout.splitlines()[0]
    assert first.startswith("SERVING-CHECK OK - cyan: ") and " | " in first


def test_quiet_prints_nothing_when_ok(sandbox):
    result = _check(sandbox, "--quiet")
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


def test_a_flag_changed_through_a_drop_in_is_named_with_both_values(sandbox):
    argv = _serving(sandbox)["engine"]["argv"]
    changed = list(argv)
    index = changed.index("--additional-config.make_room.decode_hold_tokens") + 1
    profile_value = changed[index]
    changed[index] = "7" if profile_value != "7" else "8"
    drop_in = DropIn(sandbox, ENGINE, f"[Service]\nExecStart=\nExecStart={exec_command(changed)}\n")
    try:
        _restart(sandbox)
        result = _check(sandbox)
        assert result.returncode == 2, result.stdout
        assert result.stdout.startswith("SERVING-CHECK CRITICAL")
        assert (f"--additional-config.make_room.decode_hold_tokens: running {changed[index]}, profile {profile_value}"
                in result.stdout)
        assert f"drop-in {drop_in.path}" in result.stdout
    finally:
        drop_in.remove()
    assert _check(sandbox).returncode == 0


def test_a_different_vllm_version_is_critical(sandbox):
    drop_in = DropIn(sandbox, ENGINE, '[Service]\nEnvironment="FLATSHARE_STANDIN_VERSION=0.33.0"\n')
    try:
        _restart(sandbox)
        result = _check(sandbox, "--json")
        assert result.returncode == 2
        report = json.loads(result.stdout)
        (finding,) = [f for f in report["findings"] if f["check"] == "vllm_release"]
        assert finding["status"] == "CRITICAL"
        assert finding["details"] == ["GET /version: running 0.33.0, profile 0.32.0"]
    finally:
        drop_in.remove()


def test_a_module_rebuilt_after_the_engine_started_needs_a_restart(sandbox):
    serving = _serving(sandbox)
    module = Path(serving["module"]["path"])
    subprocess.run([sys.executable, "-m", "flatshare_ops.sandbox.module_build", "--out", str(module.parent),
                    "--patch", "1"], check=True)
    try:
        result = _check(sandbox)
        assert result.returncode == 2
        assert f"{module}: sha256 " in result.stdout and f"profile pins {serving['module']['sha256']}" in result.stdout
        assert "after the engine started" in result.stdout and "restart it" in result.stdout
    finally:
        _restart(sandbox)  # the pre-start step rebuilds the pinned module
    assert _check(sandbox).returncode == 0


def test_a_changed_installed_unit_is_critical(sandbox):
    unit = _node(sandbox).manager.unit_dir / "flatshare-voice.service"
    original = unit.read_bytes()
    unit.write_bytes(original + b"# edited on the node\n")
    try:
        result = _check(sandbox, "--json")
        report = json.loads(result.stdout)
        assert result.returncode == 2
        (units,) = [f for f in report["findings"] if f["check"] == "units"]
        assert units["status"] == "CRITICAL"
        assert units["details"][0].startswith("flatshare-voice.service: installed file differs from the release")
        (notes,) = [f for f in report["findings"] if f["check"] == "drop_ins"]
        assert "flatshare-voice.service: unit file changed on disk; systemd needs a daemon-reload" in notes["details"]
    finally:
        unit.write_bytes(original)
        with connect(ManagerAddress("user", _node(sandbox).manager.runtime_dir)) as bus:
            daemon_reload(bus)


def test_a_stopped_engine_is_critical(sandbox):
    node = _node(sandbox, "peacock")
    with connect(ManagerAddress("user", node.manager.runtime_dir)) as bus:
        run_job(bus, "stop", ENGINE, 30)
    try:
        result = _check(sandbox, name="peacock")
        assert result.returncode == 2
        assert "CRITICAL engine_unit: flatshare-engine.service is inactive, not running" in result.stdout
        # Why it is not running is in the engine's own output: serving-check quotes its last line, read here from
        # the file systemd appended the engine's output to (the node profile's layout.output).
        log = node.output_dir / f"{ENGINE}.log"
        last = [line for line in log.read_text(errors="replace").splitlines() if line.strip()][-1]
        assert f"last lines ({log})" in result.stdout and last in result.stdout, (last, result.stdout)
    finally:
        with connect(ManagerAddress("user", node.manager.runtime_dir)) as bus:
            run_job(bus, "start", ENGINE, 60)
        assert wait_for_200(f"http://{node.address}:8000/health", 30) == 200


def test_an_e2_drop_in_on_cyan_is_a_warning_naming_it(sandbox):
    drop_in = DropIn(sandbox, "flatshare-gateway.service", '[Service]\nEnvironment="E2_POINT=7"\n', link=True)
    try:
        with connect(ManagerAddress("user", _node(sandbox).manager.runtime_dir)) as bus:
            daemon_reload(bus)
        result = _check(sandbox)
        assert result.returncode == 1, result.stdout
        assert result.stdout.startswith("SERVING-CHECK WARNING")
        assert f"E2 drop-in {drop_in.path} -> {drop_in.target}" in result.stdout
    finally:
        drop_in.remove(restart=False)


def test_no_active_release_is_unknown(sandbox, tmp_path):
    result = run_cli("--state-dir", str(tmp_path), "--runtime-dir", str(_node(sandbox).manager.runtime_dir),
                     program="serving-check")
    assert result.returncode == 3
    assert result.stdout.startswith("SERVING-CHECK UNKNOWN")
    assert "serving.json not found" in result.stdout


def test_a_release_holding_the_lock_is_a_warning_never_ok(sandbox):
    from filelock import FileLock

    releases = _node(sandbox).state_dir / "releases"
    unit = _node(sandbox).manager.unit_dir / "flatshare-voice.service"
    original = unit.read_bytes()
    lock = FileLock(str(releases / ".lock"))
    lock.acquire(timeout=0)  # held as a release holds it: the kernel's lock table shows it
    unit.write_bytes(original + b"# mid-release\n")  # what a release in progress looks like
    try:
        result = _check(sandbox)
        assert result.returncode == 1, result.stdout
        assert (f"WARNING release: release in progress by pid {os.getpid()}, whose record lock.json is missing"
                in result.stdout)  # an old switcher's lock (releases/.lock only: adr/0011), lock.json not written
        assert "installed unit(s) differ from the release (a release in progress explains this)" in result.stdout
    finally:
        lock.release()
        unit.write_bytes(original)
        with connect(ManagerAddress("user", _node(sandbox).manager.runtime_dir)) as bus:
            daemon_reload(bus)


def test_a_lock_record_naming_a_live_pid_is_not_a_release(sandbox):
    """pid reuse: lock.json left by a killed release names a live process, but nobody holds the lock."""
    releases = _node(sandbox).state_dir / "releases"
    holder = {"host": os.uname().nodename, "pid": os.getpid(), "user": "root", "release": "next",
              "started_at": time.time()}
    (releases / "lock.json").write_text(json.dumps(holder))
    node = _node(sandbox)
    with connect(ManagerAddress("user", node.manager.runtime_dir)) as bus:
        run_job(bus, "stop", "flatshare-gateway.service", 30)
    try:
        result = _check(sandbox)
        assert result.returncode == 2, result.stdout
        assert "release in progress" not in result.stdout
        assert "CRITICAL services: the node does not take calls" in result.stdout
    finally:
        (releases / "lock.json").unlink()
        with connect(ManagerAddress("user", node.manager.runtime_dir)) as bus:
            run_job(bus, "start", "flatshare-gateway.service", 30)


def test_an_unfinished_switch_is_a_warning(sandbox):
    journal = _node(sandbox).state_dir / "releases/switching.json"
    journal.write_text(json.dumps({"schema": 2, "from": "a", "to": "b", "pid": 999999}))
    try:
        result = _check(sandbox)
        assert result.returncode == 1
        assert "unfinished switch from a to b" in result.stdout and "flatshare release" in result.stdout
        # A breaker's case: a journal of schema 1, which the switch refuses as damaged (exit 5), was "an unfinished
        # switch" to finish with 'flatshare release' here.
        journal.write_text(json.dumps({"schema": 1, "from": "a", "to": "b", "pid": 999999}))
        result = _check(sandbox)
        assert result.returncode == 1
        assert "unfinished switch (journal unreadable: of schema 1, not the 2 flatshare-ops reads)" in result.stdout
        assert "run 'flatshare release' to finish" not in result.stdout, result.stdout
    finally:
        journal.unlink()


def _voice_environment(sandbox: Path, name: str) -> dict[str, str]:
    """The running voice worker's environment, read from /proc by its MainPID as systemd gives it."""
    from flatshare_ops.common.systemd import unit_property

    with connect(ManagerAddress("user", _node(sandbox, name).manager.runtime_dir)) as bus:
        pid = int(unit_property(bus, "flatshare-voice.service", "Service", "MainPID"))
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode().partition("=")[::2] for e in entries if e)


def test_a_voice_worker_started_with_turn_hints_off_is_a_warning_with_no_call_needed(sandbox):
    drop_in = DropIn(sandbox, "flatshare-voice.service", '[Service]\nEnvironment="FLATSHARE_TURN_HINTS=0"\n', name="peacock")
    try:
        _restart(sandbox, "flatshare-voice.service", name="peacock")
        assert _voice_environment(sandbox, "peacock")["FLATSHARE_TURN_HINTS"] == "0"  # the drop-in reached it
        result = _check(sandbox, name="peacock")
        assert result.returncode == 1, result.stdout
        assert re.search(r"^WARNING turn_hints: the voice worker runs with FLATSHARE_TURN_HINTS=0, its release's unit "
                         r"gives FLATSHARE_TURN_HINTS=1", result.stdout, re.MULTILINE), result.stdout
    finally:
        drop_in.remove()  # restarts the voice worker with hints on
    assert _voice_environment(sandbox, "peacock")["FLATSHARE_TURN_HINTS"] == "1"
    result = _check(sandbox, name="peacock")
    assert result.returncode == 0 and re.search(r"^OK turn_hints:", result.stdout, re.MULTILINE), result.stdout


def test_agents_requests_alone_with_no_voice_turn_announced_are_ok(sandbox):
    # A breaker's case: right after a release, a node serving only the gateway's agent sessions (no voice call
    # yet) was WARNING "requests running but no voice turn announced": agents announce none.
    import threading

    from flatshare_ops.common.completions import post_completion, request_body

    node = _node(sandbox, "peacock")
    _restart(sandbox, ENGINE, name="peacock")  # a fresh engine: its turn counter starts at 0
    outcome = []
    agent = threading.Thread(target=lambda: outcome.append(post_completion(
        f"http://{node.address}:8080", request_body("an agent's step", 800), "agent-1", 60)))
    agent.start()
    try:
        def engine_metrics() -> dict[str, float]:
            text = urllib.request.urlopen(f"http://{node.address}:8000/metrics", timeout=5).read().decode()
            return {line.split("{")[0].split()[0]: float(line.split()[-1]) for line in text.splitlines()
                    if line.startswith(("vllm:num_requests_running", "flatshare:make_room_turns_announced_total"))}

        deadline = time.monotonic() + 10
        while engine_metrics().get("vllm:num_requests_running", 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        seen = engine_metrics()
        result = _check(sandbox, name="peacock")
        assert seen["vllm:num_requests_running"] >= 1 and seen["flatshare:make_room_turns_announced_total"] == 0, seen
        assert result.returncode == 0, result.stdout
        assert re.search(r"^OK turn_hints: 0 voice turns announced", result.stdout, re.MULTILINE), result.stdout
    finally:
        agent.join(90)
    assert outcome and outcome[0].done, outcome


def test_textfile_is_written_for_node_exporter(sandbox, tmp_path):
    result = _check(sandbox, "--quiet", "--textfile", str(tmp_path))
    assert result.returncode == 0
    assert [p.name for p in tmp_path.iterdir()] == ["serving_check.prom"]
    text = (tmp_path / "serving_check.prom").read_text()
    assert 'flatshare_serving_check_status{node="cyan",check="flags"} 0' in text
    assert "# TYPE flatshare_serving_check_last_run_timestamp_seconds gauge" in text


def test_remote_check_of_the_other_node_over_ssh(sandbox):
    result = run_cli("check", "--node", "peacock", "--inventory", str(sandbox / "fleet.toml"))
    assert result.returncode == 0, result.stdout
    assert result.stdout.startswith("SERVING-CHECK OK - peacock: ")


def test_all_nodes_json(sandbox):
    result = run_cli("check", "--all", "--json", "--inventory", str(sandbox / "fleet.toml"))
    assert result.returncode == 0
    assert {node: report["status"] for node, report in json.loads(result.stdout).items()} == {"cyan": "OK", "peacock": "OK"}


# --- comparing argv by meaning (pure) -------------------------------------------

BASE = ["/venv/bin/python3", "/venv/bin/vllm", "serve", "/m", "--port", "8000", "--async-scheduling",
        "--additional-config.make_room.decode_hold_tokens", "48", "--additional-config.make_room.take_reservations", "true"]


@pytest.mark.parametrize("running", [
    ["/venv/bin/vllm", "serve", "/m", "--async-scheduling", "--port=8000",
     "--additional-config.make_room.take_reservations", "true", "--additional-config.make_room.decode_hold_tokens", "48"],
    ["/venv/bin/vllm", "serve", "/m", "--port", "8000", "--async-scheduling",
     "--additional-config", '{"make_room": {"decode_hold_tokens": 48, "take_reservations": true}}'],
])
def test_equivalent_spellings_are_equal(running):
    assert differences(read_argv(running), read_argv(BASE)) == []


def test_differences_are_named_with_both_values():
    running = ["/venv/bin/vllm", "serve", "/m", "--port", "8001", "--no-async-scheduling", "--enforce-eager",
               "--additional-config.make_room.decode_hold_tokens", "0"]
    assert differences(read_argv(running), read_argv(BASE)) == [
        "--additional-config.make_room.decode_hold_tokens: running 0, profile 48",
        "--additional-config.make_room.take_reservations: missing (profile on)",
        "--async-scheduling: running off, profile on",
        "--enforce-eager: extra (running on)",
        "--port: running 8001, profile 8000",
    ]


def test_the_model_is_read():
    assert read_argv(BASE).model == "/m"


# --- words before meaning (pure) ------------------------------------------------

# vLLM reads --config FILE (it splices the YAML file's flags in); vllm_argv does not.
UNREADABLE = ["/venv/bin/vllm", "serve", "/m", "--config", "/etc/flatshare/vllm.yaml", "--port", "8000"]


def test_the_releases_command_line_running_word_for_word_is_ok_though_our_reader_cannot_read_it():
    assert not read_argv(UNREADABLE).ok
    for running in (["/venv/bin/python3", *UNREADABLE], ["/usr/bin/python3.11", *UNREADABLE], UNREADABLE):
        finding = check_flags(running, UNREADABLE, "0.32.0")
        assert (finding.status, finding.details) == (OK, []), finding.details
    # A release without an option table on the node: the same words need none.
    assert check_flags(["/venv/bin/python3", *BASE[1:]], BASE, "0.99.0").status == OK


def test_other_words_are_read_by_meaning_and_a_gap_in_the_reading_shows():
    finding = check_flags(["/venv/bin/python3", *UNREADABLE, "--enforce-eager"], UNREADABLE, "0.32.0")
    assert finding.status == CRITICAL
    assert any("unsupported: --config FILE" in line for line in finding.details), finding.details
    assert check_flags([*BASE, "--port", "8001"], BASE, "0.99.0").status == UNKNOWN
    # Words that differ and mean the same are OK, a word before the script that is no interpreter is read.
    assert check_flags(["/bin/sh", *BASE[1:]], BASE, "0.32.0").status == OK
    assert check_flags(["/venv/bin/vllm", "serve", "/m", "--port=8000", "--async-scheduling",
                        "--additional-config", '{"make_room": {"decode_hold_tokens": 48, "take_reservations": true}}'],
                       BASE, "0.32.0").status == OK


def test_a_local_check_imports_no_ssh_templates_schema_or_cli_framework(sandbox):
    node = _node(sandbox)
    code = (
        "import sys\n"
        "from flatshare_ops.check import cli as check_cli\n"
        "try:\n"
        f"    check_cli.main(['--quiet', '--state-dir', {str(node.state_dir)!r}, '--runtime-dir', {str(node.manager.runtime_dir)!r}])\n"
        "except SystemExit as e:\n"
        "    code = e.code\n"
        "heavy = ('paramiko', 'jinja2', 'typer', 'click', 'rich', 'pydantic', 'tomlkit', 'lxml', 'urllib.request')\n"
        "ours = sorted(m for m in sys.modules if m.startswith('flatshare_ops.'))\n"
        "print(code, sorted(m for m in heavy if m in sys.modules), ours)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    status, heavy, ours = result.stdout.strip().split(" ", 2)
    assert (status, heavy) == ("0", "[]"), result.stdout + result.stderr
    # Only serving-check's own modules, the shared standard-library part, the node's systemd module (and its
    # package, whose __init__ is a docstring) and the error table: none of the node's switch.
    allowed = ("flatshare_ops.check", "flatshare_ops.common", "flatshare_ops.common.systemd", "flatshare_ops.errors")
    assert all(m.startswith(allowed) or m == "flatshare_ops.node" for m in eval(ours)), ours  # noqa: S307


def test_a_drain_file_left_behind_is_critical(sandbox):
    drain = _node(sandbox).run_dir / "voice.drain"
    drain.write_text("left-over\n")
    try:
        result = _check(sandbox)
        assert result.returncode == 2
        assert "voice.drain is present with no release running: the voice worker takes no calls" in result.stdout
    finally:
        drain.unlink()


def test_an_unwritable_textfile_is_reported_beside_the_findings(sandbox, tmp_path):
    unit = _node(sandbox).manager.unit_dir / "flatshare-voice.service"
    original = unit.read_bytes()
    unit.write_bytes(original + b"# edited\n")
    try:
        result = _check(sandbox, "--textfile", str(tmp_path / "missing"))
        assert result.returncode == 2, result.stdout  # CRITICAL outranks the check's own UNKNOWN
        assert "UNKNOWN textfile: cannot write" in result.stdout
        assert "flatshare-voice.service: installed file differs from the release" in result.stdout
    finally:
        unit.write_bytes(original)
        with connect(ManagerAddress("user", _node(sandbox).manager.runtime_dir)) as bus:
            daemon_reload(bus)


@pytest.mark.parametrize("journal", ["[1]", "null", "{}", b"\xff\xfe\x00junk", "DIR"])
def test_an_odd_journal_never_crashes_the_check(sandbox, journal):
    path = _node(sandbox).state_dir / "releases/switching.json"
    if journal == "DIR":
        path.mkdir()
    elif isinstance(journal, bytes):
        path.write_bytes(journal)
    else:
        path.write_text(journal)
    try:
        result = _check(sandbox)
        assert result.returncode == 1, result.stdout + result.stderr
        assert re.search(r"unfinished switch \(journal unreadable: .+\): check the node", result.stdout), \
            result.stdout
        assert "Traceback" not in result.stdout + result.stderr
    finally:
        path.rmdir() if path.is_dir() else path.unlink()


@pytest.mark.parametrize("serving", ["{}", "[]", b"\xff\x00", "DIR"])
def test_an_odd_serving_json_is_unknown_not_a_crash(tmp_path, sandbox, serving):
    release = tmp_path / "releases/r1"
    release.mkdir(parents=True)
    (tmp_path / "releases/current").symlink_to("r1")
    path = release / "serving.json"
    if serving == "DIR":
        path.mkdir()
    elif isinstance(serving, bytes):
        path.write_bytes(serving)
    else:
        path.write_text(serving)
    result = run_cli("--state-dir", str(tmp_path), "--runtime-dir", str(_node(sandbox).manager.runtime_dir),
                     program="serving-check")
    assert result.returncode == 3, result.stdout + result.stderr
    assert result.stdout.startswith("SERVING-CHECK UNKNOWN") and "Traceback" not in result.stdout + result.stderr


def test_a_state_dir_that_is_a_file_is_unknown(tmp_path):
    state = tmp_path / "file"
    state.write_text("")
    result = run_cli("--state-dir", str(state), program="serving-check")
    assert result.returncode == 3 and "is not a directory" in result.stdout


def test_an_e2_drop_in_linked_since_the_last_reload_is_a_warning(sandbox):
    node = _node(sandbox)
    target = node.root / "bench/e2-late.conf"
    target.parent.mkdir(exist_ok=True)
    target.write_text('[Service]\nEnvironment="E2_POINT=9"\n')
    link = node.manager.unit_dir / "flatshare-engine.service.d/e2-late.conf"
    link.parent.mkdir(exist_ok=True)
    link.symlink_to(target)  # no daemon-reload
    try:
        result = _check(sandbox)
        assert result.returncode == 1, result.stdout
        assert f"E2 drop-in {link} -> {target}" in result.stdout
    finally:
        link.unlink()


def test_a_usage_error_is_unknown(sandbox):
    result = run_cli("--no-such-option", program="serving-check")
    assert result.returncode == 3 and result.stdout.startswith("SERVING-CHECK UNKNOWN")


def test_a_serving_json_newer_than_the_check_knows_is_unknown_not_critical(tmp_path, sandbox):
    release = tmp_path / "releases/r1"
    release.mkdir(parents=True)
    (tmp_path / "releases/current").symlink_to("r1")
    (release / "serving.json").write_text(json.dumps({"schema": 2, "engine": {}}))
    result = run_cli("--state-dir", str(tmp_path), "--runtime-dir", str(_node(sandbox).manager.runtime_dir),
                     program="serving-check")
    assert result.returncode == 3, result.stdout
    assert "serving.json schema 2 is newer than this serving-check knows (1)" in result.stdout


@pytest.mark.parametrize("status, body, installed, summary", [
    (0, b"", "0.32.0+cpu", "vLLM release unknown, profile 0.32.0"),  # a breaker's case: the API server stopped
    (200, b'{"version": "0.33.0"}', "0.32.0", "vLLM release is not 0.32.0"),
    (0, b"", "0.31.0", "vLLM release is not 0.32.0"),
])
def test_an_engine_that_gives_no_version_runs_an_unknown_release_not_another(status, body, installed, summary):
    from flatshare_ops.check.checks import check_vllm_release

    finding = check_vllm_release(status, body, installed, "0.32.0")
    assert (finding.status, finding.summary) == ("CRITICAL", summary), finding


@pytest.mark.parametrize("options", [[], ["-I"], ["-E"], ["-P"], ["-X", "utf8"], ["-c"]])
def test_the_engines_search_path_is_what_python_itself_builds(tmp_path, options):
    # Python's own sys.path for the same command line, environment and working directory is the judge.
    from flatshare_ops.check.module_origin import search_path

    script = tmp_path / "bin/engine"
    script.parent.mkdir()
    code = "import json, os, sys; print(json.dumps([os.path.abspath(p) for p in sys.path]))"
    script.write_text(code + "\n")
    argv = [sys.executable, *options, code] if options == ["-c"] else [sys.executable, *options, str(script)]
    env = {"PYTHONPATH": f"{tmp_path}/one{os.pathsep}two", "PATH": os.environ["PATH"]}
    python = json.loads(subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True,
                                       check=True).stdout)
    ours = search_path(argv, env, str(tmp_path))
    assert python[:len(ours)] == [os.path.abspath(p) for p in ours], (python, ours)
    assert len(ours) == len(python) or not python[len(ours)].startswith(str(tmp_path)), (python, ours)


def test_an_engine_that_imports_another_file_of_the_modules_name_is_critical(sandbox, tmp_path):
    # A breaker's case: a PYTHONPATH drop-in (or a file of the module's name in the venv's bin/, the script's
    # directory) made the engine import another module, and serving-check said the pinned file was as pinned.
    module = Path(_serving(sandbox)["module"]["path"])
    other = tmp_path / "alt" / module.name
    other.parent.mkdir()
    other.write_text('PATCH = "altered"\n')
    drop_in = DropIn(sandbox, ENGINE, f'[Service]\nEnvironment="PYTHONPATH={other.parent}"\n')
    try:
        _restart(sandbox)
        result = _check(sandbox)
        assert result.returncode == 2, result.stdout
        assert f"the engine imports {module.stem} from {other}, not {module}" in result.stdout, result.stdout
    finally:
        drop_in.remove()
    assert _check(sandbox).returncode == 0
