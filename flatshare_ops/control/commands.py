"""The node-side commands, built as data (argv lists) by pure functions.

As Kamal's command builders and deploy-rs's ``build_activate_command`` do
(docs/reference/engineering-style.md, "Plans are data"): reading this file
tells everything the operator's side can ask of a node. Each builder returns
a list of words; transports join them with ``shlex.join`` (SSH) or run them
without a shell (locally), so no value is ever spliced into a shell string.
The tests pin each builder's exact output.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NodeSpec:
    """How to run the node's side on one node.

    Attributes:
        name: the node's name.
        program: the node-side entry point, e.g. ``("/opt/flatshare-ops/.venv/bin/flatshare-node",)``.
        state_dir: the node's state directory.
        scope: ``system`` or ``user`` (which systemd manager).
        runtime_dir: a user manager's ``XDG_RUNTIME_DIR`` (None for the system manager).
        check_program: the node's ``serving-check``.
    """

    name: str
    program: tuple[str, ...]
    state_dir: str
    scope: str
    runtime_dir: str | None
    check_program: str


def _node(spec: NodeSpec, command: str) -> list[str]:
    argv = [*spec.program, command, "--node", spec.name, "--state-dir", spec.state_dir, "--scope", spec.scope]
    if spec.runtime_dir:
        argv += ["--runtime-dir", spec.runtime_dir]
    return argv


def switch(spec: NodeSpec, switch_id: str, rollout: str | None = None, force: bool = False,
           dry_run: bool = False, rollback: bool = False, undo_rollout: str | None = None,
           auto_rollback: bool = True) -> list[str]:
    """``flatshare-node switch``: the release bundle (or ``{}``) follows as the first line of stdin."""
    argv = _node(spec, "switch") + ["--switch-id", switch_id]
    if rollout:
        argv += ["--rollout", rollout]
    if force:
        argv.append("--force")
    if not auto_rollback:
        argv.append("--no-auto-rollback")
    if dry_run:
        argv.append("--dry-run")
    if undo_rollout:
        argv += ["--undo-rollout", undo_rollout]
    elif rollback:
        argv.append("--rollback")
    return argv


def status(spec: NodeSpec, switch_id: str | None = None) -> list[str]:
    """``flatshare-node status`` (``--switch ID``: what became of one switch)."""
    return _node(spec, "status") + (["--switch", switch_id] if switch_id else [])


def history(spec: NodeSpec) -> list[str]:
    """``flatshare-node history``."""
    return _node(spec, "history")


def probe(spec: NodeSpec) -> list[str]:
    """``flatshare-node probe``: does the node take calls, does a release hold it."""
    return _node(spec, "probe")


def lock_check(spec: NodeSpec) -> list[str]:
    """``flatshare-node lock-check``: does reading the release lock work on the node (a child takes a lock)."""
    return _node(spec, "lock-check")


def hold(spec: NodeSpec, acquire: str | None = None, who: str | None = None, release: bool = False) -> list[str]:
    """``flatshare-node hold``: an operator's hold on the node (status; ``--acquire MESSAGE``; ``--release``)."""
    argv = _node(spec, "hold")
    if acquire is not None:
        # --acquire=VALUE: a message that starts with '-' is still the message, never an option.
        argv += [f"--acquire={acquire}"] + ([f"--who={who}"] if who else [])
    elif release:
        argv.append("--release")
    return argv


def module(spec: NodeSpec, path: str | None = None) -> list[str]:
    """``flatshare-node module``: the serve module the node built (path, sha256, when); ``path`` names
    the module file (default: the active release's)."""
    return _node(spec, "module") + (["--path", path] if path else [])


def serving_check(spec: NodeSpec) -> list[str]:
    """``serving-check --json`` for the node's own state and manager."""
    argv = [spec.check_program, "--json", "--state-dir", spec.state_dir, "--node-name", spec.name]
    if spec.runtime_dir:
        argv += ["--runtime-dir", spec.runtime_dir]
    return argv


def answers(spec: NodeSpec, max_tokens: int, budget_s: float) -> list[str]:
    """``flatshare-node answers``: the node's engine's greedy answers to golden prompts (token ids) as JSON,
    all within ``budget_s`` seconds; the prompts follow on stdin, a JSON list (never on the command line, whose
    one argument Linux bounds at 128 KiB)."""
    return _node(spec, "answers") + ["--max-tokens", str(max_tokens), "--budget", f"{budget_s:g}"]


def metrics(spec: NodeSpec) -> list[str]:
    """``flatshare-node metrics``: the node's engine ``/metrics`` as JSON (a canary analysis's scrape)."""
    return _node(spec, "metrics")


def record_analysis(spec: NodeSpec, switch_id: str, rollout: str | None) -> list[str]:
    """``flatshare-node record-analysis``: the analysis document follows on stdin, one JSON line."""
    return _node(spec, "record-analysis") + ["--switch", switch_id] + (["--rollout", rollout] if rollout else [])
