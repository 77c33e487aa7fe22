"""Rendered units: systemd-analyze verify is silent, and hostile values reach the process intact.

The escaping test loads units rendered from a profile full of characters
systemd treats specially into a real systemd user manager, then compares
what systemd reports over D-Bus, and the argv of the process it starts
(``/proc/PID/cmdline``), with the values the profile holds.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from flatshare_ops.config.profile import load_profile
from flatshare_ops.render import render_profile
from flatshare_ops.render.units import UNIT_NAMES, unit_programs
from flatshare_ops.common.systemd import (
    ManagerAddress, connect, daemon_reload, exec_start_argv, manager, run_job, unit_property,
)
from flatshare_ops.render.verify import verify_units

HOSTILE_ARGS = [
    "100%", "%n", "%%h", "$HOME", "${PATH}", "$$", 'say "hi"', "back\\slash", "\\n", "two words",
    ";", "a;b", "'single'", "trailing\\",
]
HOSTILE_ENV = 'a b "c" \\d %n $HOME ; e'


def _hostile_profile(root: Path) -> Path:
    """A profile whose voice command and engine environment hold every character systemd treats specially."""
    def toml_string(s: str) -> str:
        return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'

    args = ", ".join(toml_string(a) for a in [sys.executable, "-c", "import time; time.sleep(600)", *HOSTILE_ARGS])
    child = root / "hostile.toml"
    child.write_text(
        f'extends = "{REPO}/profiles/rtx-5060-ti-serve.toml"\n'
        f"[voice]\ncommand = [{args}]\n"
        f"[engine.environment]\nHOSTILE = {toml_string(HOSTILE_ENV)}\n"
        '[layout]\nscope = "user"\n'
    )
    return child


def test_systemd_analyze_verify_prints_nothing_for_the_rendered_units():
    loaded = load_profile(REPO / "profiles/rtx-5060-ti-serve.toml")
    rendered = render_profile(loaded)
    assert set(rendered.units) == set(UNIT_NAMES)
    assert verify_units(rendered.units, unit_programs(loaded.profile)) == ""


def test_verify_reports_a_broken_unit():
    loaded = load_profile(REPO / "profiles/rtx-5060-ti-serve.toml")
    units = render_profile(loaded).units
    units["flatshare-voice.service"] += "NoSuchSetting=1\n"
    output = verify_units(units, unit_programs(loaded.profile))
    assert "Unknown key 'NoSuchSetting'" in output


def test_hostile_values_reach_systemd_and_the_process_exactly(tmp_path, user_manager):
    loaded = load_profile(_hostile_profile(tmp_path))
    units = render_profile(loaded).units
    intended = [sys.executable, "-c", "import time; time.sleep(600)", *HOSTILE_ARGS]
    (user_manager.unit_dir / "flatshare-voice.service").write_text(units["flatshare-voice.service"])
    (user_manager.unit_dir / "flatshare-engine.service").write_text(units["flatshare-engine.service"])
    address = ManagerAddress("user", user_manager.runtime_dir)
    try:
        with connect(address) as bus:
            daemon_reload(bus)
            # systemd keeps "$" unexpanded until exec time, so D-Bus shows "$$" for a literal "$".
            assert exec_start_argv(bus, "flatshare-voice.service") == [[a.replace("$", "$$") for a in intended]]
            env = [e.decode() for e in unit_property(bus, "flatshare-engine.service", "Service", "Environment")]
            assert f"HOSTILE={HOSTILE_ENV}" in env

            # Type=exec: the start job is done once the program has been exec'd.
            run_job(bus, "start", "flatshare-voice.service", 30)
            pid = unit_property(bus, "flatshare-voice.service", "Service", "MainPID")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1]
            assert [a.decode() for a in cmdline] == intended
    finally:
        with connect(address) as bus:
            manager(bus).Manager.StopUnit(b"flatshare-voice.service", b"replace")
        for name in ("flatshare-voice.service", "flatshare-engine.service"):
            (user_manager.unit_dir / name).unlink(missing_ok=True)
        with connect(address) as bus:
            daemon_reload(bus)


def test_gateway_stop_timeout_outlasts_its_drain_as_systemd_reads_it(tmp_path, user_manager):
    child = tmp_path / "user.toml"
    child.write_text(f'extends = "{REPO}/profiles/rtx-5060-ti-serve.toml"\n[layout]\nscope = "user"\n')
    loaded = load_profile(child)
    (user_manager.unit_dir / "flatshare-gateway.service").write_text(render_profile(loaded).units["flatshare-gateway.service"])
    address = ManagerAddress("user", user_manager.runtime_dir)
    try:
        with connect(address) as bus:
            daemon_reload(bus)
            stop_usec = unit_property(bus, "flatshare-gateway.service", "Service", "TimeoutStopUSec")
        assert stop_usec > loaded.profile.gateway.drain_timeout_s * 1_000_000
    finally:
        (user_manager.unit_dir / "flatshare-gateway.service").unlink()


@pytest.mark.parametrize("bad", ["line\nbreak", "tab\there", "bell\x07", "del\x7f"])
def test_escaping_refuses_control_characters(bad):
    from flatshare_ops.render.systemd_escape import UnsafeValueError, environment_assignment, exec_command

    with pytest.raises(UnsafeValueError):
        exec_command(["/bin/true", bad])
    with pytest.raises(UnsafeValueError):
        environment_assignment("X", bad)


def test_the_unit_reader_splits_commands_where_systemd_does(user_manager):
    """common.unit_file reads Exec lines as systemd does: a bare ';' separates commands, a quoted or
    escaped one is an argument (checked against systemd's own reading over D-Bus)."""
    from flatshare_ops.common import unit_file

    text = ("[Service]\nType=oneshot\n"
            "ExecStart=/bin/true \";\" a ; /bin/true \\; 'b c' ;x y; \"\" %%\n"
            "ExecStart=/bin/echo ';'\n"
            # Unicode line separators are no line end and no space to systemd (Python's splitlines and
            # strip would make them both).
            "ExecStart=/bin/echo a\u2028b \u0085c \u2029\n")
    name = "flatshare-reader-probe.service"
    (user_manager.unit_dir / name).write_text(text)
    address = ManagerAddress("user", user_manager.runtime_dir)
    try:
        with connect(address) as bus:
            daemon_reload(bus)
            systemd_reads = exec_start_argv(bus, name)
    finally:
        (user_manager.unit_dir / name).unlink()
        with connect(address) as bus:
            daemon_reload(bus)
    ours = [argv for line in unit_file.meaning(text)[("Service", "ExecStart")] for _prefix, argv in line]
    assert [list(a) for a in ours] == systemd_reads
    assert len(systemd_reads) == 4  # the bare ';' made two commands of the first line
    assert systemd_reads[-1] == ["/bin/echo", "a\u2028b", "\u0085c", "\u2029"]


def test_an_answer_that_came_while_the_caller_was_stopped_is_read_not_called_late(user_manager, tmp_path):
    """A bounded systemd exchange (common/systemd.py ``_in_child``) whose caller was stopped (SIGSTOP, a paused VM)
    until after its deadline, while the child got the manager's answer, returns that answer: the bound is on the
    manager, not on the caller's own pause. (A CI run saw a switch stopped by a test fault fail with "no answer
    from the user manager within 5 s" though the answer was waiting in the pipe.)"""
    script = tmp_path / "stopped_caller.py"
    script.write_text(
        "import os, signal, sys, time\n"
        "from pathlib import Path\n"
        "from flatshare_ops.common import systemd\n"
        "address = systemd.ManagerAddress('user', Path(sys.argv[1]))\n"
        "def work(bus):\n"
        "    parent = os.getppid()\n"
        "    if os.fork() == 0:  # lets the caller go on once its 2 s bound is long past\n"
        "        os.closerange(3, 4096)  # not holding the answer's pipe open\n"
        "        time.sleep(5)\n"
        "        os.kill(parent, signal.SIGCONT)\n"
        "        os._exit(0)\n"
        "    os.kill(parent, signal.SIGSTOP)\n"
        "    return systemd.unit_property(bus, 'flatshare.target', 'Unit', 'LoadState')\n"
        "print(systemd._in_child(address, work, 2.0, 'a test', wrappers=False))\n")
    result = subprocess.run([sys.executable, str(script), str(user_manager.runtime_dir)], capture_output=True,
                            text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() in ("loaded", "not-found"), result.stdout  # systemd's own word for the unit
