"""The recorded production values (docs/reference/profile-values.md), and bad profiles get one clear line."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from conftest import REPO, run_cli, snapshot
from flatshare_ops.errors import ProfileError
from flatshare_ops.config.profile import load_profile

PROFILE = "profiles/rtx-5060-ti-serve.toml"


RECORDED = REPO / "tests/fixtures/recorded-production.toml"


def test_the_recorded_production_profile_carries_every_value_of_the_facts_table():
    # docs/reference/profile-values.md#production-values, as recorded; the live profile may differ
    # by the operator's choices (test_the_production_profile_keeps_what_is_not_a_choice).
    p = load_profile(RECORDED).profile
    e = p.engine
    assert e.vllm_release == "0.32.0"
    assert e.scheduler_cls == "flatshare_make_room_serve.AsyncScheduler"
    assert (e.make_room.retain_tokens, e.make_room.retain_s, e.make_room.hint_hold_ms) == (3584, 30, 400)
    assert e.make_room.take_reservations is True
    assert e.make_room.decode_hold_tokens == 48
    assert e.make_room.recompute_tokens == 0
    assert e.flatshare_jit.margin_ms == 30
    assert e.flatshare_jit.step_time_model.startswith("/")
    assert e.kv_cache_dtype == "auto"
    assert e.kv_offloading.enabled is True
    assert e.async_scheduling is True
    assert e.attention_backend == "FLASHINFER"
    assert p.voice.turn_hints is True
    assert (p.voice.endpointing_min_s, p.voice.endpointing_max_s) == (0.5, 3.0)
    assert p.gateway.drain_timeout_s > 0
    assert re.fullmatch(r"[0-9a-f]{64}", p.module.sha256)


def test_the_production_profile_keeps_what_is_not_a_choice():
    """What PRODUCTION.md does not name as the operator's to choose: the stack's facts."""
    recorded, live = load_profile(RECORDED).profile, load_profile(REPO / PROFILE).profile
    for path in ("engine.scheduler_cls", "engine.attention_backend", "engine.kv_cache_dtype", "module.name",
                 "card.name", "card.memory_gib"):
        a, b = recorded, live
        for part in path.split("."):
            a, b = getattr(a, part), getattr(b, part)
        assert a == b, path


def test_every_non_obvious_value_in_the_profile_has_a_comment():
    text = (REPO / PROFILE).read_text()
    lines = text.splitlines()
    for key in ("decode_hold_tokens", "kv_cache_dtype", "sha256", "retain_tokens", "drain_timeout_s", "vllm_release"):
        index = next(i for i, line in enumerate(lines) if line.startswith(f"{key} ="))
        around = "\n".join(lines[max(0, index - 3) : index + 1])
        assert "#" in around, f"{key} has no comment"


def _write(root: Path, name: str, text: str) -> Path:
    path = root / "profiles" / name
    path.write_text(text)
    return path


def _child(root: Path, body: str, name: str = "child.toml") -> Path:
    return _write(root, name, f'extends = "rtx-5060-ti-serve.toml"\n{body}')


def test_extends_overrides_only_what_the_child_states(checkout):
    child = _child(checkout, '[layout]\nscope = "user"\nunit_dir = "/srv/units"\nstate_dir = "/srv/state"\nrun_dir = "/srv/run"\n')
    loaded = load_profile(child)
    assert loaded.profile.layout.unit_dir == "/srv/units"
    assert loaded.profile.layout.service_user == "flatshare"  # the child's [layout] merges key by key...
    parent = tomllib.loads((checkout / "profiles/rtx-5060-ti-serve.toml").read_text())
    inherited = parent["engine"]["make_room"]["decode_hold_tokens"]
    assert loaded.profile.engine.make_room.decode_hold_tokens == inherited  # ...and the rest is inherited


def _render_error(checkout: Path, profile: Path) -> tuple[int, str, str]:
    before = snapshot(checkout)
    result = run_cli("profiles", "verify", "--root", str(checkout), "--profile", str(profile.relative_to(checkout)))
    assert snapshot(checkout) == before, "a refused profile must not write anything"
    return result.returncode, result.stdout, result.stderr


_A = load_profile(REPO / PROFILE).profile.release.analysis  # the parent's analysis values

BAD_PROFILES = {
    # name: (child text, what the one line must say)
    "malformed": ("[engine\nport = 1\n", r"child\.toml:2: malformed TOML"),
    "unknown key": ("[engine.make_room]\ndecode_hold_tokenz = 1\n", r"child\.toml:3: engine\.make_room\.decode_hold_tokenz: unknown key"),
    "wrong type": ('[engine]\nport = "8000"\n', r"child\.toml:3: engine\.port: Input should be a valid integer"),
    "out of range": ("[engine.make_room]\ndecode_hold_tokens = -1\n", r"child\.toml:3: engine\.make_room\.decode_hold_tokens: .*greater than or equal to 0, got -1"),
    "fp8 with async and cpu tier": ('[engine]\nkv_cache_dtype = "fp8"\n', r"child\.toml:3: engine\.kv_cache_dtype: fp8 with async_scheduling and kv_offloading crashes"),
    "newline in a value": ('[voice]\ncommand = ["/bin/voice", "a\\nExecStartPre=/bin/evil"]\n', r"child\.toml:3: voice\.command\[1\]: must not contain control character '\\n'"),
    "control character": ('[engine]\nmodel = "/m\\u0007"\n', r"child\.toml:3: engine\.model: .*control character"),
    # Both ends given by the child: the parent's own endpointing_max_s is the operator's to change.
    "endpointing reversed": ("[voice]\nendpointing_max_s = 3.0\nendpointing_min_s = 4.0\n", r"child\.toml:4: voice\.endpointing_min_s: must be <= endpointing_max_s \(3\.0\), got 4\.0"),
    "duplicate key": ("[voice]\nturn_hints = true\nturn_hints = false\n", r"child\.toml:4: malformed TOML: Key \"turn_hints\" already exists"),
    "typo": ("[engine.make_room]\ndecode_hold_token = 48\n", r"child\.toml:3: engine\.make_room\.decode_hold_token: unknown key \(did you mean decode_hold_tokens\?\)"),
    "infinite size": ("[engine.kv_offloading]\nsize_gib = inf\n", r"child\.toml:3: engine\.kv_offloading\.size_gib: .*finite"),
    "dollar in a program path": ('[gateway]\ncommand = ["/opt/gate$way/bin/gw"]\n', r"child\.toml:3: gateway\.command: a program path must not contain '\$'"),
    # Both given by the child: the parent's max_num_seqs is the operator's to change.
    "batch smaller than sequences": ("[engine]\nmax_num_seqs = 32\nmax_num_batched_tokens = 1\n", r"child\.toml:4: engine\.max_num_batched_tokens: must be >= max_num_seqs \(32\), got 1"),
    # One key written by the child (the rule points at it), at the bound the parent's others make: the
    # parent's analysis values are the operator's to change.
    "analysis limits not below count": (f"[release.analysis]\ninconclusive_limit = {_A.count - _A.failure_limit}\n",
                                        r"child\.toml:3: release\.analysis\.inconclusive_limit: failure_limit \+ "
                                        rf"inconclusive_limit must be below count \({_A.count}\), got "
                                        rf"{_A.failure_limit} \+ {_A.count - _A.failure_limit}"),
    "analysis longer than a day": ("[release.analysis]\ncount = 100\ninterval_s = 1000\n",
                                   r"child\.toml:\d+: release\.analysis\.count: the analysis would take count x "
                                   r"interval_s = 100000 s, more than a day \(86400 s\)"),
    # A breaker's case: 86,400,000 measurements 0.001 s apart passed the day's bound, and each took 3 s.
    "analysis of too many measurements": ("[release.analysis]\ncount = 86400000\ninterval_s = 0.001\n",
                                          r"child\.toml:\d+: release\.analysis\.(count|interval_s): Input should be "
                                          r"(less than or equal to 100|greater than or equal to 1)"),
    "analysis measured more often than a scrape takes": ("[release.analysis]\ninterval_s = 0.5\n",
                                                         r"child\.toml:\d+: release\.analysis\.interval_s: Input "
                                                         r"should be greater than or equal to 1"),
    "analysis count not above the limits": (f"[release.analysis]\ncount = {_A.failure_limit + _A.inconclusive_limit}\n",
                                            r"child\.toml:3: release\.analysis\.count: failure_limit \+ "
                                            rf"inconclusive_limit must be below count \({_A.failure_limit + _A.inconclusive_limit}\), "
                                            rf"got {_A.failure_limit} \+ {_A.inconclusive_limit}"),
    # A breaker's case: the value given was said as Python's repr (True, datetime.date(2026, 1, 1)): it is said as
    # the file spells it.
    "a boolean for a count": ("[engine.make_room]\ndecode_hold_tokens = true\n",
                              r"child\.toml:3: engine\.make_room\.decode_hold_tokens: Input should be a valid "
                              r"integer, got true$"),
    "a date for a count": ("[engine]\nmax_num_seqs = 2026-01-01\n",
                           r"child\.toml:3: engine\.max_num_seqs: Input should be a valid integer, got 2026-01-01$"),
    "a time for a string": ("[engine]\nmodel = 12:30:00\n",
                            r"child\.toml:3: engine\.model: Input should be a valid string, got 12:30:00$"),
    "a string for a count": ('[engine]\nport = "80\\"00"\n',
                             r'child\.toml:3: engine\.port: Input should be a valid integer, got "80\\"00"$'),
    "huge integer": ("[engine.flatshare_jit]\nmargin_ms = 99999999999999999999\n", r"child\.toml:3: engine\.flatshare_jit\.margin_ms: "),
}


@pytest.mark.parametrize("case", sorted(BAD_PROFILES))
def test_bad_profile_gets_one_line_naming_file_line_key_and_rule(checkout, case):
    text, expected = BAD_PROFILES[case]
    child = _child(checkout, text)
    code, out, err = _render_error(checkout, child)
    assert code == 2
    assert out == ""
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err
    assert re.search(expected, err), err


def test_missing_extends_target_names_the_line_and_the_missing_file(checkout):
    child = _write(checkout, "child.toml", 'schema = 1\nextends = "nope.toml"\n')
    code, _, err = _render_error(checkout, child)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert re.search(r"child\.toml:2: extends: profile .*nope\.toml not found", err), err


def test_cycle_of_extends_is_refused(checkout):
    _write(checkout, "a.toml", 'extends = "b.toml"\n')
    b = _write(checkout, "b.toml", 'extends = "a.toml"\n')
    code, _, err = _render_error(checkout, b)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "cycle of extends" in err and "a.toml" in err and "b.toml" in err


def test_missing_profile_file(checkout):
    code, _, err = _render_error(checkout, checkout / "profiles" / "absent.toml")
    assert code == 2
    assert re.search(r"absent\.toml: profile file not found", err), err


def test_error_in_the_parent_names_the_parent_file(checkout):
    parent = checkout / PROFILE
    parent.write_text(parent.read_text().replace("margin_ms = 30 ", "margin_ms = -30 "))
    child = _child(checkout, "")
    with pytest.raises(ProfileError, match=r"rtx-5060-ti-serve\.toml:\d+: engine\.flatshare_jit\.margin_ms"):
        load_profile(child)


def test_a_file_cut_short_is_said_to_end_early_never_to_hold_a_nul(tmp_path):
    # A breaker's case: "malformed TOML: Unexpected character: '\x00'" for a file that holds none (tomlkit's reader
    # sees "\0" past the end).
    from flatshare_ops.config.profile import read_toml
    from flatshare_ops.errors import ProfileError

    path = tmp_path / "cut.toml"
    path.write_text("schema = 1\n[nodes.cyan]\nhost = ")
    with pytest.raises(ProfileError) as raised:
        read_toml(path, kind="inventory")
    assert str(raised.value) == (f"{path}:3: malformed TOML: the file ends where a value or a key was expected "
                                 "(was it cut short?)")


@pytest.mark.parametrize("form, said", [("fifo", "is not a regular file (a FIFO (named pipe))"),
                                        ("directory", "is a directory, not a file")])
def test_a_parent_profile_that_is_no_file_is_named_as_what_it_is_not_as_missing(tmp_path, form, said):
    # A breaker's case: status and check said "extends: profile ... not found" of a FIFO or a directory.
    import os

    from flatshare_ops.errors import ProfileError

    parent = tmp_path / "base.toml"
    os.mkfifo(parent) if form == "fifo" else parent.mkdir()
    child = tmp_path / "child.toml"
    child.write_text('extends = "base.toml"\n')
    with pytest.raises(ProfileError) as raised:
        load_profile(child)
    assert str(raised.value) == f"{parent}: {said}; give a profile file"
