"""The vLLM 0.33.0 variant and the speculative-decoding switch, on the sandbox.

A node moves to the variant by pointing the inventory at it and releasing, and back by rollback
(the two engine venvs sit side by side, each with its own vLLM metadata); the preflight refuses
the variant on a node whose engine venv lacks 0.33.0. With the speculative switch on, the
engine runs --speculative-config, and serving-check compares it by meaning.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from conftest import loopback_pair, run_cli
from flatshare_ops.render.systemd_escape import exec_command
from flatshare_ops.common.systemd import connect, daemon_reload, run_job
from release_fleet import ENGINE, sandbox_fleet

ADDRESSES = loopback_pair(13)
VARIANT = "rtx-5060-ti-serve-vllm-0.33"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    with sandbox_fleet(tmp_path_factory, ADDRESSES) as f:
        yield f


def _version(fleet, name: str) -> str:
    with urllib.request.urlopen(f"http://{fleet.node(name).address}:8000/version", timeout=5) as answer:
        return json.loads(answer.read())["version"]


def _point(fleet, name: str, profile: str) -> str:
    """Point node ``name`` at another profile in the sandbox inventory; returns the old text."""
    text = fleet.inventory.read_text()
    block = text.split(f"[nodes.{name}]")[1].split("[nodes.")[0]
    line = next(row for row in block.splitlines() if row.startswith("profile = "))
    fleet.inventory.write_text(text.replace(f"[nodes.{name}]{block}",
                                            f"[nodes.{name}]{block.replace(line, f'profile = {json.dumps(profile)}')}"))
    return text


def _check(fleet, name: str) -> dict:
    node = fleet.node(name)
    result = run_cli("--state-dir", str(node.state_dir), "--runtime-dir", str(node.manager.runtime_dir), "--json",
                     program="serving-check")
    return json.loads(result.stdout)


def test_a_node_moves_to_the_0_33_variant_by_release_and_back_by_rollback(fleet):
    name = "cyan"
    assert fleet.release("--node", name).returncode in (0, 4)
    assert _version(fleet, name) == "0.32.0"
    before = fleet.current(name)
    original = _point(fleet, name, f"{name}/profile-{VARIANT}.toml")
    try:
        moved = fleet.release("--node", name, "-v")  # -v: the whole plan, with why the engine restarts
        assert moved.returncode == 0, moved.stdout
        assert "vllm_release changed: the engine restarts" in moved.stdout
        assert _version(fleet, name) == "0.33.0"
        assert _check(fleet, name)["status"] == "OK"
        back = run_cli("rollback", "--node", name, "--inventory", str(fleet.inventory), "--root", str(fleet.checkout))
        assert back.returncode == 0, back.stdout
        assert fleet.current(name) == before and _version(fleet, name) == "0.32.0"
        assert _check(fleet, name)["status"] == "OK"
    finally:
        fleet.inventory.write_text(original)
    fleet.settled(name)


def test_the_variant_is_refused_on_a_node_without_its_vllm(fleet):
    name = "peacock"
    venv = fleet.node(name).venv.with_name("engine-venv-0.33.0")
    aside = venv.with_name("engine-venv-0.33.0.aside")
    original = _point(fleet, name, f"{name}/profile-{VARIANT}.toml")
    venv.rename(aside)
    try:
        before = fleet.current(name)
        refused = fleet.release("--node", name)
        assert refused.returncode == 3, refused.stdout
        assert "has vLLM not installed, the release needs 0.33.0" in refused.stdout
        assert fleet.current(name) == before and _version(fleet, name) == "0.32.0"
    finally:
        aside.rename(venv)
        fleet.inventory.write_text(original)
    fleet.settled(name)


def _speculative_profile(fleet, name: str) -> tuple[Path, str]:
    """Turn the switch on in the node's profile, with a draft model that exists on the node."""
    node = fleet.node(name)
    draft = node.state_dir / "models/flatshare-chat-eagle3"
    draft.mkdir(parents=True, exist_ok=True)
    original = node.profile.read_text()
    node.profile.write_text(original + f'\n[engine.speculative]\nenabled = true\nmodel = {json.dumps(str(draft))}\n')
    return node.profile, original


def test_the_speculative_switch_is_released_and_checked_by_meaning(fleet):
    name = "peacock"
    profile, original = _speculative_profile(fleet, name)
    try:
        result = fleet.release("--node", name)
        assert result.returncode == 0, result.stdout
        serving = json.loads((fleet.node(name).state_dir / "releases/current/serving.json").read_text())
        argv = serving["engine"]["argv"]
        config = json.loads(argv[argv.index("--speculative-config") + 1])
        assert config["method"] == "eagle3" and config["num_speculative_tokens"] == 2
        assert _check(fleet, name)["status"] == "OK"

        def run_with(value: dict | str) -> dict:
            changed = list(argv)
            changed[changed.index("--speculative-config") + 1] = value if isinstance(value, str) else json.dumps(value)
            drop_in = fleet.node(name).manager.unit_dir / f"{ENGINE}.d/50-speculative.conf"
            drop_in.parent.mkdir(exist_ok=True)
            drop_in.write_text(f"[Service]\nExecStart=\nExecStart={exec_command(changed)}\n")
            with connect(fleet.address(name)) as bus:
                daemon_reload(bus)
                run_job(bus, "restart", ENGINE, 60)
            try:
                return next(f for f in _check(fleet, name)["findings"] if f["check"] == "flags")
            finally:
                drop_in.unlink()
                with connect(fleet.address(name)) as bus:
                    daemon_reload(bus)
                    run_job(bus, "restart", ENGINE, 60)

        reordered = '{ "num_speculative_tokens": 2,  "model": %s, "method": "eagle3" }' % json.dumps(config["model"])
        assert run_with(reordered)["status"] == "OK"
        changed = run_with({**config, "num_speculative_tokens": 3})
        assert changed["status"] == "CRITICAL"
        assert "--speculative-config.num_speculative_tokens: running 3, profile 2" in changed["details"]
    finally:
        profile.write_text(original)
    assert fleet.release("--node", name).returncode == 0
    fleet.settled(name)
