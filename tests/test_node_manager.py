"""The node's logic against a recording fake of its systemd manager (tests/fake_manager.py), in this process.

Each matrix here runs cases of a class that a test drives against a real manager too (named beside it), so
the fake never holds a behaviour alone: what the node asks of its manager, and what it makes of the answers,
for every value systemd may give.
"""

from __future__ import annotations

import io

import pytest

from fake_manager import FakeManager
from flatshare_ops.common.systemd import ManagerAddress
from flatshare_ops.common.units import CHECK_TIMER, ENGINE_UNIT, GATEWAY_UNIT, SERVICE_UNITS, TARGET_UNIT, VOICE_UNIT
from flatshare_ops.node.calls import services_down
from flatshare_ops.node.context import NodeContext
from flatshare_ops.node.output import ReleaseOutput
from flatshare_ops.node.steps import keep_enabled

#: Every UnitFileState systemd reports (systemctl(1), is-enabled's table), and "" for a unit it has not loaded,
#: but the masked ones: the node leaves a masked unit so, and no test drives that against a real manager (where the
#: units live, in the persistent configuration directory, a runtime mask has no effect and a persistent one
#: replaces the unit file).
UNIT_FILE_STATES = ("enabled", "enabled-runtime", "linked", "linked-runtime", "alias", "static", "indirect",
                    "disabled", "generated", "transient", "bad", "")
#: Every ActiveState (org.freedesktop.systemd1(5)).
ACTIVE_STATES = ("active", "reloading", "inactive", "failed", "activating", "deactivating", "maintenance",
                 "refreshing")


def _node(tmp_path, fake: FakeManager) -> NodeContext:
    return NodeContext("cyan", tmp_path / "state", ManagerAddress("user", tmp_path / "run"), manager=fake)


@pytest.mark.parametrize("dry_run", [False, True], ids=["release", "dry run"])
@pytest.mark.parametrize("state", UNIT_FILE_STATES)
def test_a_release_with_nothing_to_do_enables_again_a_unit_not_enabled(tmp_path, state, dry_run):
    # Against a real manager: tests/test_leftovers.py (disabled).
    fake = FakeManager({TARGET_UNIT: {"UnitFileState": state}, CHECK_TIMER: {"UnitFileState": "enabled"}})
    out = ReleaseOutput(None, stream=io.StringIO())
    done = keep_enabled(_node(tmp_path, fake), {TARGET_UNIT: "", CHECK_TIMER: ""}, out, dry_run=dry_run)
    again = state != "enabled"
    assert fake.asked("properties") == [(((TARGET_UNIT, "Unit", "UnitFileState"),
                                          (CHECK_TIMER, "Unit", "UnitFileState")),)]
    assert fake.asked("enable") == ([((TARGET_UNIT,),)] if again and not dry_run else [])
    assert done == ([TARGET_UNIT] if again else [])
    assert fake.units[TARGET_UNIT]["UnitFileState"] == ("enabled" if again and not dry_run else state)
    said = out.stream.getvalue()
    assert (TARGET_UNIT in said) == again, said
    assert CHECK_TIMER not in said, said  # enabled: nothing to say


def test_a_release_with_nothing_to_do_asks_only_of_the_units_its_release_has(tmp_path):
    fake = FakeManager({TARGET_UNIT: {"UnitFileState": "disabled"}})
    out = ReleaseOutput(None, stream=io.StringIO())
    assert keep_enabled(_node(tmp_path, fake), {TARGET_UNIT: ""}, out) == [TARGET_UNIT]
    assert fake.calls == [("properties", ((TARGET_UNIT, "Unit", "UnitFileState"),)), ("enable", (TARGET_UNIT,))]
    fake = FakeManager()
    assert keep_enabled(_node(tmp_path, fake), {ENGINE_UNIT: ""}, out) == [] and fake.calls == []


@pytest.mark.parametrize("state", ACTIVE_STATES)
def test_a_service_is_down_in_every_state_but_active(tmp_path, state):
    # Against a real manager: tests/test_release.py, a gateway stopped by hand ("is inactive").
    fake = FakeManager({unit: {"ActiveState": "active"} for unit in SERVICE_UNITS})
    fake.units[GATEWAY_UNIT]["ActiveState"] = state
    down = services_down(_node(tmp_path, fake))
    assert down == ([] if state == "active" else [f"{GATEWAY_UNIT} is {state}"])
    del fake.units[VOICE_UNIT]  # not loaded: systemd says inactive
    assert services_down(_node(tmp_path, fake))[-1] == f"{VOICE_UNIT} is inactive"
