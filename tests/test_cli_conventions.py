"""What operators expect of every command line: a version on -V and --version, help on -h as on --help."""

from __future__ import annotations

from importlib.metadata import version
from pathlib import Path

import pytest

import json
import re
import subprocess

from conftest import REPO, run_cli, signal_at
from flatshare_ops.common.protocol import GENERATION, VERSION


@pytest.mark.parametrize("program, code", [("flatshare", 0), ("flatshare-node", 0), ("serving-check", 3)])
def test_each_program_says_its_version_with_both_spellings(program, code):
    for spelling in ("--version", "-V"):
        done = run_cli(spelling, program=program)
        assert done.returncode == code, done  # serving-check: UNKNOWN, as the monitoring-plugins guidelines ask
        words = done.stdout.replace("(", " ").replace(")", " ").replace(",", " ").split()
        assert words[0] == program and version("flatshare-ops") in words, done.stdout
        if program != "serving-check":  # which bundles this side runs
            assert str(VERSION) == words[words.index("protocol") + 1]
            assert str(GENERATION) == words[words.index("generation") + 1]


def _commands() -> list[list[str]]:
    """Every command and group of ``flatshare``, as the words that name it, from typer's own tree."""
    import typer.main

    from flatshare_ops.cli import commands

    app = commands()

    found = []

    def walk(command, path):
        found.append(path)
        for name, sub in sorted(getattr(command, "commands", {}).items()):
            if not getattr(sub, "hidden", False):
                walk(sub, [*path, name])

    walk(typer.main.get_command(app), [])
    return found


def test_minus_h_is_help_as_much_as_double_dash_help():
    commands = _commands()
    assert ["release"] in commands and ["profiles", "set"] in commands and len(commands) > 15, commands
    for args in commands:
        short, long = run_cli(*args, "-h"), run_cli(*args, "--help")
        assert short.returncode == 0 and short.stdout == long.stdout and "Usage: flatshare" in short.stdout, args
        # Help says what a value means, not its Python type (issue 35): no "<str>", "<list[str]>", "<int range>".
        options = short.stdout.split("Options:", 1)[-1]
        assert not re.search(r"<(str|int|path|list\[str\]|int range)>", options), (args, short.stdout)


def test_the_command_reference_names_every_command_and_option_and_is_drift_checked(checkout):
    """docs/reference/commands.md is generated from the command line; `make profiles` fails when it drifts."""
    import typer.main

    from flatshare_ops.cli import commands

    app = commands()

    text = (REPO / "docs/reference/commands.md").read_text()
    root = typer.main.get_command(app)
    for path in _commands():
        assert f"# flatshare {' '.join(path)}".rstrip() + "\n" in text, path
        command = root
        for word in path:
            command = command.commands[word]
        for param in command.params:
            for spelling in getattr(param, "opts", []):
                if spelling.startswith("-") and not getattr(param, "hidden", False):
                    assert spelling in text, (path, spelling)
    reference = checkout / "docs/reference/commands.md"
    reference.write_text(reference.read_text().replace("--dry-run", "--try-run"))
    drifted = run_cli("profiles", "render", "--root", str(checkout))
    assert drifted.returncode == 1 and "--- a/docs/reference/commands.md" in drifted.stdout, drifted
    updated = run_cli("profiles", "render", "--update", "--root", str(checkout))
    assert updated.returncode == 0 and reference.read_bytes() == (REPO / "docs/reference/commands.md").read_bytes()


def test_an_unknown_command_is_a_usage_error_and_the_old_lock_spelling_is_gone():
    done = run_cli("lock", "status")
    assert done.returncode == 2 and not done.stdout, done


def test_a_host_name_that_does_not_resolve_is_said_so_with_the_unreachable_code(tmp_path):
    """`.invalid` never resolves (RFC 6761): said as such, not as a timeout, and exit 6 as for any unreachable node."""
    (tmp_path / "known_hosts").write_text("")
    inventory = tmp_path / "fleet.toml"
    inventory.write_text('schema = 1\nmin_serving = 0\n[nodes.cyan]\nhost = "cyan.invalid"\nknown_hosts = "known_hosts"\n'
                         f'profile = "{REPO}/profiles/rtx-5060-ti-serve.toml"\n')
    done = run_cli("status", "--inventory", str(inventory))
    assert done.returncode == 6, done
    assert "cyan.invalid does not resolve" in done.stdout and "within" not in done.stdout, done.stdout


def test_a_wrong_analysis_mode_is_said_in_our_words():
    done = run_cli("release", "--analysis", "maybe", "--dry-run")
    assert done.returncode == 2 and "maybe is not an analysis mode; use on, dry-run or skip" in done.stderr, done
    assert "Value error" not in done.stderr


@pytest.mark.parametrize("value, said", [("1e400", "is not a duration"), ("99999h", "more than a day"),
                                         ("86401", "more than a day"), ("0", "is not a duration")])
def test_wait_is_a_bounded_duration(value, said, tmp_path):
    # Refused as a usage error before anything is read (the inventory does not exist).
    result = run_cli("release", "--wait", value, "--node", "cyan", "--inventory", str(tmp_path / "none.toml"))
    assert result.returncode == 2 and said in result.stderr, result.stderr
    accepted = run_cli("release", "--wait", "24h", "--node", "cyan", "--inventory", str(tmp_path / "none.toml"))
    assert accepted.returncode == 2 and "inventory file not found" in accepted.stderr, accepted.stderr


def test_a_release_signalled_before_its_rollout_began_says_nothing_changed_in_one_line(checkout, tmp_path):
    # A breaker's case: SIGTERM to `flatshare release` in its first second ended it (143) with nothing printed:
    # Python's default, before the command's handler was installed after its imports and checks. The release is
    # held in its checks here by a git that waits (its `git describe`), and signalled once git runs.
    import os
    import signal
    import subprocess
    import sys

    from flatshare_ops.common.poll import poll_until

    pinned = run_cli("profiles", "pin-module", "--sha256", "ab" * 32, "--root", str(checkout))
    assert pinned.returncode == 0, pinned
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "git").write_text('#!/bin/sh\n: > "$GIT_RAN"\nexec sleep 600\n')
    (fake / "git").chmod(0o755)
    ran = tmp_path / "git-ran"
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "GIT_RAN": str(ran)}
    operator = subprocess.Popen([str(Path(sys.executable).parent / "flatshare"), "release", "--node", "cyan",
                                 "--root", str(checkout), "--inventory", str(checkout / "profiles/fleet.toml")],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert poll_until(ran.exists, 120, 0.05), operator.communicate(timeout=30)
        operator.send_signal(signal.SIGTERM)
        out, err = operator.communicate(timeout=60)
    finally:
        if operator.poll() is None:
            operator.kill()
    assert operator.returncode == 143, (out, err)
    assert err == "flatshare: interrupted by SIGTERM before any switch began: nothing changed\n", (out, err)


def test_the_command_lines_entry_module_imports_nothing_heavy_before_its_signal_handlers():
    # Ctrl-C and SIGTERM are handled from main()'s first line; what the console script imports before it is all
    # a signal could end in silence (typer, pydantic, paramiko take half a second).
    import subprocess
    import sys

    probe = ("import sys, flatshare_ops.cli; "
             "print(sorted(m for m in ('typer', 'click', 'pydantic', 'paramiko', 'jinja2') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done


def _signalled_at(where: str, *args: str):
    """``flatshare ARGS`` in a fresh process that sends itself SIGTERM where ``where`` says (conftest.py
    ``signal_at``)."""
    import os
    import subprocess
    import sys

    return subprocess.run([str(Path(sys.executable).parent / "flatshare"), *args],
                          env={**os.environ, **signal_at(where)}, capture_output=True, text=True, timeout=300)


def _unreachable_fleet(checkout: Path) -> Path:
    """An inventory of cyan and peacock on this machine's ports 1 and 2, where nothing listens: each connection is
    refused at once (the profile's loopback gateway URL names such a node), and a release of both is refused."""
    pinned = run_cli("profiles", "pin-module", "--sha256", "ab" * 32, "--root", str(checkout))
    assert pinned.returncode == 0, pinned
    (checkout / "none_known").write_text("")
    inventory = checkout / "unreachable.toml"  # beside profiles/, whose every .toml is a profile
    inventory.write_text('schema = 1\nknown_hosts = "none_known"\nmin_serving = 1\n' + "".join(
        f'\n[nodes.{name}]\nhost = "127.0.0.1"\nport = {port}\nuser = "root"\n'
        'profile = "profiles/rtx-5060-ti-serve.toml"\n' for port, name in ((1, "cyan"), (2, "peacock"))))
    return inventory


def test_a_signal_once_a_command_has_ended_is_no_traceback_and_changes_its_exit_code_nothing():
    # A breaker's case: SIGTERM as a command exited (Python's own shutdown, after main) raised the interrupt in the
    # interpreter's exit: "Exception ignored in atexit callback", a traceback, on every command's last moments.
    done = _signalled_at("exit", "--version")
    assert done.returncode == 0 and done.stdout.startswith("flatshare "), done
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr


def test_a_second_signal_during_an_interrupted_runs_summary_leaves_the_summary_and_the_document_whole(checkout):
    # A breaker's case: two SIGTERMs a fraction of a millisecond apart: the second, raised while the first one's
    # summary printed, cut it after its first line (no line a node, no --json document). Here the first comes as
    # the fleet's preflight begins, the second as the summary begins.
    import json

    inventory = _unreachable_fleet(checkout)
    done = _signalled_at("_preflight_fleet,_summary", "release", "--all", "--json", "--root",
                         str(checkout), "--inventory", str(inventory))
    assert done.returncode == 143, done
    assert "Traceback" not in done.stderr and "interrupted: SIGTERM stops the operator's side only" in done.stderr, done
    for name in ("cyan", "peacock"):
        assert f"\n{name}: not started" in done.stderr, done.stderr
    document = json.loads(done.stdout)
    assert document["code"] == 143 and set(document["nodes"]) == {"cyan", "peacock"}, document


def test_a_signal_once_a_rollout_has_ended_leaves_its_document_and_its_exit_code(checkout):
    # A breaker's case: SIGTERM just after the rollout ended, as `release --json` printed its document: the
    # document was lost (nothing on stdout) and the exit was 143 beside a summary that said the run's own code.
    import json

    inventory = _unreachable_fleet(checkout)
    # document#2: the --json document's (the first makes the summary's table).
    done = _signalled_at("document#2", "release", "--all", "--json", "--root", str(checkout),
                         "--inventory", str(inventory))
    document = json.loads(done.stdout)
    assert done.returncode == document["code"] and done.returncode not in (0, 130, 143), done
    assert "Traceback" not in done.stderr and "interrupted" not in done.stderr, done.stderr


def test_a_signal_while_a_command_is_imported_says_nothing_changed():
    # A breaker's case: SIGTERM while typer and the commands were imported (half a second) said only
    # "interrupted by SIGTERM": nothing had run, and the line can say so.
    done = _signalled_at("import:typer", "--version")
    assert done.returncode == 143, done
    assert done.stderr == "flatshare: interrupted by SIGTERM before the command began: nothing changed\n", done


def test_two_signals_at_once_leave_the_first_ones_code_summary_and_document(checkout):
    # A breaker's case: SIGINT and SIGTERM together: the second, raised before the first one's handling had held
    # the signals, lost the summary, the --json document and the first signal's code (143 for a Ctrl-C).
    import json

    inventory = _unreachable_fleet(checkout)
    done = _signalled_at("_preflight_fleet!both", "release", "--all", "--json", "--root", str(checkout),
                         "--inventory", str(inventory))
    assert done.returncode == 130, done
    assert "interrupted: Ctrl-C stops the operator's side only" in done.stderr and "Traceback" not in done.stderr
    for name in ("cyan", "peacock"):
        assert f"\n{name}: not started" in done.stderr, done.stderr
    assert json.loads(done.stdout)["code"] == 130, done.stdout


def test_a_signal_as_python_clears_its_modules_leaves_the_commands_exit_code():
    # A breaker's case: Python sets its handlers back to the default action late in its shutdown, and a SIGTERM
    # then ended a command whose output said it succeeded with 143.
    done = _signalled_at("late", "--version")
    assert done.returncode == 0 and done.stdout.startswith("flatshare "), done
    assert "Traceback" not in done.stderr, done.stderr


def test_a_second_signal_once_they_are_held_ends_the_process_at_once():
    # A breaker's case: a terminal that took no more output (an unread pipe) held an interrupted release in its
    # summary's write, every later signal only noted: only SIGKILL ended it. The second noted signal ends it.
    import subprocess
    import sys

    script = ("import os, signal, time\n"
              "from flatshare_ops.control.interrupts import hold_signals, stop_on_signals\n"
              "stop_on_signals(); hold_signals()\n"
              "os.kill(os.getpid(), signal.SIGTERM)\n"
              "print('noted', flush=True)\n"
              "os.kill(os.getpid(), signal.SIGINT)\n"
              "time.sleep(600)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout) == (130, "noted\n"), done


def test_an_interrupted_release_ends_without_waiting_for_a_connection_still_being_opened(checkout):
    # A breaker's case: a node whose sshd took the TCP connection and never answered (SIGSTOPped): the interrupted
    # release printed its summary, then waited out the connect bound (connect_timeout_s + 5 s, ignoring signals)
    # for that connection before it exited. Here the bound is 600 s and the node (a socket that never answers)
    # keeps its handshake open for the whole test: the release ends all the same.
    import socket

    inventory = _unreachable_fleet(checkout)
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # the kernel takes the connection; nothing ever answers it
    try:
        text = inventory.read_text().replace("port = 1\n", f"port = {silent.getsockname()[1]}\n", 1)
        inventory.write_text(text + "\n[transport]\nconnect_timeout_s = 600\n")
        done = _signalled_at("_read_guard", "release", "--all", "--root", str(checkout), "--inventory",
                             str(inventory))
    finally:
        silent.close()
    assert done.returncode == 143, done
    assert done.stdout.rstrip().splitlines()[-1].startswith("peacock: not started"), done.stdout
    assert "Traceback" not in done.stdout + done.stderr and "FATAL" not in done.stderr, done.stderr


@pytest.mark.parametrize("words, what", [(["place", "-m", "E2 benchmark"], "place its hold"), (["lift"], "lift its hold")])
def test_a_hold_interrupted_while_its_node_is_asked_says_whether_it_was_done_is_not_known(checkout, words, what):
    # The same kind as a release's: an interrupt says what is known. A node asked to place or lift a hold may have
    # done it when the operator's side stops waiting for its answer.
    inventory = _unreachable_fleet(checkout)
    done = _signalled_at("call:flatshare_ops.control.fanout.ask", "hold", words[0], "--node", "cyan", *words[1:],
                         "--inventory", str(inventory))
    assert done.returncode == 143, done
    assert done.stderr == (f"flatshare: interrupted by SIGTERM while cyan was asked to {what}: whether it did is not "
                           "known; 'flatshare hold status --node cyan' says\n"), done


def _without_reader(stream: str, argv: list[str], **run) -> subprocess.CompletedProcess:
    """``subprocess.run(argv, **run)`` with ``stream`` (``"stdout"`` or ``"stderr"``) a pipe nobody reads: every
    write to it fails with EPIPE; the other stream is captured."""
    import os

    reader, write = os.pipe()
    os.close(reader)
    other = "stderr" if stream == "stdout" else "stdout"
    try:
        return subprocess.run(argv, **{stream: write, other: subprocess.PIPE, "text": True, **run})
    finally:
        os.close(write)


@pytest.mark.parametrize("args", [["--help"], ["profiles", "--help"]], ids=["flatshare --help", "profiles --help"])
def test_output_whose_reader_went_away_ends_the_command_as_a_pipeline_ends_its_writers(args):
    # `flatshare ... | head`: head exits before the command wrote everything. typer exits 1 then, which here says
    # "a release failed mid-switch"; a shell's pipeline ends such a writer with SIGPIPE (128 + 13).
    import signal
    import subprocess

    from conftest import BIN

    done = _without_reader("stdout", [str(BIN / "flatshare"), *args], stderr=subprocess.PIPE, text=True,
                              timeout=60)
    assert done.returncode == 128 + signal.SIGPIPE, done.stderr
    assert done.stderr == "", done.stderr  # nothing to say, and nobody to say it to


@pytest.mark.parametrize("args, code", [(["releases", "--inventory", "/nonexistent/fleet.toml"], 2),
                                        (["releases", "--no-such-option"], 2)],
                         ids=["an operator's error", "a usage error"])
def test_a_gone_stderr_leaves_the_commands_own_exit_code(args, code):
    # The one line goes nowhere; the code still says what happened (before: a BrokenPipeError, exit 1).
    import subprocess

    from conftest import BIN

    done = _without_reader("stderr", [str(BIN / "flatshare"), *args], stdout=subprocess.PIPE, text=True,
                              timeout=60)
    assert done.returncode == code, done.stdout


def test_a_release_json_document_whose_reader_went_away_leaves_the_rollouts_own_exit_code(checkout):
    # `release --json | jq` with jq gone: the document is lost, and exit 141 hid what the rollout did (here a
    # release refused, both nodes unreachable). The code is the one the same release gives with a reader.
    import subprocess

    from conftest import BIN

    inventory = _unreachable_fleet(checkout)
    argv = [str(BIN / "flatshare"), "release", "--all", "--json", "--inventory", str(inventory), "--root",
            str(checkout)]
    read = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert read.returncode not in (0, 141) and json.loads(read.stdout), read  # a refusal, said in the document
    lost = _without_reader("stdout", argv, stderr=subprocess.PIPE, text=True, timeout=120)
    assert lost.returncode == read.returncode, lost.stderr
    assert "Traceback" not in lost.stderr and "Exception ignored" not in lost.stderr, lost.stderr


@pytest.mark.parametrize("code, expected", [(0, 141), (9, 9)])
def test_a_lost_json_document_of_a_rollout_that_went_well_is_exit_141_and_of_one_that_did_not_its_code(code, expected):
    import subprocess
    import sys

    program = ("import sys, types; from flatshare_ops.cli.release import _finish; "
               "r = types.SimpleNamespace(run=lambda: int(sys.argv[1]), document=lambda: {'nodes': ['x' * 70000]}); "
               "sys.exit(_finish(r, True))")
    done = _without_reader("stdout", [sys.executable, "-c", program, str(code)], stderr=subprocess.PIPE,
                              text=True, timeout=60, cwd=REPO)
    assert done.returncode == expected, done.stderr
    assert done.stderr == "", done.stderr


def test_drift_said_to_a_gone_stderr_is_still_drift(checkout):
    # `profiles render` wrote its diff to stdout, then its last line to a stderr nobody read: exit 141 (a closed
    # output) where the fact is drift (1). The code is the one the same command gives with stderr read.
    import subprocess

    from conftest import BIN

    profile = checkout / "profiles/rtx-5060-ti-serve.toml"
    profile.write_text(re.sub(r"(?m)^decode_hold_tokens = \d+", "decode_hold_tokens = 7", profile.read_text()))
    argv = [str(BIN / "flatshare"), "profiles", "render", "--root", str(checkout)]
    read = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert read.returncode == 1 and "differ from the profile" in read.stderr, read
    lost = _without_reader("stderr", argv, stdout=subprocess.PIPE, text=True, timeout=120)
    assert lost.returncode == 1 and lost.stdout == read.stdout, lost.returncode


def _with_streams(argv: list[str], redirect: str) -> subprocess.CompletedProcess:
    """``argv`` with a shell redirection of its own (``>&-``: stdout closed; ``>/dev/full``), its output captured
    where the redirection leaves it."""
    return subprocess.run(["bash", "-c", f'"$@" {redirect}', "_", *argv], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("redirect", [">&-", "2>&-", "0<&- >&- 2>&-"])
def test_a_closed_standard_stream_changes_no_exit_code(redirect):
    # A breaker's case: a closed stream is None in Python: every command ended with a traceback or exit 1, and a
    # release with stdout closed crashed at its first line (the node then refused, the operator having gone).
    from conftest import BIN

    for argv, code in (([str(BIN / "flatshare"), "--version"], 0),
                       ([str(BIN / "flatshare"), "releases", "--inventory", "/nonexistent/fleet.toml"], 2),
                       ([str(BIN / "flatshare-node"), "--version"], 0)):
        done = _with_streams(argv, redirect)
        assert done.returncode == code, (argv, done)
        assert "Traceback" not in done.stderr and "flatshare:" not in done.stdout, done


def test_a_release_with_stdout_or_stderr_closed_ends_as_it_does_with_both_open(checkout):
    from conftest import BIN

    inventory = _unreachable_fleet(checkout)
    argv = [str(BIN / "flatshare"), "release", "--all", "--json", "--inventory", str(inventory), "--root",
            str(checkout)]
    both = _with_streams(argv, "")
    assert both.returncode not in (0, 1, 141), both  # a refusal
    closed_out = _with_streams(argv, ">&-")
    closed_err = _with_streams(argv, "2>&-")
    assert closed_out.returncode == closed_err.returncode == both.returncode, (closed_out, closed_err)
    assert json.loads(closed_err.stdout) and "Traceback" not in closed_out.stderr  # the document alone on stdout


def test_stdout_on_a_full_disk_is_one_line_and_exit_141_or_the_rollouts_own_code(checkout):
    # A breaker's case: `>/dev/full` gave a traceback and exit 1 in every command, losing a release's own code.
    from conftest import BIN

    for argv in ([str(BIN / "flatshare"), "--version"], [str(BIN / "flatshare-node"), "--version"],
                 [str(BIN / "flatshare"), "--help"]):
        done = _with_streams(argv, ">/dev/full")
        program = Path(argv[0]).name
        assert done.returncode == 141 and done.stderr.splitlines() == [
            f"{program}: the output could not be written to stdout (No space left on device); what was not "
            "written is lost"], (argv, done)
    inventory = _unreachable_fleet(checkout)
    argv = [str(BIN / "flatshare"), "release", "--all", "--json", "--inventory", str(inventory), "--root",
            str(checkout)]
    read, full = _with_streams(argv, ""), _with_streams(argv, ">/dev/full")
    assert full.returncode == read.returncode != 141 and "Traceback" not in full.stderr, full
    assert full.stderr.splitlines()[-1].startswith("flatshare: the output could not be written to stdout"), full


def test_the_nodes_answer_whose_reader_went_away_is_exit_141_in_silence():
    import subprocess

    from conftest import BIN

    done = _without_reader("stdout", [str(BIN / "flatshare-node"), "--version"], stderr=subprocess.PIPE,
                              text=True, timeout=60)
    assert (done.returncode, done.stderr) == (141, ""), done


def test_profiles_verify_json_with_stderr_gone_writes_its_document():
    import subprocess

    from conftest import BIN

    done = _without_reader("stderr", [str(BIN / "flatshare"), "profiles", "verify", "--json", "--root", str(REPO)],
                              stdout=subprocess.PIPE, text=True, timeout=120)
    assert done.returncode == 0 and json.loads(done.stdout)["ok"] is True, done.returncode


@pytest.mark.parametrize("leftover", ["nothing", "an empty directory", "a module"])
def test_flatshare_sandbox_where_the_sandbox_is_not_installed_says_so_in_one_line(tmp_path, leftover):
    # A node's install has no flatshare_ops/sandbox (control/wheels.py); one that once had it may keep an empty
    # directory (its __pycache__), and a module of that name is no sandbox either.
    import shutil
    import subprocess
    import sys

    shutil.copytree(REPO / "flatshare_ops", tmp_path / "flatshare_ops",
                    ignore=lambda d, names: ["sandbox"] if Path(d) == REPO / "flatshare_ops" else [])
    if leftover == "an empty directory":
        (tmp_path / "flatshare_ops/sandbox/__pycache__").mkdir(parents=True)
    elif leftover == "a module":
        (tmp_path / "flatshare_ops/sandbox.py").write_text("")
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from flatshare_ops.cli import main; "
            "sys.argv = ['flatshare', 'sandbox', 'status']; main()")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60,
                          cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.splitlines() == [
        "flatshare: this install of flatshare-ops has no sandbox (a node's install leaves it out): run "
        "'flatshare sandbox' from a checkout, after 'make setup'"], done.stdout + done.stderr


@pytest.mark.parametrize("damage", ["a library it needs missing", "its package raising",
                                    "its package importing a missing library", "a module emptied",
                                    "a module deleted beside the others"])
def test_a_sandbox_that_does_not_import_is_said_in_one_line_and_help_needs_no_sandbox(tmp_path, damage):
    import shutil
    import subprocess
    import sys

    shutil.copytree(REPO / "flatshare_ops", tmp_path / "flatshare_ops",
                    ignore=shutil.ignore_patterns("__pycache__"))
    fleet = tmp_path / "flatshare_ops/sandbox/fleet.py"
    if damage == "a library it needs missing":
        with open(fleet, "a") as module:
            module.write("\nimport not_a_library_anywhere\n")
    elif damage == "its package raising":
        (tmp_path / "flatshare_ops/sandbox/__init__.py").write_text("raise RuntimeError('half-copied')\n")
    elif damage == "its package importing a missing library":
        (tmp_path / "flatshare_ops/sandbox/__init__.py").write_text("import not_a_library_anywhere\n")
    elif damage == "a module emptied":
        fleet.write_text("")
    else:
        fleet.unlink()

    def flatshare(*args: str) -> subprocess.CompletedProcess:
        code = ("import sys; sys.path.insert(0, sys.argv[1]); from flatshare_ops.cli import main; "
                "sys.argv = ['flatshare', *sys.argv[2:]]; main()")
        return subprocess.run([sys.executable, "-c", code, str(tmp_path), *args], capture_output=True, text=True,
                              timeout=60, cwd=tmp_path)

    done = flatshare("sandbox", "status", "--dir", str(tmp_path / "none"))
    (line,) = done.stderr.splitlines()
    assert done.returncode == 2 and line.startswith("flatshare: this install's sandbox does not import ("), done
    assert line.endswith("): install it again with 'make setup' in the checkout"), line
    said = {"a library it needs missing": "not_a_library_anywhere", "its package raising": "RuntimeError: half-copied",
            "its package importing a missing library": "not_a_library_anywhere",
            "a module emptied": "flatshare_ops.sandbox.fleet: it has no parse_addresses",
            "a module deleted beside the others": "flatshare_ops.sandbox.fleet: it is missing"}[damage]
    assert said in line, line
    shown = flatshare("sandbox", "up", "--help")
    assert shown.returncode == 0 and shown.stdout.startswith("Usage: flatshare sandbox up"), shown
    shutil.rmtree(tmp_path / "flatshare_ops/sandbox")  # a node's install: help still answers
    shown = flatshare("sandbox", "down", "--help")
    assert shown.returncode == 0 and shown.stdout.startswith("Usage: flatshare sandbox down"), shown


def test_a_project_file_that_cannot_be_copied_for_the_nodes_wheel_is_named(tmp_path):
    from flatshare_ops.control.wheels import node_project
    from flatshare_ops.errors import FlatshareError

    project = tmp_path / "project"
    (project / "flatshare_ops/node").mkdir(parents=True)
    (project / "pyproject.toml").write_text("")
    (project / "flatshare_ops/node/loop").symlink_to("loop")  # a link to itself: ELOOP
    (tmp_path / "scratch").mkdir()
    with pytest.raises(FlatshareError) as refused:
        node_project(project, tmp_path / "scratch")
    assert str(refused.value).startswith(f"{project / 'flatshare_ops/node/loop'}: cannot be copied to build the "
                                         "node's wheel ("), str(refused.value)
