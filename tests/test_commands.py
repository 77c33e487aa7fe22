"""The node-side commands are data: each builder's exact argv (control/commands.py)."""

from __future__ import annotations

from flatshare_ops.control import commands

SPEC = commands.NodeSpec("cyan", ("/opt/flatshare-ops/.venv/bin/flatshare-node",), "/var/lib/flatshare", "system",
                         None, "/opt/flatshare-ops/.venv/bin/serving-check")
USER = commands.NodeSpec("peacock", ("/usr/bin/python3", "-m", "flatshare_ops.node"), "/s", "user", "/run/u",
                         "/bin/serving-check")
NODE = ["/opt/flatshare-ops/.venv/bin/flatshare-node"]


def test_switch():
    assert commands.switch(SPEC, "s1") == NODE + ["switch", "--node", "cyan", "--state-dir", "/var/lib/flatshare",
                                                  "--scope", "system", "--switch-id", "s1"]
    assert commands.switch(SPEC, "s1", rollout="r1", force=True, dry_run=True, rollback=True) == NODE + [
        "switch", "--node", "cyan", "--state-dir", "/var/lib/flatshare", "--scope", "system", "--switch-id", "s1",
        "--rollout", "r1", "--force", "--dry-run", "--rollback"]
    assert commands.switch(USER, "s2", undo_rollout="r0") == [
        "/usr/bin/python3", "-m", "flatshare_ops.node", "switch", "--node", "peacock", "--state-dir", "/s",
        "--scope", "user", "--runtime-dir", "/run/u", "--switch-id", "s2", "--undo-rollout", "r0"]


def test_status_history_probe():
    base = ["--node", "cyan", "--state-dir", "/var/lib/flatshare", "--scope", "system"]
    assert commands.status(SPEC) == NODE + ["status", *base]
    assert commands.status(SPEC, "s9") == NODE + ["status", *base, "--switch", "s9"]
    assert commands.history(SPEC) == NODE + ["history", *base]
    assert commands.probe(SPEC) == NODE + ["probe", *base]


def test_serving_check():
    assert commands.serving_check(SPEC) == ["/opt/flatshare-ops/.venv/bin/serving-check", "--json", "--state-dir",
                                            "/var/lib/flatshare", "--node-name", "cyan"]
    assert commands.serving_check(USER) == ["/bin/serving-check", "--json", "--state-dir", "/s", "--node-name",
                                            "peacock", "--runtime-dir", "/run/u"]


def test_hold_passes_the_message_as_one_word_even_when_it_looks_like_an_option():
    base = ["--node", "cyan", "--state-dir", "/var/lib/flatshare", "--scope", "system"]
    assert commands.hold(SPEC, acquire="--release", who="ops@laptop") == \
        NODE + ["hold", *base, "--acquire=--release", "--who=ops@laptop"]
    assert commands.hold(SPEC, release=True) == NODE + ["hold", *base, "--release"]


def test_answers_takes_the_prompts_on_stdin_never_on_the_command_line():
    # A breaker's case: 16 prompts of 2,000 characters, as one JSON argument, went past Linux's 128 KiB bound on
    # one argument ("Argument list too long") and the check was silently lost.
    assert commands.answers(SPEC, 16, 25.0) == NODE + ["answers", "--node", "cyan", "--state-dir", "/var/lib/flatshare",
                                                       "--scope", "system", "--max-tokens", "16", "--budget", "25"]
