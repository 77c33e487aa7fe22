"""The operator's side of a release: which nodes, in what order, and how each is reached.

The checkout renders each node's release (its profile from the inventory);
the switch itself runs on the node (:mod:`.release`). Whether a node is this
machine (no ``--node``: the node it runs on, in-process) or one reached over
SSH (paramiko, host keys checked, the command quoted with ``shlex.join``) is
decided here, once. Rolling over nodes: ``batch`` nodes at a time (default
1), a node drained only while every node outside its batch passes
serving-check, stopping at the first node that fails.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import sys
import threading
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from .checkout import describe as describe_checkout
from .errors import FlatshareError
from .inventory import Inventory, Node, load_inventory, node_profile_path, resolve
from .output import ReleaseOutput
from .profile import load_profile
from .release import BAD_INPUT, FAILED, NOTHING_TO_DO, RELEASED, REFUSED, NodeContext
from .release_store import release_id
from .render import render_profile
from .systemd import ManagerAddress

RESULT_NAMES = {RELEASED: "released", NOTHING_TO_DO: "nothing to do", REFUSED: "refused",
                FAILED: "failed mid-switch (journal kept)", BAD_INPUT: "bad input"}


@dataclass
class NodeTarget:
    """One node as the operator's side sees it.

    Attributes:
        name: the node's name.
        node: its inventory entry.
        profile: the profile file it runs (resolved against the inventory).
        local: True when it is this machine (reached in-process, not over SSH).
    """

    name: str
    node: Node
    profile: Path
    inventory: Path
    local: bool = False
    result: int | None = field(default=None)

    @cached_property
    def loaded(self):
        """The node's profile, loaded once."""
        return load_profile(self.profile)

    def context(self) -> NodeContext:
        """The node's context for :mod:`.release` (its state directory and systemd manager)."""
        layout = self.loaded.profile.layout
        runtime = resolve(self.inventory, self.node.runtime_dir)
        return NodeContext(self.name, Path(layout.state_dir),
                           ManagerAddress(self.node.scope, runtime.resolve() if runtime else None))

    def node_argv(self, *command: str) -> list[str]:
        """``flatshare node COMMAND ...`` as run on the node, with where its state and manager are."""
        profile = self.loaded.profile
        flatshare = str(Path(profile.check.command[0]).parent / "flatshare")
        ctx = self.context()
        argv = [flatshare, "node", *command, "--node", self.name, "--state-dir", str(ctx.state_dir),
                "--scope", self.node.scope]
        if ctx.address.runtime_dir:
            argv += ["--runtime-dir", str(ctx.address.runtime_dir)]
        return argv


def targets(inventory_file: Path, names: list[str], all_nodes: bool) -> list[NodeTarget]:
    """The nodes to act on, in inventory order; without names, the node this command runs on.

    Raises:
        FlatshareError: an unknown node name, or (without names) this machine is not in the inventory.
    """
    inventory: Inventory = load_inventory(inventory_file)
    if all_nodes and names:
        raise FlatshareError("give --node NAME... or --all, not both")
    if any(not n for n in names):
        raise FlatshareError("--node needs a node name")
    if all_nodes or names:
        unknown = [n for n in names if n not in inventory.nodes]
        if unknown:
            raise FlatshareError(f"{inventory_file}: no node {', '.join(unknown)}; known nodes: {', '.join(inventory.nodes)}")
        chosen = list(inventory.nodes) if all_nodes else [n for n in inventory.nodes if n in names]
        return [NodeTarget(n, inventory.nodes[n], node_profile_path(inventory_file, inventory.nodes[n]), inventory_file)
                for n in chosen]
    here = os.environ.get("FLATSHARE_NODE") or socket.gethostname().split(".")[0]
    if here not in inventory.nodes:
        raise FlatshareError(
            f"this machine ({here}) is not a node of {inventory_file}; pass --node NAME or --all "
            "(or set FLATSHARE_NODE)"
        )
    n = inventory.nodes[here]
    return [NodeTarget(here, n, node_profile_path(inventory_file, n), inventory_file, local=True)]


def bundle(root: Path, target: NodeTarget) -> dict:
    """The release for a node, rendered from the checkout: ``{"id", "files"}``."""
    rendered = render_profile(target.loaded)
    files = rendered.release_files()
    return {"id": release_id(files, describe_checkout(root)), "files": files}


def warn_uncommitted(root: Path, out: ReleaseOutput) -> None:
    """Say so when the checkout has uncommitted changes (the release id then ends in -dirty)."""
    described = describe_checkout(root)
    if described and described.endswith("-dirty"):
        out.line(f"note: the checkout has uncommitted changes; the release is recorded as {described}-...")


def run_on_node(target: NodeTarget, argv: list[str], stdin: str, echo) -> int:
    """Run a node-side command over SSH, streaming its output lines to ``echo``; returns its exit status."""
    from .remote import SSHTarget, open_ssh

    n = target.node
    client = open_ssh(SSHTarget(target.name, n.host, n.port, n.user,
                                resolve(target.inventory, n.known_hosts), resolve(target.inventory, n.identity)))
    try:
        channel = client.get_transport().open_session()
        channel.set_combine_stderr(True)
        channel.exec_command(shlex.join(argv))
        channel.sendall(stdin.encode())
        channel.shutdown_write()
        with channel.makefile("r") as stream:
            for line in stream:
                echo(line.rstrip("\n"))
        return channel.recv_exit_status()
    finally:
        client.close()


def switch_target(root: Path, target: NodeTarget, out: ReleaseOutput, force: bool, dry_run: bool,
                  rollback: bool) -> int:
    """Switch one node (in-process when local, else over SSH); returns the node's exit code."""
    payload = None if rollback else bundle(root, target)
    if target.local:
        from .release import log_path, switch_node

        ctx = target.context()
        ctx.releases.mkdir(parents=True, exist_ok=True)
        node_out = ReleaseOutput(None if dry_run else log_path(ctx), out.stream)
        node_out.watch_hangup()
        try:
            return switch_node(ctx, payload, node_out, force=force, dry_run=dry_run, rollback=rollback)
        except FlatshareError as err:
            node_out.line(f"flatshare: {err}")
            return err.exit_code
        finally:
            node_out.close()
    argv = target.node_argv("switch") + (["--force"] if force else []) + (["--dry-run"] if dry_run else []) \
        + (["--rollback"] if rollback else ["--bundle", "-"])
    echo = ReleaseOutput(None, out.stream, prefix=f"[{target.name}] ").line
    try:
        status = run_on_node(target, argv, json.dumps(payload) if payload else "", echo)
    except FlatshareError as err:
        echo(f"flatshare: {err}")
        return REFUSED
    if status not in RESULT_NAMES:
        # -1: the connection or the node-side process ended without an exit status (killed?).
        echo(f"flatshare: the release on {target.name} ended without an exit status ({status}); its journal "
             "says where it stopped: run 'flatshare status', then 'flatshare release' to finish it")
        return FAILED
    return status


def _others_pass_check(batch: list[NodeTarget], everyone: list[NodeTarget], out: ReleaseOutput) -> bool:
    from .check import CRITICAL, UNKNOWN
    from .remote_check import remote_report

    names = {t.name for t in batch}
    for other in everyone:
        if other.name in names:
            continue
        report = remote_report(other.inventory, other.name)
        if report.perfdata.get("release_in_progress"):
            out.line(f"{other.name}: a release is in progress there; it may be drained ({report.findings[0].summary})")
            return False
        out.line(f"{other.name}: serving-check {report.status} (must pass while {', '.join(names)} drains)")
        if report.status in (CRITICAL, UNKNOWN):
            for finding in report.findings:
                if finding.status in (CRITICAL, UNKNOWN):
                    out.line(f"  {finding.status} {finding.check}: {finding.summary}")
            return False
    return True


def roll(root: Path, chosen: list[NodeTarget], everyone: list[NodeTarget], out: ReleaseOutput, force: bool = False,
         dry_run: bool = False, rollback: bool = False, batch_size: int = 1) -> int:
    """Release the chosen nodes, ``batch_size`` at a time, stopping at the first that fails.

    Returns:
        The exit code: the first failing node's, else RELEASED if any node was
        released, else NOTHING_TO_DO.
    """
    if len(everyone) > 1 and batch_size >= len(everyone):
        raise FlatshareError(f"--batch-size {batch_size} would drain all {len(everyone)} nodes at once; "
                             f"use at most {len(everyone) - 1} so a node always takes calls")
    batches = [chosen[i : i + batch_size] for i in range(0, len(chosen), batch_size)]
    worst = None
    for batch in batches:
        if len(everyone) > 1 and not _others_pass_check(batch, everyone, out):
            # A node with nothing to do is not drained, so it needs no gate: ask before refusing.
            idle = [t for t in batch if switch_target(root, t, _quiet(out), force, True, rollback) == NOTHING_TO_DO]
            for t in idle:
                t.result = NOTHING_TO_DO
                out.line(f"{t.name}: nothing to do (no drain, so the other nodes' state does not matter)")
            if len(idle) == len(batch):
                continue
            for t in batch:
                if t.result is None:
                    t.result = REFUSED
            out.line(f"release refused: a node outside {', '.join(t.name for t in batch)} is not serving "
                     "(or is being released); draining now would leave no node taking calls")
            worst = REFUSED
            break
        if len(batch) == 1:  # in the main thread: a local switch installs a SIGHUP handler
            batch[0].result = switch_target(root, batch[0], out, force, dry_run, rollback)
        else:
            threads = [threading.Thread(target=lambda t=t: setattr(
                t, "result", switch_target(root, t, out, force, dry_run, rollback))) for t in batch]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        failed = [t for t in batch if t.result not in (RELEASED, NOTHING_TO_DO)]
        if failed:
            worst = failed[0].result
            break
    if len(chosen) > 1 or worst is not None:
        for t in chosen:
            label = "not started" if t.result is None else RESULT_NAMES.get(t.result, f"exit {t.result}")
            out.line(f"{t.name}: {'planned (dry run)' if dry_run and t.result == RELEASED else label}")
    if worst is not None:
        return worst
    return RELEASED if any(t.result == RELEASED for t in chosen) else NOTHING_TO_DO


def _quiet(out: ReleaseOutput) -> ReleaseOutput:
    """A sink that drops lines (for a node-side dry run asked only for its exit code)."""
    import io

    return ReleaseOutput(None, io.StringIO())


def refuse_drift(root: Path, out: ReleaseOutput) -> None:
    """Refuse a release from a checkout whose rendered files drifted from its profile."""
    from .release import Refused
    from .repo import drift, expected_outputs

    diffs = drift(root, expected_outputs(root))
    if diffs:
        raise Refused(
            f"release refused: the checkout's rendered files drifted from the profile ({', '.join(map(str, diffs))}); "
            "run 'make profiles' to see the diff and 'make profiles UPDATE=1' to rewrite them, then commit"
        )


def terminal() -> ReleaseOutput:
    """The operator's terminal, as a line sink that survives its loss."""
    out = ReleaseOutput(None, sys.stdout)
    out.watch_hangup()
    return out
