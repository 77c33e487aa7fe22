"""`make profiles` (flatshare profiles render): silent without drift, a diff and exit 1 with it,
atomic rewrites with --update; `flatshare profiles set` keeps comments and re-renders."""

from __future__ import annotations

import hashlib
import json

import pytest

from conftest import BIN, REPO, run_cli, snapshot
from flatshare_ops.config.profile import load_profile
from flatshare_ops.render import render_profile


def test_committed_files_match_the_profile():
    result = run_cli("profiles", "render", "--root", str(REPO))
    # No drift and nothing else: production's placeholder pin is doctor's warning and release's refusal.
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


def test_serving_json_hashes_the_committed_units_and_pins_the_module():
    serving = json.loads((REPO / "profiles/rtx-5060-ti-serve.serving.json").read_text())
    assert serving["schema"] == 1
    assert serving["vllm_release"] == "0.32.0"
    for name, digest in serving["units"].items():
        assert hashlib.sha256((REPO / "units" / name).read_bytes()).hexdigest() == digest
    assert serving["module"]["name"] == "flatshare_make_room_serve"
    argv = serving["engine"]["argv"]
    hold = load_profile(REPO / "profiles/rtx-5060-ti-serve.toml").profile.engine.make_room.decode_hold_tokens
    assert argv[argv.index("--additional-config.make_room.decode_hold_tokens") + 1] == str(hold)


def test_drift_prints_a_unified_diff_per_file_and_exits_1(checkout):
    unit = checkout / "units/flatshare-gateway.service"
    unit.write_text(unit.read_text().replace("RestartSec=2s", "RestartSec=9s"))
    before = snapshot(checkout)
    result = run_cli("profiles", "render", "--root", str(checkout))
    assert result.returncode == 1
    assert "--- a/units/flatshare-gateway.service" in result.stdout
    assert "-RestartSec=9s\n+RestartSec=2s" in result.stdout
    assert "make profiles UPDATE=1" in result.stderr
    assert snapshot(checkout) == before


def test_update_rewrites_only_what_drifted_and_lists_it(checkout):
    unit = checkout / "units/flatshare-gateway.service"
    unit.write_text("edited by hand\n")
    result = run_cli("profiles", "render", "--update", "--root", str(checkout))
    assert result.returncode == 0
    assert result.stdout == "wrote units/flatshare-gateway.service\n"
    assert unit.read_bytes() == (REPO / "units/flatshare-gateway.service").read_bytes()
    assert not list(checkout.rglob("*.tmp")), "no temporary file may stay behind"


def test_text_outside_the_markers_is_never_touched(checkout):
    readme = checkout / "README.md"
    text = readme.read_text()
    begin = text.index("<!-- BEGIN generated: quick-start")
    end = text.index("<!-- END generated: quick-start -->")
    readme.write_text("hand-written intro\n" + text[:begin] + text[begin:end].replace("--port", "--portX") + text[end:] + "hand-written tail\n")
    assert run_cli("profiles", "render", "--update", "--root", str(checkout)).returncode == 0
    assert readme.read_text() == "hand-written intro\n" + text + "hand-written tail\n"


def test_missing_markers_are_a_clear_error(checkout):
    production = checkout / "PRODUCTION.md"
    production.write_text("# Production\n")
    before = snapshot(checkout)
    result = run_cli("profiles", "render", "--update", "--root", str(checkout))
    assert result.returncode == 2
    assert "PRODUCTION.md: generated block 'nodes' needs exactly one" in result.stderr
    assert snapshot(checkout) == before


def test_set_keeps_comments_validates_and_renders(checkout):
    profile = checkout / "profiles/rtx-5060-ti-serve.toml"
    before = profile.read_text()
    old = load_profile(profile).profile.engine.make_room.decode_hold_tokens
    new = 7 if old != 7 else 8
    result = run_cli("profiles", "set", "engine.make_room.decode_hold_tokens", str(new), "--root", str(checkout))
    assert result.returncode == 0, result.stderr
    after = profile.read_text()
    assert after == before.replace(f"decode_hold_tokens = {old}", f"decode_hold_tokens = {new}")
    unit = (checkout / "units/flatshare-engine.service").read_text()
    assert f'"--additional-config.make_room.decode_hold_tokens" "{new}"' in unit
    release = load_profile(profile).profile.engine.vllm_release
    assert f"| cyan | NVIDIA GeForce RTX 5060 Ti | rtx-5060-ti-serve | {release} |" in (checkout / "PRODUCTION.md").read_text()
    assert f"| {new} |" in (checkout / "PRODUCTION.md").read_text()
    assert run_cli("profiles", "render", "--root", str(checkout)).returncode == 0


def test_set_refuses_an_invalid_value_and_changes_nothing(checkout):
    before = snapshot(checkout)
    result = run_cli("profiles", "set", "engine.make_room.decode_hold_tokens", "-1", "--root", str(checkout))
    assert result.returncode == 2
    assert "engine.make_room.decode_hold_tokens" in result.stderr and "greater than or equal to 0" in result.stderr
    assert "Traceback" not in result.stderr
    assert snapshot(checkout) == before


def test_set_refuses_an_unknown_key(checkout):
    before = snapshot(checkout)
    result = run_cli("profiles", "set", "engine.make_room.decode_hold", "0", "--root", str(checkout))
    # The whole key, the part the schema lacks, and the schema's closest key (issue 35).
    assert result.returncode == 2 and "engine.make_room.decode_hold: not a profile key" in result.stderr
    assert "did you mean decode_hold_tokens?" in result.stderr, result.stderr
    missing = run_cli("profiles", "set", "no.such.key", "1", "--root", str(checkout))
    assert missing.returncode == 2 and "no.such.key: not a profile key (no is not a key" in missing.stderr
    assert snapshot(checkout) == before


def test_set_writes_nothing_when_a_rendered_file_cannot_be_made(checkout):
    (checkout / "README.md").write_text("# no markers here\n")
    before = snapshot(checkout)
    result = run_cli("profiles", "set", "engine.make_room.decode_hold_tokens", "0", "--root", str(checkout))
    assert result.returncode == 2
    assert "README.md: generated block 'quick-start'" in result.stderr
    assert snapshot(checkout) == before


def test_set_keeps_the_lines_own_comment(checkout):
    profile = checkout / "profiles/rtx-5060-ti-serve.toml"
    before = profile.read_text()
    assert run_cli("profiles", "set", "engine.port", "8001", "--root", str(checkout)).returncode == 0
    assert profile.read_text() == before.replace(
        "port = 8000                                        # vLLM's default port",
        "port = 8001                                        # vLLM's default port")


def test_set_of_a_key_the_table_lacks_adds_its_line_and_keeps_the_blank_line_before_the_next_table(checkout):
    # A breaker's case: the new key took the place of the blank line that kept [module] apart.
    profile = checkout / "profiles/rtx-5060-ti-serve.toml"
    before = profile.read_text()
    header, rest = before.split("[engine.override_generation_config]\n", 1)
    comments, after = rest.split("\n[module]\n", 1)
    assert "temperature =" not in comments and comments.endswith("\n")  # the table holds only its comments
    result = run_cli("profiles", "set", "engine.override_generation_config.temperature", "0.5", "--root", str(checkout))
    assert result.returncode == 0, result.stderr
    assert profile.read_text() == (f"{header}[engine.override_generation_config]\n{comments}temperature = 0.5\n\n"
                                   f"[module]\n{after}")
    assert load_profile(profile).profile.engine.override_generation_config.temperature == 0.5


def test_set_refuses_a_value_with_more_than_one_value(checkout):
    before = snapshot(checkout)
    for value in ['8001\nhost = "0.0.0.0"', "8001 # new comment"]:
        result = run_cli("profiles", "set", "engine.port", value, "--root", str(checkout))
        assert result.returncode == 2 and "VALUE must be" in result.stderr, result.stderr
    assert snapshot(checkout) == before


def test_set_refuses_to_replace_a_table(checkout):
    before = snapshot(checkout)
    result = run_cli("profiles", "set", "engine.make_room", "5", "--root", str(checkout))
    assert result.returncode == 2 and "engine.make_room: is a table; set one of its keys" in result.stderr
    assert snapshot(checkout) == before


def test_a_placeholder_module_pin_warns_in_doctor_and_refuses_a_release_before_connecting(checkout):
    rendered = run_cli("profiles", "render", "--root", str(checkout))
    assert (rendered.returncode, rendered.stderr) == (0, "")  # not drift, and not said by render
    doctor = run_cli("doctor", "--json", "--root", str(checkout), "--inventory", str(checkout / "profiles/fleet.toml"))
    pins = [i for i in json.loads(doctor.stdout)["items"] if i["item"] == "module pin"]
    assert [i["state"] for i in pins] and {i["state"] for i in pins} == {"WARN"}, doctor.stdout
    assert any(i["detail"].startswith("profiles/rtx-5060-ti-serve.toml pins a placeholder") for i in pins), pins
    # The production inventory's hosts do not resolve here: a refusal that had tried to connect would be exit 6.
    result = run_cli("release", "--all", "--dry-run", "--root", str(checkout),
                     "--inventory", str(checkout / "profiles/fleet.toml"))
    assert result.returncode == 3, result.stdout + result.stderr
    assert "the module pin is a placeholder (zeros) in the profile of cyan" in result.stderr
    assert "flatshare profiles pin-module" in result.stderr


def test_pin_module_sets_the_hash_keeps_comments_and_renders(checkout, tmp_path):
    module = tmp_path / "flatshare_make_room_serve.py"
    module.write_bytes(b"# a built module\n")
    expected = hashlib.sha256(module.read_bytes()).hexdigest()  # the independent hash
    profile = checkout / "profiles/rtx-5060-ti-serve.toml"
    before = profile.read_text()
    result = run_cli("profiles", "pin-module", "--file", str(module), "--root", str(checkout))
    assert result.returncode == 0, result.stderr
    assert profile.read_text() == before.replace("0" * 64, expected)
    serving = json.loads((checkout / "profiles/rtx-5060-ti-serve.serving.json").read_text())
    assert serving["module"]["sha256"] == expected
    assert f"`{expected}`" in (checkout / "PRODUCTION.md").read_text()
    bad = run_cli("profiles", "pin-module", "--sha256", "XYZ", "--root", str(checkout))
    assert bad.returncode == 2 and "is not a sha256" in bad.stderr


def test_the_variant_renders_beside_production_and_is_drift_checked(checkout):
    variant = checkout / "units/rtx-5060-ti-serve-vllm-0.33/flatshare-engine.service"
    assert '"/opt/flatshare/engine-venv-0.33/bin/vllm" "serve"' in variant.read_text()
    assert "engine-venv-0.33" not in (checkout / "units/flatshare-engine.service").read_text()
    variant.write_text(variant.read_text() + "# hand edit\n")
    result = run_cli("profiles", "render", "--root", str(checkout))
    assert result.returncode == 1 and "units/rtx-5060-ti-serve-vllm-0.33/flatshare-engine.service" in result.stdout


def test_profiles_verify_json_is_one_document_on_stdout_with_its_findings(checkout):
    # A threshold no vLLM bucket bound equals: a warning, in the document too.
    changed = run_cli("profiles", "set", "release.analysis.ttft_p95_max_s", "0.3", "--root", str(checkout))
    assert changed.returncode == 0, changed.stderr
    result = run_cli("profiles", "verify", "--json", "--vllm", str(REPO / ".venv-vllm"), "--root", str(checkout),
                     timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    document = json.loads(result.stdout)  # the whole of stdout; people's lines on stderr
    rendered = render_profile(load_profile(checkout / "profiles/rtx-5060-ti-serve.toml"))
    assert document["units"] == sorted(rendered.units) and document["systemd_analyze"] == ""
    assert (document["ok"], document["vllm"]["ok"], document["vllm"]["error"]) == (True, True, None)
    assert len(document["warnings"]) == 1 and "0.3" in document["warnings"][0], document["warnings"]
    assert "systemd-analyze verify printed nothing" in result.stderr


def test_a_value_with_bytes_that_are_not_utf8_inside_a_list_is_one_line_and_nothing_is_written(checkout):
    # A breaker's case: the same bytes as a bare string were refused in one line; inside a list they reached the
    # file's encoding and raised UnicodeEncodeError with a traceback.
    import os
    import subprocess

    before = snapshot(checkout)
    result = subprocess.run([os.fsencode(str(BIN / "flatshare")), b"profiles", b"set",
                             b"release.analysis.golden.prompts", b'["\xff\xfe"]', b"--root", os.fsencode(str(checkout))],
                            capture_output=True, timeout=120)
    err = result.stderr.decode(errors="replace")
    assert result.returncode == 2 and "Traceback" not in err, err
    assert "release.analysis.golden.prompts" in err and len(err.strip().splitlines()) == 1, err
    assert snapshot(checkout) == before


def test_profiles_set_on_a_full_disk_changes_no_file_and_says_which_in_one_line(tmp_path):
    # A breaker's case: on a full disk `profiles set` put the profile back but had rewritten three of the rendered
    # files already (the checkout half one value, half the other), with OSError's traceback.
    import os
    import subprocess

    from conftest import copy_checkout

    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], check=True)
    try:
        checkout = copy_checkout(REPO, disk / "checkout")
        profile = checkout / "profiles/rtx-5060-ti-serve.toml"
        old = load_profile(profile).profile.engine.make_room.decode_hold_tokens
        before = snapshot(checkout)
        # Room for the profile's new text and about two pages more: some rendered files, never all of them.
        room = profile.stat().st_size + 8192
        free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
        with open(disk / "filler", "wb") as f:
            f.truncate(0)
        subprocess.run(["fallocate", "-l", str(max(0, free - room)), str(disk / "filler")], check=True)
        result = run_cli("profiles", "set", "engine.make_room.decode_hold_tokens", str(0 if old else 48),
                         "--root", str(checkout))
        after = snapshot(checkout)
    finally:
        subprocess.run(["umount", str(disk)], check=True)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "No space left on device" in result.stderr, result.stderr
    assert after == before  # every file as it was: the profile put back, no rendered file changed


@pytest.mark.parametrize("form", ["fifo", "directory", "not-utf8"])
def test_a_rendered_file_damaged_in_the_checkout_is_drift_never_a_wait_or_a_traceback(checkout, form):
    # A breaker's case: a FIFO where units/flatshare-engine.service belongs made release, doctor and `profiles
    # render` wait with no output; a directory or bytes that are not UTF-8 gave a traceback, --update too.
    import os
    import shutil

    path = checkout / "units/flatshare-engine.service"
    committed = path.read_bytes()
    path.unlink()
    if form == "fifo":
        os.mkfifo(path)
    elif form == "directory":
        path.mkdir()
    else:
        path.write_bytes(committed + b"\xff\n")
    shown = run_cli("profiles", "render", "--root", str(checkout), timeout=120)
    assert shown.returncode == 1 and "units/flatshare-engine.service" in shown.stdout, shown.stdout + shown.stderr
    assert "Traceback" not in shown.stderr, shown.stderr
    updated = run_cli("profiles", "render", "--update", "--root", str(checkout), timeout=120)
    assert "Traceback" not in updated.stderr, updated.stderr
    if form == "not-utf8":  # a file with other bytes: rewritten
        assert updated.returncode == 0 and path.read_bytes() == committed, updated.stdout + updated.stderr
    else:  # something else in its place: named, and nothing is written
        assert updated.returncode == 1 and len(updated.stderr.strip().splitlines()) == 1, updated.stderr
        said = "a FIFO (named pipe)" if form == "fifo" else "a directory"
        assert f"units/flatshare-engine.service: {said} where a rendered file belongs" in updated.stderr, updated.stderr
        # A release from this checkout is refused for the drift, saying what is there (UPDATE=1 alone cannot fix it).
        from flatshare_ops.control.rollout import refuse_drift
        from flatshare_ops.errors import Refused

        with pytest.raises(Refused) as refused:
            refuse_drift(checkout)
        assert f"units/flatshare-engine.service: {said} where a rendered file belongs" in str(refused.value)
        if form == "directory":
            shutil.rmtree(path)
        else:
            path.unlink()
        assert run_cli("profiles", "render", "--update", "--root", str(checkout), timeout=120).returncode == 0
        assert path.read_bytes() == committed


@pytest.mark.parametrize("form", ["fifo", "not-utf8"])
def test_a_document_with_generated_blocks_damaged_is_named_in_one_line(checkout, form):
    import os

    path = checkout / "README.md"
    if form == "fifo":
        path.unlink()
        os.mkfifo(path)
    else:
        path.write_bytes(path.read_bytes() + b"\xff\n")
    result = run_cli("profiles", "render", "--root", str(checkout), timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stdout + result.stderr
    assert "README.md: " in result.stderr and "git checkout README.md" in result.stderr, result.stderr
