"""A node's host resolved through the operator's SSH config (control/ssh_config.py), as ssh_config(5) says: the
inventory's own settings win, the config's apply where the inventory sets nothing, each ProxyJump hop resolved
the same way. The real connection through a bastion: tests/test_production_path.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from flatshare_ops.config.inventory import load_inventory
from flatshare_ops.control.ssh_config import ssh_target
from flatshare_ops.errors import FlatshareError


def _inventory(tmp_path: Path, node: str, transport: str = "") -> Path:
    (tmp_path / "p.toml").write_text("")
    path = tmp_path / "fleet.toml"
    path.write_text(f"schema = 1\nmin_serving = 0\n{transport}\n[nodes.cyan]\n{node}profile = \"p.toml\"\n")
    return path


def _target(tmp_path, node: str, config: str, transport: str = "", monkeypatch=None):
    (tmp_path / "ssh_config").write_text(config)
    path = _inventory(tmp_path, node, transport or '[transport]\nssh_config = "ssh_config"\n')
    inventory = load_inventory(path)
    return ssh_target("cyan", inventory.nodes["cyan"], path, inventory)


CONFIG = ("Host cyan\n  HostName 10.1.2.3\n  Port 2200\n  User ops\n  IdentityFile ~/keys/cyan\n"
          "  ProxyJump admin@bastion:2022,inner\n"
          "Host inner\n  HostName 10.0.0.9\n  User jumper\n"
          "Host bastion\n  HostName bastion.example.net\n")


def test_the_configs_host_name_port_user_identity_and_jumps_apply_where_the_inventory_sets_none(tmp_path):
    t = _target(tmp_path, 'host = "cyan"\n', CONFIG)
    assert (t.host, t.port, t.user, t.identity) == ("10.1.2.3", 2200, "ops", Path("~/keys/cyan").expanduser())
    inner = t.jump
    assert (inner.host, inner.port, inner.user) == ("10.0.0.9", 22, "jumper")
    outer = inner.jump  # reached first, directly
    assert (outer.host, outer.port, outer.user, outer.jump) == ("bastion.example.net", 2022, "admin", None)
    assert t.known_hosts == outer.known_hosts == inner.known_hosts  # every hop checked against the fleet's file


def test_what_the_inventory_sets_for_the_node_wins_over_the_config(tmp_path):
    t = _target(tmp_path, 'host = "cyan"\nport = 22\nuser = "root"\n', CONFIG)
    assert (t.host, t.port, t.user) == ("10.1.2.3", 22, "root")


def test_no_config_leaves_the_inventory_as_it_is(tmp_path, monkeypatch):
    monkeypatch.setenv("FLATSHARE_SSH_CONFIG", "none")
    t = _target(tmp_path, 'host = "cyan"\n', CONFIG)
    assert (t.host, t.port, t.user, t.jump) == ("cyan", 22, "root", None)


def test_a_config_that_is_named_but_missing_is_one_line_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv("FLATSHARE_SSH_CONFIG", str(tmp_path / "nope"))
    with pytest.raises(FlatshareError, match=r"\$FLATSHARE_SSH_CONFIG: .*nope is not a file"):
        _target(tmp_path, 'host = "cyan"\n', CONFIG)
