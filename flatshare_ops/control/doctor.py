"""``flatshare doctor``: the operator's side and each node's reachability, one line per item.

Checks, in order: the inventory loads; the checkout's rendered files match its
profiles (and no profile pins a placeholder module); then per node: its
profile loads and renders, its identity file exists, known_hosts lists its
host key, and it answers over SSH (``flatshare-node probe``: does it take
calls, does a release hold it). ``ok`` / ``WARN`` / ``FAIL`` with the way out.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import FlatshareError, TransportError


def doctor(root: Path, inventory: Path, echo) -> int:
    """Run every check; returns 0 when nothing FAILs, 1 otherwise."""
    from ..config.inventory import resolve
    from ..render import render_profile
    from ..render.checkout import drift, expected_outputs, placeholder_pins
    from . import commands, known_hosts
    from .fleet import answer_of
    from .targets import targets

    failed = 0

    def line(state: str, item: str, detail: str) -> None:
        nonlocal failed
        failed += state == "FAIL"
        echo(f"{state:5} {item}: {detail}")

    try:
        nodes = targets(inventory, [], True)
        line("ok", "inventory", f"{inventory}: {len(nodes)} node(s), min_serving {nodes[0].settings.min_serving}")
    except FlatshareError as err:
        line("FAIL", "inventory", str(err))
        return 1
    try:
        diffs = drift(root, expected_outputs(root))
        line("FAIL" if diffs else "ok", "checkout", f"rendered files drifted: {', '.join(map(str, diffs))}; run "
             "'make profiles UPDATE=1'" if diffs else "rendered files match the profiles")
        for warning in placeholder_pins(root):
            line("WARN", "module pin", warning)
    except FlatshareError as err:
        line("FAIL", "checkout", str(err))
    for target in nodes:
        name = target.name
        try:
            render_profile(target.loaded)
            line("ok", f"{name} profile", f"{target.profile_path} loads and renders")
        except FlatshareError as err:
            line("FAIL", f"{name} profile", str(err))
            continue
        n = target.node
        identity = resolve(target.inventory, n.identity)
        if identity is not None:
            from .ssh import identity_problem

            what = identity_problem(identity)
            line("FAIL" if what else "ok", f"{name} key",
                 f"{identity} {what}; fix the inventory's identity" if what else f"{identity}")
        path = resolve(target.inventory, n.known_hosts) or Path.home() / ".ssh/known_hosts"
        label = known_hosts.host_label(n.host, n.port)
        try:
            listed = [e for e in known_hosts.read(path).entries if not e.marker and known_hosts.matches(e.patterns, label)]
            line("ok" if listed else "FAIL", f"{name} known_hosts",
                 f"{path} lists {label} (line {listed[0].line})" if listed else
                 f"{path} does not list {label}: 'flatshare node bootstrap --node {name}' shows its fingerprint")
        except TransportError as err:
            line("FAIL", f"{name} known_hosts", str(err))
        try:
            argv = commands.probe(target.spec)  # the node's profile and the inventory must agree first
            conn = target.connect()
        except FlatshareError as err:
            line("FAIL", f"{name} reach", str(err))
            continue
        result = None
        try:
            result = conn.run(argv, timeout_s=target.settings.transport.command_timeout_s)
            answer = answer_of(result)
            state = "ok" if answer.get("takes_calls") else "WARN"
            line(state, f"{name} reach", "answers over SSH; " + (
                "takes calls" if answer.get("takes_calls") else f"does not take calls ({'; '.join(answer['problems'])})")
                + (f"; being released by {answer['holder']}" if answer.get("locked") else ""))
        except TransportError as err:
            line("FAIL", f"{name} reach", f"{err}")
        except (ValueError, KeyError, TypeError, AttributeError):
            line("FAIL", f"{name} reach", f"answers over SSH, but its flatshare-node does not "
                 f"({result.output.strip()[-200:] if result is not None else 'no output'}): "
                 f"'flatshare node bootstrap --node {name}'")
        finally:
            conn.close()
    return 1 if failed else 0
