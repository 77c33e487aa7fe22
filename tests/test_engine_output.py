"""What the tool reads from a real engine that the stand-in does not make it read: the engine's output (its
last lines, the serve module's turn count), a vLLM release with a PEP 440 local label, and the sandbox's
TOML (written by tomlkit, read back by the standard library's tomllib)."""

from __future__ import annotations

import subprocess
import sys
import tomllib

import pytest

from conftest import REPO
from flatshare_ops.check.facts import turns_announced
from flatshare_ops.common.vllm_release import same_release, shown
from flatshare_ops.common.unit_output import (CHUNK_BYTES, TAIL_BYTES, last_lines, last_marked, output_file,
                                              output_mark)
from flatshare_ops.config.profile import load_profile


def _layout(tmp_path) -> dict:
    return {"scope": "user", "output": str(tmp_path)}


def test_a_units_output_file_is_where_the_profile_says_and_the_journal_has_none():
    assert output_file("/var/log/flatshare", "flatshare-engine.service") == "/var/log/flatshare/flatshare-engine.service.log"
    assert output_file("journal", "flatshare-engine.service") is None


def test_the_last_lines_are_the_files_end_each_one_line_of_text(tmp_path):
    lines = [f"line {i}" for i in range(1000)] + ["\x1b[1;36mINFO\x1b[0m colour", "a\rcarriage"]
    (tmp_path / "flatshare-engine.service.log").write_text("\n".join(lines) + "\n")
    tail = last_lines(_layout(tmp_path), "flatshare-engine.service", 3)
    assert tail.problem is None
    assert tail.lines == ["line 999", "INFO colour", "a\\rcarriage"]


def test_a_failed_start_quotes_its_own_lines_never_an_earlier_starts(tmp_path):
    # A breaker's case: the quote of a start configured to load for an hour held "ready in 1 s" from the
    # start before it (the unit appends every start's output to one file).
    path = tmp_path / "flatshare-engine.service.log"
    path.write_text("stand-in engine: serving, ready in 1 s\n" * 5)
    mark = output_mark(_layout(tmp_path), "flatshare-engine.service")
    assert mark == ("bytes", float(path.stat().st_size))
    with open(path, "a") as f:
        f.write("stand-in engine: loading for 3600 s\n")
    tail = last_lines(_layout(tmp_path), "flatshare-engine.service", 10, since=mark)
    assert tail.lines == ["stand-in engine: loading for 3600 s"]
    path.write_text("rotated\n")  # a file that shrank since the mark is read whole
    assert last_lines(_layout(tmp_path), "flatshare-engine.service", 10, since=mark).lines == ["rotated"]


def test_a_long_file_is_read_from_its_end_only_and_its_first_cut_line_dropped(tmp_path):
    path = tmp_path / "flatshare-engine.service.log"
    path.write_bytes(b"x" * (TAIL_BYTES * 3) + b"\nlast\n")
    tail = last_lines(_layout(tmp_path), "flatshare-engine.service", 10)
    assert tail.lines == ["last"]


def test_a_rare_marked_line_is_found_behind_a_flood_of_others_and_across_a_chunks_edge(tmp_path):
    # vLLM logs every request: the serve module's start line falls out of the tail the quotes read, never
    # out of reach of the turn count. One marked line straddles a chunk's edge (read backwards, 1 MiB each).
    path = tmp_path / "flatshare-engine.service.log"
    start = "(EngineCore pid=7) flatshare make-room: event=start engine_pid=41 make_room={}\n"
    flood = "".join(f'INFO:     127.0.0.1:5{i % 10000:04d} - "POST /v1/completions HTTP/1.1" 200 OK\n' for i in range(12000))
    straddle = "flatshare make-room: event=turn engine_pid=41 turns_announced=3 " + "z" * 200 + "\n"
    tail = ("q" * 99 + "\n") * ((CHUNK_BYTES - 100) // 100)  # the first chunk read (from the end) ends 100 bytes
    tail += "q" * (CHUNK_BYTES - 100 - len(tail) - 1) + "\n"  # into the turn line: the line straddles its edge
    path.write_text(start + flood + straddle + tail)
    edge = path.stat().st_size - CHUNK_BYTES
    at = len(start) + len(flood)
    assert at < edge < at + len(straddle) and path.stat().st_size > 2 * TAIL_BYTES
    assert turns_announced(last_lines(_layout(tmp_path), "flatshare-engine.service").lines, 41) is None
    marked = last_marked(_layout(tmp_path), "flatshare-engine.service", "flatshare make-room:")
    assert marked.problem is None and marked.lines == [start.rstrip("\n"), straddle.rstrip("\n")], marked.lines[:2]
    assert turns_announced(marked.lines, 41) == 3.0


def test_a_missing_output_file_is_named_never_raised(tmp_path):
    tail = last_lines(_layout(tmp_path), "flatshare-engine.service")
    assert tail.lines == [] and "does not exist" in tail.problem
    assert "could not be read" in tail.quote()


def test_a_quote_keeps_the_cause_of_a_traceback_above_its_last_lines(tmp_path):
    lines = ["(EngineCore pid=7) ValueError: flatshare make-room: decode_hold_tokens ...", *[f"frame {i}" for i in range(20)],
             "RuntimeError: Engine core initialization failed. See root cause above."]
    (tmp_path / "flatshare-engine.service.log").write_text("\n".join(lines) + "\n")
    quote = last_lines(_layout(tmp_path), "flatshare-engine.service").quote(count=5)
    assert quote.index("ValueError: flatshare make-room") < quote.index("...") < quote.index("Engine core initialization")
    assert "frame 10" not in quote and "frame 19" in quote


def test_the_turn_count_is_the_running_engines_newest_line():
    tag = "flatshare make-room:"
    lines = [f"{tag} event=start engine_pid=10 pid=11 make_room={{}}",
             f"{tag} event=turn engine_pid=10 pid=11 turns_announced=5",
             "(EngineCore pid=21) " f"{tag} event=start engine_pid=20 pid=21 make_room={{}}",
             "INFO 12-01 a line of vLLM's own",
             "(EngineCore pid=21) " f"{tag} event=turn engine_pid=20 pid=21 turns_announced=2"]
    assert turns_announced(lines, 20) == 2
    assert turns_announced(lines[:4], 20) == 0  # started, no turn yet
    assert turns_announced(lines, 10) == 5  # an earlier engine's own count
    assert turns_announced(lines, 30) is None  # no line of this engine: unknown, not 0


@pytest.mark.parametrize("found, wanted, same", [
    ("0.32.0", "0.32.0", True), ("0.32.0+cpu", "0.32.0", True), ("0.32.0+cu128", "0.32.0", True),
    ("0.32.1", "0.32.0", False), ("0.32.0rc1", "0.32.0", False), ("0.33.0+cpu", "0.32.0", False),
    ("not a version", "0.32.0", False), (None, "0.32.0", False)])
def test_a_release_is_its_public_version_the_local_label_never_counted(found, wanted, same):
    assert same_release(found, wanted) is same


def test_a_local_label_is_shown():
    assert shown("0.32.0+cpu", "0.32.0") == "0.32.0+cpu (release 0.32.0, local label cpu)"
    assert shown("0.32.1", "0.32.0") == "0.32.1" and shown(None, "0.32.0") == "not installed"


def test_comparing_equal_releases_never_imports_packaging():
    # serving-check runs every minute (adr/0006): the PEP 440 library only when the strings differ.
    code = ("import sys; from flatshare_ops.common.vllm_release import same_release; "
            "assert same_release('0.32.0', '0.32.0'); print('packaging' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


@pytest.mark.parametrize("engine", ["stand-in", "vllm"])
def test_a_node_profile_with_a_character_outside_the_bmp_round_trips_through_tomllib(tmp_path, engine):
    from flatshare_ops.sandbox import node_profile

    odd = tmp_path / "n\U0001F600de"  # a path holding U+1F600 (JSON would write a surrogate pair TOML refuses)
    text = node_profile.node_document(
        extends=REPO / "profiles/rtx-5060-ti-serve.toml", engine=engine, venv=odd / "venv", model=odd / "model",
        address="127.0.0.9", state_dir=odd / "state", module_dir=odd / "module",
        check_command=[str(odd / ".venv/bin/serving-check"), "--quiet"],
        layout={"scope": "user", "unit_dir": str(odd / "units"), "state_dir": str(odd / "state"),
                "run_dir": str(odd / "run")}, output_dir=odd / "log")
    data = tomllib.loads(text)
    assert data["engine"]["model"] == str(odd / "model") and data["layout"]["output"] == str(odd / "log")
    (tmp_path / "profile.toml").write_text(text)
    engine_table = load_profile(tmp_path / "profile.toml").profile.engine
    assert engine_table.venv == str(odd / "venv")
    if engine == "vllm":  # every override the sandbox states is what the profile then holds
        for override in node_profile.VLLM_OVERRIDES:
            value = data
            for part in override.key.split("."):
                value = value[part]
            assert value == override.value and override.reason
