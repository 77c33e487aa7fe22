"""serving-check on other nodes: run each node's own serving-check over SSH and gather the reports."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .check import EXIT_CODES, UNKNOWN, Finding, Report, _SEVERITY, nagios_text
from .errors import FlatshareError

def remote_report(inventory_file: Path, name: str) -> Report:
    """Run serving-check on node ``name`` over SSH (host key checked) and read its JSON report.

    Returns:
        The node's report; an unreachable node or unreadable answer is UNKNOWN.
    """
    from .inventory import load_inventory, node_profile_path, resolve
    from .profile import load_profile
    from .remote import SSHTarget, open_ssh, run

    inventory = load_inventory(inventory_file)
    if name not in inventory.nodes:
        raise FlatshareError(f"{inventory_file}: no node {name!r}; known nodes: {', '.join(inventory.nodes)}")
    node = inventory.nodes[name]
    profile = load_profile(node_profile_path(inventory_file, node)).profile
    argv = [profile.check.command[0], "--json", "--state-dir", profile.layout.state_dir, "--node-name", name]
    if node.scope == "user":
        argv += ["--runtime-dir", str(resolve(inventory_file, node.runtime_dir).resolve())]
    target = SSHTarget(name, node.host, node.port, node.user,
                       resolve(inventory_file, node.known_hosts), resolve(inventory_file, node.identity))
    try:
        client = open_ssh(target)
    except FlatshareError as err:
        return Report(name, [Finding("ssh", UNKNOWN, str(err))])
    try:
        result = run(client, argv, timeout_s=60)
    finally:
        client.close()
    try:
        document = json.loads(result.stdout)
        findings = [Finding(f["check"], f["status"], f["summary"], f["details"]) for f in document["findings"]]
        return Report(name, findings, document.get("perfdata", {}))
    except (json.JSONDecodeError, KeyError, TypeError):
        tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no output"]
        return Report(name, [Finding("ssh", UNKNOWN, f"serving-check on {name} exited {result.status}: {tail[0]}")])


def check_nodes(args) -> int:
    """``serving-check --node NAME`` / ``--all``: print each node's report; return the worst exit code."""
    from .inventory import inventory_path, load_inventory

    path = inventory_path(args.inventory)
    try:
        names = list(load_inventory(path).nodes) if args.all else args.node
        reports = [remote_report(path, name) for name in names]
    except FlatshareError as err:
        print(f"SERVING-CHECK UNKNOWN - {err}")
        return 3
    if args.json:
        print(json.dumps({r.node: r.to_json() for r in reports}, indent=2, sort_keys=True))
    else:
        for report in reports:
            if not (args.quiet and report.status == "OK"):
                sys.stdout.write(nagios_text(report))
    worst = max((r.status for r in reports), key=_SEVERITY.__getitem__, default="OK")
    return EXIT_CODES[worst]
