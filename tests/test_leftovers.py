"""Four leftovers of issue 20, each a behaviour: stale rendered files are drift and UPDATE removes them; ``profiles
set`` keeps a UTF-8 byte order mark; a release with nothing to do enables again what someone disabled; the
node and serving-check read ``releases/current`` by one rule.

Truth: bytes on disk, systemd's ``UnitFileState`` and ``InvocationID`` over D-Bus, the node's own reading of
``releases/current``. The release case runs on a sandbox fleet of its own (loopback block 80).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from conftest import loopback_pair, run_cli, snapshot

from flatshare_ops.check.run import run_checks
from flatshare_ops.errors import NodeStateError
from flatshare_ops.node.store import current_release
from flatshare_ops.common.systemd import connect, daemon_reload, manager, unit_property

VARIANT = Path("profiles/rtx-5060-ti-serve-vllm-0.33.toml")
OLD = "rtx-5060-ti-serve-vllm-0.33"
NEW = "rtx-5060-ti-serve-vllm-0.33-next"
ADDRESSES = loopback_pair(80)


# --- a renamed variant's old outputs ---------------------------------------------------------------------


def test_a_renamed_variants_old_outputs_are_drift_and_update_removes_them(checkout):
    text = (checkout / VARIANT).read_text()
    (checkout / VARIANT).write_text(text.replace(f'name = "{OLD}"', f'name = "{NEW}"'))
    # what a variant that rendered into monitoring/ would have left there under its old name
    (checkout / f"monitoring/{OLD}-rules.yml").write_text("groups: []\n")
    old_files = [*(checkout / "units" / OLD).iterdir(), checkout / f"profiles/{OLD}.serving.json",
                 checkout / f"monitoring/{OLD}-rules.yml"]
    assert all(p.is_file() for p in old_files)

    shown = run_cli("profiles", "render", "--root", str(checkout))
    assert shown.returncode == 1, shown.stdout + shown.stderr
    for path in old_files:
        name = path.relative_to(checkout)
        assert f"--- a/{name}\n+++ /dev/null" in shown.stdout, name  # a deletion, as git diff shows one
        assert str(name) in shown.stderr
    assert "stale" in shown.stderr

    others = {k: v for k, v in snapshot(checkout).items() if OLD not in k}  # NEW's names hold OLD's too
    updated = run_cli("profiles", "render", "--update", "--root", str(checkout))
    assert updated.returncode == 0, updated.stderr
    assert not any(p.exists() for p in old_files) and not (checkout / "units" / OLD).exists()
    assert (checkout / "units" / NEW / "flatshare-engine.service").is_file()
    assert (checkout / f"profiles/{NEW}.serving.json").is_file()
    assert {k: v for k, v in snapshot(checkout).items() if OLD not in k} == others  # nothing else touched
    assert run_cli("profiles", "render", "--root", str(checkout)).returncode == 0


# --- a byte order mark -------------------------------------------------------------------------------------


@pytest.mark.parametrize("line_end", ["\n", "\r\n"])
def test_profiles_set_keeps_a_utf8_byte_order_mark(checkout, line_end):
    profile = checkout / "profiles/rtx-5060-ti-serve.toml"
    original = profile.read_text().replace("\n", line_end)
    # Whatever the checkout's profile holds (after the README's own example, 0): the value as it is written there.
    (held,) = re.findall(r"^decode_hold_tokens = (\d+)", original, re.MULTILINE)
    new = "7" if held != "7" else "8"  # a change, whatever the profile holds
    profile.write_bytes(b"\xef\xbb\xbf" + original.encode())
    result = run_cli("profiles", "set", "engine.make_room.decode_hold_tokens", new, "--root", str(checkout))
    assert result.returncode == 0, result.stderr
    data = profile.read_bytes()
    assert data.startswith(b"\xef\xbb\xbf") and not data.startswith(b"\xef\xbb\xbf" * 2)
    body = data[3:].decode()
    assert f"decode_hold_tokens = {new}" in body and body.count("\r\n") == original.count("\r\n")
    # every other byte as it was: only the value changed
    assert body.replace(f"decode_hold_tokens = {new}", f"decode_hold_tokens = {held}") == original


# --- a release with nothing to do enables again -----------------------------------------------------------


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    from release_fleet import sandbox_fleet

    with sandbox_fleet(tmp_path_factory, ADDRESSES) as f:
        yield f


def _file_states(fleet, units):
    with connect(fleet.address("cyan")) as bus:
        return {u: bytes(unit_property(bus, u, "Unit", "UnitFileState")).decode() for u in units}


def _disable(fleet, units):
    with connect(fleet.address("cyan")) as bus:
        manager(bus).Manager.DisableUnitFiles([u.encode() for u in units], False)
        daemon_reload(bus)


def test_a_release_with_nothing_to_do_enables_again_what_someone_disabled_without_a_drain(fleet):
    units = ["flatshare.target", "serving-check.timer"]
    assert fleet.release("--node", "cyan").returncode in (0, 4)  # on the checkout's release
    assert set(_file_states(fleet, units).values()) == {"enabled"}
    _disable(fleet, units)
    assert set(_file_states(fleet, units).values()) == {"disabled"}
    before, history = fleet.invocations("cyan"), len(fleet.history("cyan"))

    dry = fleet.release("--node", "cyan", "--dry-run")
    assert dry.returncode == 4 and "would enable flatshare.target, serving-check.timer again" in dry.stdout, dry.stdout
    assert set(_file_states(fleet, units).values()) == {"disabled"}  # a dry run changes nothing

    result = fleet.release("--node", "cyan")
    assert result.returncode == 4, result.stdout  # nothing to do: no switch
    assert "enabled flatshare.target, serving-check.timer again" in result.stdout, result.stdout
    assert set(_file_states(fleet, units).values()) == {"enabled"}
    assert fleet.invocations("cyan") == before  # no service restarted: no drain
    assert len(fleet.history("cyan")) == history
    assert "enabled" not in fleet.release("--node", "cyan").stdout  # enabled: nothing said again
    fleet.settled("cyan")


# --- releases/current, one rule ----------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["absolute", "parent", "nested"])
def test_serving_check_refuses_a_current_link_the_node_refuses_in_the_same_words(tmp_path, form):
    releases = tmp_path / "state/releases"
    stored = releases / "0123456789abcdef"
    stored.mkdir(parents=True)
    (stored / "serving.json").write_text(json.dumps({"schema": 1}))
    target = {"absolute": str(stored), "parent": "../releases/0123456789abcdef", "nested": "x/0123456789abcdef"}[form]
    (releases / "current").symlink_to(target)
    with pytest.raises(NodeStateError) as node_side:
        current_release(releases.parent)
    report = run_checks(releases.parent, "cyan", tmp_path / "run")
    (finding,) = [f for f in report.findings if f.check == "release"]
    assert finding.status == "UNKNOWN" and finding.summary == str(node_side.value)
    assert os.readlink(releases / "current") == target  # read, never changed


def test_a_plain_current_link_passes_the_rule_on_both_sides(tmp_path):
    releases = tmp_path / "state/releases"
    (releases / "0123456789abcdef").mkdir(parents=True)
    (releases / "current").symlink_to("0123456789abcdef")
    assert current_release(releases.parent) == "0123456789abcdef"
    report = run_checks(releases.parent, "cyan", tmp_path / "run")
    assert not any("not at a release directory" in f.summary for f in report.findings)
    # It went on to read the release (which holds no serving.json here: named as the release's damage).
    assert any("serving.json: missing from release 0123456789abcdef" in f.summary for f in report.findings)
