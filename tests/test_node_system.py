"""What the engine needs from a node's system, checked without a fleet: the shared libraries vLLM links against
(bootstrap, with the node's own ldd), the GPU's memory (nvidia-smi, a stand-in: there is no GPU here), and the
processes left in a stopped unit's control group (a real systemd user manager). The machines tier
(test_machines.py) runs the same paths on real Debian machines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flatshare_ops.control.bootstrap import FACTS, textfile_directory
from flatshare_ops.common.poll import poll_until
from flatshare_ops.node import gpu
from flatshare_ops.common.systemd import (ManagerAddress, control_group_processes, job, properties, reload,
                                        unit_processes)


def _facts(venv: Path) -> dict:
    want: dict[str, object] = {"dirs": [], "model": "x", "venv": str(venv), "build": "/nonexistent", "module": "/nonexistent",
            "user": None, "ops": "/nonexistent", "textfile": None}
    done = subprocess.run([sys.executable, "-c", FACTS, json.dumps(want)], capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def test_bootstrap_names_a_shared_library_vllms_extension_links_against_that_the_node_lacks(tmp_path):
    # A library the system lacks (made, linked against, then removed) and one the venv itself carries (as
    # torch/lib carries libc10.so, which ldd alone cannot find): only the first is the node's to install.
    libs = tmp_path / "libs"
    libs.mkdir()
    site = tmp_path / "venv/lib/python3.11/site-packages"
    (site / "torch/lib").mkdir(parents=True)
    (site / "vllm").mkdir(parents=True)
    stub = tmp_path / "stub.c"
    stub.write_text("int flatshare_stub(void) { return 1; }\n")
    for name, where in (("libflatsharegone.so.1", libs), ("libflatsharevenv.so", site / "torch/lib")):
        subprocess.run(["gcc", "-shared", "-fPIC", f"-Wl,-soname,{name}", "-o", str(where / name), str(stub)],
                       check=True)
    (libs / "libflatsharegone.so").symlink_to("libflatsharegone.so.1")
    subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,--no-as-needed", "-o", str(site / "vllm/_C.abi3.so"), str(stub), f"-L{libs}",
                    f"-L{site / 'torch/lib'}", "-lflatsharegone", "-lflatsharevenv"], check=True)
    for lib in libs.iterdir():
        lib.unlink()
    ldd = subprocess.run(["ldd", str(site / "vllm/_C.abi3.so")], capture_output=True, text=True).stdout
    assert "libflatsharegone.so.1 => not found" in ldd and "libflatsharevenv.so => not found" in ldd  # ldd alone
    assert _facts(tmp_path / "venv")["missing_libraries"] == ["libflatsharegone.so.1"]


def test_bootstrap_finds_nothing_missing_in_the_real_engine_venv():
    from flatshare_ops.sandbox.node_profile import engine_venv

    if not (engine_venv() / ".complete").is_file():
        pytest.skip(f"{engine_venv()} is not built (scripts/vllm-venvs.sh)")
    assert _facts(engine_venv())["missing_libraries"] == []  # libnuma1 is installed here (scripts/setup.sh)


def test_the_textfile_directory_is_read_from_serving_checks_command():
    assert textfile_directory(["/x/serving-check", "--quiet", "--textfile", "/var/lib/prom"]) == "/var/lib/prom"
    assert textfile_directory(["/x/serving-check", "--textfile=/d"]) == "/d"
    assert textfile_directory(["/x/serving-check", "--quiet"]) is None


def _nvidia_smi(tmp_path: Path, monkeypatch, script: str) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\n" + script)
    (bin_dir / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")


def test_gpu_memory_holders_as_nvidia_smi_lists_them(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert gpu.compute_processes() is None  # no nvidia-smi: nothing to ask (the switch says "not checked")
    _nvidia_smi(tmp_path, monkeypatch, 'test "$1" = --query-compute-apps=pid,used_memory || exit 9\n'
                                       'printf "4242, 14020\\n77, 512\\n"\n')
    assert gpu.compute_processes() == [(4242, 14020), (77, 512)]
    _nvidia_smi(tmp_path, monkeypatch, "exit 0\n")
    assert gpu.compute_processes() == []
    _nvidia_smi(tmp_path, monkeypatch, 'echo "NVIDIA-SMI has failed" >&2; exit 9\n')
    with pytest.raises(gpu.GpuUnreadable, match="exited 9: NVIDIA-SMI has failed"):
        gpu.compute_processes()
    _nvidia_smi(tmp_path, monkeypatch, 'echo "[N/A], [N/A]"\n')
    with pytest.raises(gpu.GpuUnreadable, match="not 'PID, MiB'"):
        gpu.compute_processes()


def test_a_units_processes_as_systemd_lists_them_and_none_once_it_stopped(user_manager):
    unit = "flatshare-test-processes.service"
    (user_manager.unit_dir / unit).write_text("[Service]\nExecStart=/bin/sh -c 'sleep 300 & exec sleep 301'\n")
    address = ManagerAddress("user", user_manager.runtime_dir)
    reload(address)
    assert unit_processes(address, unit) == []  # loaded, not running
    job(address, "start", unit, 30)
    try:
        assert poll_until(lambda: len(unit_processes(address, unit)) == 2, 10)
        main = properties(address, [(unit, "Service", "MainPID")])[f"{unit}/MainPID"]
        found = dict(unit_processes(address, unit))
        assert main in found and "sleep 301" in found[main]
        (other,) = set(found) - {main}
        assert Path(f"/proc/{other}/cmdline").read_bytes().split(b"\0")[:2] == [b"sleep", b"300"]
        # The kernel's answer (where systemd's call fails) is the same processes.
        group = properties(address, [(unit, "Service", "ControlGroup")])[f"{unit}/ControlGroup"]
        assert dict(control_group_processes(group)) == found
    finally:
        job(address, "stop", unit, 30)
    assert unit_processes(address, unit) == []
    assert control_group_processes(group) == [] and control_group_processes("") == []
    assert unit_processes(address, "flatshare-no-such-unit.service") == []


def test_an_early_end_starts_the_engine_again_only_once_nothing_of_the_old_one_is_left(user_manager, tmp_path):
    # A breaker's case (vLLM issue 55510's kind): a switch ended early between the engine's stop and its start
    # started a new engine while the old one's core still ran (a stop that did not end the whole control
    # group), so two engines held one card. The early end now waits for the group to empty, and leaves the
    # engine stopped, saying why, while anything of the old one remains. KillMode=process makes systemd's stop
    # end the main process only: the other stays in the group, as a core whose kill failed does.
    import io
    from types import SimpleNamespace

    from flatshare_ops.common.units import ENGINE_UNIT
    from flatshare_ops.node.context import NodeContext
    from flatshare_ops.node.output import ReleaseOutput
    from flatshare_ops.node.runner import _start_engine_again
    from flatshare_ops.node.steps import Switch

    (user_manager.unit_dir / ENGINE_UNIT).write_text(
        "[Service]\nExecStart=/bin/sh -c 'sleep 300 & exec sleep 301'\nKillMode=process\n")
    address = ManagerAddress("user", user_manager.runtime_dir)
    reload(address)
    job(address, "start", ENGINE_UNIT, 30)
    assert poll_until(lambda: len(unit_processes(address, ENGINE_UNIT)) == 2, 10)
    group = properties(address, [(ENGINE_UNIT, "Service", "ControlGroup")])[f"{ENGINE_UNIT}/ControlGroup"]
    job(address, "stop", ENGINE_UNIT, 30)
    (left,) = control_group_processes(group)  # the kernel's word: one process of the old engine remains
    said = io.StringIO()
    sw = Switch(ctx=NodeContext("cyan", tmp_path, address), plan=None,
                new=SimpleNamespace(serving={"engine": {"start_timeout_s": 20, "stop_timeout_s": 1}}),
                out=ReleaseOutput(None, said), engine_stopped=True)
    try:
        _start_engine_again(sw)
        state = properties(address, [(ENGINE_UNIT, "Unit", "ActiveState")])[f"{ENGINE_UNIT}/ActiveState"]
        assert state == "inactive", said.getvalue()  # never started beside it
        assert f"{ENGINE_UNIT} left stopped" in said.getvalue() and f"pid {left[0]}" in said.getvalue(), said.getvalue()
        assert sw.engine_deadline is None  # nothing loading for the early end to wait for
        os.kill(left[0], 9)
        assert poll_until(lambda: not control_group_processes(group), 10)
        _start_engine_again(sw)  # nothing of the old engine left: started
        main = properties(address, [(ENGINE_UNIT, "Service", "MainPID")])[f"{ENGINE_UNIT}/MainPID"]
        assert main and Path(f"/proc/{main}/cmdline").read_bytes().split(b"\0")[:2] == [b"sleep", b"301"]
        assert sw.engine_deadline is not None
    finally:
        job(address, "stop", ENGINE_UNIT, 30)
        for pid, _cmd in control_group_processes(group):
            os.kill(pid, 9)


def test_what_systemd_refuses_is_said_in_its_own_words_never_in_pystemds(user_manager):
    # A breaker's case: a switch's failure reason read "DBusBaseError: [err -5]: b'...' This is DBusBaseError,
    # a base error for DBus (i bet you did not see that coming) ...". The reason is systemd's message and name.
    from flatshare_ops.errors import SystemdError

    address = ManagerAddress("user", user_manager.runtime_dir)
    with pytest.raises(SystemdError) as raised:
        job(address, "start", "flatshare-no-such-unit.service", 10)
    said = str(raised.value)
    # systemctl's own words for the same request (systemd's message, read through another client)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(user_manager.runtime_dir)}
    theirs = subprocess.run(["systemctl", "--user", "start", "flatshare-no-such-unit.service"], capture_output=True,
                            text=True, env=env)
    assert theirs.returncode != 0
    assert "Unit flatshare-no-such-unit.service not found." in theirs.stderr, theirs.stderr
    assert "Unit flatshare-no-such-unit.service not found." in said, said
    assert said.endswith("not found. (NoSuchUnit)"), said  # systemd's error name (org.freedesktop.systemd1.NoSuchUnit)
    for pystemds in ("DBusBaseError", "[err ", "b'", "i bet"):
        assert pystemds not in said, said


def test_an_engine_home_that_is_a_dangling_link_is_named_as_such_by_vllms_own_preflight_and_the_nodes(tmp_path):
    # A breaker's case: HOME a symbolic link to nothing; the preflight blamed the directory above it ("... is
    # not a directory it may write"), or passed as root, and the engine then failed at its start.
    from flatshare_ops.node import preflight
    from flatshare_ops.sandbox.node_profile import engine_venv

    if not (engine_venv() / ".complete").is_file():
        pytest.skip(f"{engine_venv()} is not built (scripts/vllm-venvs.sh)")
    home = tmp_path / "engine"
    home.symlink_to(tmp_path / "gone")
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "VLLM_LOGGING_LEVEL": "ERROR"}
    answer = preflight.parse_with_venv(engine_venv(), [str(tmp_path / "model")], mode="preflight", env=env)
    assert (answer["ok"], answer["stage"]) == (False, "cache"), answer
    assert f"{home} is a symbolic link to {tmp_path / 'gone'}, which does not exist" in answer["error"], answer
    serving = {"engine": {"argv": [str(engine_venv() / "bin/vllm"), "serve", str(tmp_path / "model")],
                          "venv": str(engine_venv()), "environment": {"HOME": str(home)}}}
    found = preflight.run(serving).problems
    assert any(f"the engine's home {home} is a symbolic link to {tmp_path / 'gone'}, which does not exist" in p
               for p in found), found
    assert not os.path.exists(tmp_path / "gone")  # nothing made behind the link
