"""Hostile values at every edge: each is refused in one line (exit 2) or shown escaped, never obeyed.

The cases come from a breaker's findings (values through `profiles set`, a hand-made release bundle,
node files, `hold place -m`, serving-check's --node-name); each test is the kind, with the finding's
case among its parameters.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import math
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import REPO, copy_checkout, run_cli, snapshot
from flatshare_ops.common import serving_shape
from flatshare_ops.common.clock import utc_stamp
from flatshare_ops.common.files import Damaged, read_json_object
from flatshare_ops.config.profile import load_profile
from flatshare_ops.render import render_profile

PRODUCTION = REPO / "profiles/rtx-5060-ti-serve.toml"


def _files() -> dict[str, str]:
    return render_profile(load_profile(PRODUCTION)).release_files()


def _rid(files: dict[str, str]) -> str:
    # releases/README.md: a release id is the first 16 hex digits of sha256 over "name\0text\0", names sorted.
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(name.encode() + b"\0" + files[name].encode() + b"\0")
    return digest.hexdigest()[:16]


def _switch(state_dir: Path, bundle: dict | str) -> subprocess.CompletedProcess:
    """The node side's switch, as a process, fed a hand-made bundle (no systemd is reached before the
    bundle is checked)."""
    line = bundle if isinstance(bundle, str) else json.dumps(bundle)
    return subprocess.run(
        [sys.executable, "-m", "flatshare_ops.node", "switch", "--node", "cyan", "--state-dir", str(state_dir),
         "--scope", "user", "--runtime-dir", str(state_dir / "run"), "--switch-id", "s1"],
        input=line + "\n", capture_output=True, text=True, timeout=60)


def _with_serving(files: dict[str, str], change) -> dict[str, str]:
    serving = json.loads(files["serving.json"])
    change(serving)
    return {**files, "serving.json": json.dumps(serving)}


def _traversal(files: dict[str, str]) -> dict[str, str]:
    files = {**files, "profile.json": "PWNED\n"}
    return _with_serving(files, lambda s: s["units"].__setitem__(
        "../../../flatshare-pwned.txt", hashlib.sha256(b"PWNED\n").hexdigest()))


BAD_BUNDLES = {
    # name: (bundle from the production render's files, what the one line must say)
    "an id that is not its files' digest (a stored release would be replaced)":
        (lambda f: {"id": "67b2917799e23218", "files": f}, "is not the digest of its files"),
    "a NaN drain bound": (lambda f: {"files": _with_serving(f, lambda s: s["voice"].__setitem__(
        "drain_timeout_s", float("nan")))}, "not JSON (NaN is not a JSON number)"),
    "an infinite start bound": (lambda f: {"files": _with_serving(f, lambda s: s["engine"].__setitem__(
        "start_timeout_s", 1e999))}, "not JSON (Infinity is not a JSON number)"),
    "a zero stop bound": (lambda f: {"files": _with_serving(f, lambda s: s["engine"].__setitem__(
        "stop_timeout_s", 0))}, "engine.stop_timeout_s: must be a finite number of seconds above 0"),
    "a unit name that is a path": (lambda f: {"files": _traversal(f)}, "is not a unit name"),
    "a unit serving.json names but the bundle lacks":
        (lambda f: {"files": {k: v for k, v in f.items() if k != "units/flatshare-voice.service"}},
         "lacks units/flatshare-voice.service, which its serving.json names"),
}


@pytest.mark.parametrize("case", BAD_BUNDLES, ids=list(BAD_BUNDLES))
def test_a_hand_made_bundle_is_refused_before_anything_is_stored(tmp_path, case):
    make, said = BAD_BUNDLES[case]
    bundle = make(_files())
    bundle.setdefault("id", _rid(bundle["files"]))
    result = _switch(tmp_path, bundle)
    assert result.returncode == 2, result.stdout + result.stderr
    assert said in result.stdout + result.stderr and "Traceback" not in result.stdout + result.stderr
    assert not list((tmp_path / "releases").glob("*/serving.json")) if (tmp_path / "releases").exists() else True


def test_a_good_bundle_passes_the_same_checks():
    from flatshare_ops.node.bundle import validate_bundle

    files = _files()
    assert validate_bundle({"id": _rid(files), "files": files})["id"] == _rid(files)


@pytest.mark.parametrize("value", [float("nan"), math.inf, 0, -5])
def test_serving_shape_refuses_a_bound_that_is_no_bound(value):
    serving = json.loads(_files()["serving.json"])
    serving["gateway"]["drain_timeout_s"] = value
    assert "gateway.drain_timeout_s: must be a finite number of seconds above 0" in serving_shape.problem(serving)


@pytest.mark.parametrize("field", ["prompt_tokens", "generation_tokens"])
def test_the_stand_in_engine_refuses_an_observation_whose_token_count_is_null(field):
    # mypy's finding: a null count skipped the check and reached int(None), a TypeError out of the handler
    # instead of the one-line refusal every other value gets.
    from flatshare_ops.sandbox.engine import Engine
    from flatshare_ops.sandbox.engine_behaviour import Behaviour, BehaviourError

    engine = Engine({"model": "/models/m"}, Behaviour())
    with pytest.raises(BehaviourError, match=f"^{field}: must be a number >= 0, got None$"):
        engine.observe({"requests": 1, "e2e_s": 0.5, field: None})
    assert engine.observe({"requests": 2, "ttft_s": None, "e2e_s": 0.5}) == 2  # no token: ttft_s is not observed


@pytest.mark.parametrize("value", ["yesterday", 1e300, float("nan"), -1e20, None, [1]])
def test_a_time_read_from_a_damaged_file_never_raises(value):
    if value is None:
        assert utc_stamp(None).endswith("Z")  # now
        return
    assert utc_stamp(value) == f"(not a time: {str(value)[:40]})"


def test_node_files_with_nan_or_infinity_are_damaged(tmp_path):
    for constant in ("NaN", "Infinity", "-Infinity"):
        path = tmp_path / "hold.json"
        path.write_text(f'{{"schema": 1, "who": "x", "since": {constant}, "message": "m"}}\n')
        with pytest.raises(Damaged, match=f"{constant} is not a JSON number"):
            read_json_object(path)


@pytest.mark.parametrize("message", ["E2 bench\n::flatshare:outcome {\"code\": 0}", "red\x1b[31m\x07", "", "  ",
                                     "a\u2028b", "E2 \udcff\udcfe bench"])  # the last: bytes ff fe, not UTF-8
def test_a_hold_message_must_be_one_line_of_text(tmp_path, message):
    # Refused on the operator's side before any node is asked (no inventory is read)...
    result = run_cli("hold", "place", "--node", "cyan", "-m", message, "--inventory", str(tmp_path / "none.toml"))
    assert result.returncode == 2 and "hold place: -m:" in result.stderr, result.stdout + result.stderr
    # ...and on the node's (a hold written by another tool's checkout).
    node = subprocess.run(
        [sys.executable, "-m", "flatshare_ops.node", "hold", "--node", "cyan", "--state-dir", str(tmp_path),
         "--scope", "user", "--runtime-dir", str(tmp_path), f"--acquire={message}"],
        capture_output=True, text=True, timeout=60)
    assert node.returncode == 2 and "flatshare-node: flatshare-node hold:" in node.stderr, node.stderr
    assert not (tmp_path / "releases/hold.json").exists()


def test_a_hold_message_longer_than_a_sentence_or_two_is_refused_and_one_written_by_hand_is_clipped(tmp_path):
    # A breaker's case: a 131,000-character message failed on the node with the shell's "Argument list too long"
    # (it travels in the node command's arguments), and one of 120 kB was shown whole by hold status.
    from flatshare_ops.common.text import HOLD_MESSAGE_MAX
    from flatshare_ops.node.hold import describe

    result = run_cli("hold", "place", "--node", "cyan", "-m", "x" * (HOLD_MESSAGE_MAX + 1),
                     "--inventory", str(tmp_path / "none.toml"))
    assert result.returncode == 2 and f"more than {HOLD_MESSAGE_MAX}" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
    shown = describe({"who": "ops", "since": 1796531418, "message": "word " * 24000})
    assert len(shown) < HOLD_MESSAGE_MAX + 100 and shown.endswith("…"), shown[-80:]


def test_a_hold_written_by_hand_is_shown_on_one_line(tmp_path):
    from flatshare_ops.node.hold import describe

    shown = describe({"who": "ops\nSERVING-CHECK OK", "since": "yesterday", "message": "a\rb\x1b"})
    assert "\n" not in shown and "\r" not in shown and "\x1b" not in shown
    # A time that is no time is left out, never "?", and said to be unusable.
    assert shown == "ops\\nSERVING-CHECK OK: a\\rb\\x1b, though hold.json has no usable since"



@pytest.mark.parametrize("character", ["\ud800", "\x9b", "\u202e", "\u2066", "\u200f", "\x85"],
                         ids=["lone surrogate", "C1 CSI", "right-to-left override", "isolate", "RLM", "NEL"])
def test_a_value_read_from_a_file_prints_escaped_whatever_character_it_holds(character):
    # A breaker's case: "\ud800" in a history record stopped `flatshare releases` with UnicodeEncodeError (no
    # UTF-8 output can encode it); U+009B (an 8-bit terminal escape) and U+202E (which reorders what a
    # terminal shows) were printed raw. Each is shown as Python's escape for it, and the line encodes.
    from flatshare_ops.node.hold import describe

    shown = describe({"who": "ops", "since": "yesterday", "message": f"a{character}b"})
    assert character not in shown and character.encode("unicode_escape").decode() in shown
    shown.encode("utf-8")


PROFILE_VALUES = {
    # key, value, what the one line must say
    "a stop bound systemd would read as none": ("engine.stop_timeout_s", "1e-7", "greater than or equal to 0.001"),
    "PYTHONPATH, which the renderer sets": ("engine.environment.PYTHONPATH", "/evil", "PYTHONPATH is set by the renderer"),
    "a run_dir with a space": ("layout.run_dir", "/run/flat share", "must be one plain word"),
    "a run_dir of /": ("layout.run_dir", "/", "is not a normalized path"),
    "a run_dir with ..": ("layout.run_dir", "/run/..", "is not a normalized path"),
    # A breaker's cases: StateDirectory= (the engine's home on a system-scope node) split at the space, and
    # systemd ignores a path that is not normalized.
    "a state_dir with a space": ("layout.state_dir", "/var/lib/flat share", "holds whitespace"),
    "a state_dir with ..": ("layout.state_dir", "/var/lib/../tmp/fs", "is not a normalized path"),
    "a state_dir with //": ("layout.state_dir", "/var//lib/fs", "is not a normalized path"),
    # A breaker's cases: a gateway port no socket has passed every check and failed the switch's serving-check
    # step, the node drained, with Python's "Port out of range"; a host Python's idna codec refuses at connect.
    "a gateway port above 65535": ("gateway.url", "http://127.0.0.1:99999", "a port from 1 to 65535"),
    "a gateway port of 0": ("gateway.url", "http://127.0.0.1:0", "a port from 1 to 65535"),
    "a gateway host with an empty label": ("gateway.url", "http://a..b:8080", "must be http://HOST:PORT"),
    "a gateway URL with a path": ("gateway.url", "http://127.0.0.1:8080/v1", "must be http://HOST:PORT"),
    "a gateway URL with a user": ("gateway.url", "http://me@127.0.0.1:8080", "must be http://HOST:PORT"),
    "an IPv6 gateway host without brackets": ("gateway.url", "http://::1:8080", "must be http://HOST:PORT"),
    # A breaker's case: one environment entry past what exec(2) takes was refused by the node's preflight only,
    # naming no key ("Argument list too long").
    "an environment value too long to exec": ("engine.environment.BIG", "y" * 40000, "must be at most 32768 characters"),
}


@pytest.mark.parametrize("case", PROFILE_VALUES, ids=list(PROFILE_VALUES))
def test_a_profile_value_systemd_would_read_otherwise_is_refused(tmp_path, case):
    key, value, said = PROFILE_VALUES[case]
    checkout = copy_checkout(REPO, tmp_path / "checkout")
    before = snapshot(checkout)
    result = run_cli("profiles", "set", key, value, "--root", str(checkout))
    assert result.returncode == 2 and said in result.stderr, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and snapshot(checkout) == before


@pytest.mark.parametrize("name", ["rtx-5060-ti-serve", "flatshare-engine.service"])
def test_a_variant_named_like_another_output_is_refused(tmp_path, name):
    checkout = copy_checkout(REPO, tmp_path / "checkout")
    before = snapshot(checkout)
    result = run_cli("profiles", "set", "name", name, "--profile", "profiles/rtx-5060-ti-serve-vllm-0.33.toml",
                     "--root", str(checkout))
    assert result.returncode == 2 and "collides with" in result.stderr, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and snapshot(checkout) == before


def test_environment_values_keep_every_digit_the_profile_gives(tmp_path):
    from flatshare_ops.common.unit_file import meaning

    child = tmp_path / "child.toml"
    child.write_text(f'extends = "{PRODUCTION}"\n[voice]\nendpointing_min_s = 0.12345678\n'
                     "[gateway]\ndrain_timeout_s = 86399.99\n")
    units = render_profile(load_profile(child)).units
    voice, gateway = (repr(meaning(units[f"flatshare-{name}.service"])[("Service", "Environment")])
                      for name in ("voice", "gateway"))
    assert "FLATSHARE_ENDPOINTING_MIN_S=0.12345678" in voice
    assert "FLATSHARE_DRAIN_TIMEOUT_S=86399.99" in gateway


def test_a_silence_bound_no_node_could_keep_is_refused(tmp_path):
    from flatshare_ops.config.inventory import load_inventory
    from flatshare_ops.errors import FlatshareError

    inventory = tmp_path / "fleet.toml"
    inventory.write_text('schema = 1\n[transport]\nsilence_s = 0.3\n[nodes.cyan]\nhost = "127.0.0.2"\n'
                         'profile = "p.toml"\n')
    with pytest.raises(FlatshareError, match=r"silence_s.*greater than or equal to 2"):
        load_inventory(inventory)


def _zip(entries: list[tuple[zipfile.ZipInfo, bytes]]) -> dict:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for info, data in entries:
            archive.writestr(info, data)
    data = buffer.getvalue()
    return {"sha256": hashlib.sha256(data).hexdigest(), "zip_b64": base64.b64encode(data).decode()}


def _package() -> list[tuple[zipfile.ZipInfo, bytes]]:
    """The least a switcher holds (node/entry.py REQUIRED_MEMBERS), and its description (this generation)."""
    from flatshare_ops.common.protocol import GENERATION, SWITCHER_DESCRIPTION

    return [(zipfile.ZipInfo(name), b"") for name in
            ("flatshare_ops/__init__.py", "flatshare_ops/node/__init__.py", "flatshare_ops/node/cli.py")] + [
        (zipfile.ZipInfo(SWITCHER_DESCRIPTION), json.dumps({"generation": GENERATION}).encode())]


def _unknown_compression() -> dict:
    """A switcher whose cli.py is stored with compression method 99 (zipfile cannot read it)."""
    shipped = _zip(_package())
    data = bytearray(base64.b64decode(shipped["zip_b64"]))
    name = b"flatshare_ops/node/cli.py"
    for signature, offset in ((b"PK\x03\x04", 8), (b"PK\x01\x02", 10)):
        at = data.rfind(signature, 0, data.find(name, data.find(signature)) + 1)
        while data[at + (30 if signature == b"PK\x03\x04" else 46):][:len(name)] != name:
            at = data.find(signature, at + 4)
        data[at + offset:at + offset + 2] = (99).to_bytes(2, "little")
    damaged = bytes(data)
    return {"sha256": hashlib.sha256(damaged).hexdigest(), "zip_b64": base64.b64encode(damaged).decode()}


@pytest.mark.filterwarnings("ignore:Duplicate name")  # the zip holding a member twice is made here
def test_the_entry_point_refuses_a_switcher_with_a_symlink_or_bytecode_and_a_protocol_of_the_wrong_type(tmp_path):
    link = zipfile.ZipInfo("flatshare_ops/node/cli.py")
    link.external_attr = 0o120777 << 16  # a symlink entry
    # Bytecode shipped beside the source: Python's zipimport would run it before the source it was not made from.
    pyc = zipfile.ZipInfo("flatshare_ops/node/cli.pyc")
    source = zipfile.ZipInfo("flatshare_ops/node/cli.py")
    cases = {
        "symlink": ({"id": "x", "files": {}, "protocol": 1, "switcher": _zip([(link, b"/etc/passwd")])},
                    "which is not a file or a directory"),
        "bytecode": ({"id": "x", "files": {}, "protocol": 1,
                      "switcher": _zip([(source, b"print(1)\n"), (pyc, b"\x00" * 16)])}, "bytecode"),
        # A breaker's cases: each ended in a traceback, on the node or when the switcher ran.
        "twice": ({"id": "x", "files": {}, "protocol": 1, "switcher": _zip(
            [*_package(), (zipfile.ZipInfo("flatshare_ops/node/cli.py"), b"x = 1\n")])}, "twice"),
        "no cli.py": ({"id": "x", "files": {}, "protocol": 1,
                       "switcher": _zip(_package()[:2] + _package()[3:])}, "holds no 'flatshare_ops/node/cli.py'"),
        "does not compile": ({"id": "x", "files": {}, "protocol": 1, "switcher": _zip(
            [*_package(), (zipfile.ZipInfo("flatshare_ops/node/broken.py"), b"def (:\n")])}, "does not compile"),
        "nested past the compiler": ({"id": "x", "files": {}, "protocol": 1, "switcher": _zip(
            [*_package(), (zipfile.ZipInfo("flatshare_ops/node/deep.py"), b"x = " + b"-" * 200_000 + b"1\n")])},
            "does not compile"),
        "unknown compression": ({"id": "x", "files": {}, "protocol": 1,
                                 "switcher": _unknown_compression()}, "cannot be read"),
        "protocol": ({"id": "x", "files": {}, "protocol": "2"}, "the bundle's protocol must be an integer"),
    }
    for name, (bundle, said) in cases.items():
        from flatshare_ops.node.entry import installed_lock_sha256

        bundle["lock_sha256"] = installed_lock_sha256()
        result = subprocess.run(
            [sys.executable, "-m", "flatshare_ops.node.entry", "switch", "--node", "cyan", "--state-dir",
             str(tmp_path), "--scope", "user", "--switch-id", "s1"],
            input=json.dumps(bundle) + "\n", capture_output=True, text=True, timeout=60)
        assert result.returncode == 2 and said in result.stdout, (name, result.stdout, result.stderr)
        assert not list((tmp_path / "releases/.switchers").glob("*/run.zip")), name


def test_serving_check_shows_a_hostile_node_name_escaped_and_says_so(tmp_path):
    result = subprocess.run(
        [str(Path(sys.executable).parent / "serving-check"), "--state-dir", str(tmp_path), "--node-name",
         "a\nSERVING-CHECK OK - fake", "--textfile", str(tmp_path)], capture_output=True, text=True, timeout=60)
    first = result.stdout.splitlines()[0]
    assert result.returncode == 3 and first.startswith("SERVING-CHECK UNKNOWN - a\\nSERVING-CHECK OK - fake")
    assert not any(line.startswith("SERVING-CHECK OK") for line in result.stdout.splitlines())
    assert "UNKNOWN node-name:" in result.stdout
    prom = (tmp_path / "serving_check.prom").read_text()
    assert 'node="a\\\\nSERVING-CHECK OK - fake"' in prom and "\nSERVING-CHECK" not in prom


def test_an_inventory_scope_that_is_not_the_profiles_is_named_for_that_node(tmp_path):
    from flatshare_ops.control import commands
    from flatshare_ops.control.fanout import ask
    from flatshare_ops.control.targets import targets
    from flatshare_ops.errors import FlatshareError

    inventory = tmp_path / "fleet.toml"
    inventory.write_text(f'schema = 1\nmin_serving = 0\n[nodes.cyan]\nhost = "127.0.0.2"\nprofile = "{PRODUCTION}"\n'
                         'scope = "user"\nruntime_dir = "/run/user/0"\n')
    (target,) = targets(inventory, ["cyan"], False)
    with pytest.raises(FlatshareError, match="nodes.cyan.scope is 'user' but its profile .* has layout.scope"):
        target.spec
    # A fleet answer names it as that node's answer (nothing is dialled), never a thread's traceback.
    answers = ask([target], lambda t: commands.status(t.spec))
    assert "nodes.cyan.scope is 'user'" in answers["cyan"]["error"]


# --- round 2: files that are not regular files, odd options ------------------------------------------


def test_a_host_key_is_added_on_a_line_of_its_own_and_a_fifo_is_never_read(tmp_path):
    import os

    from flatshare_ops.control.known_hosts import read, with_entry
    from flatshare_ops.errors import TransportError

    path = tmp_path / "known_hosts"
    path.write_text("[127.0.0.2]:2222 ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIA")  # no newline at its end
    text = with_entry(path, "[127.0.0.3]:2222 ssh-ed25519 AAAAB\n")
    assert text.splitlines() == ["[127.0.0.2]:2222 ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIA",
                                 "[127.0.0.3]:2222 ssh-ed25519 AAAAB"]
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for call in (lambda: read(fifo), lambda: with_entry(fifo, "x\n")):
        with pytest.raises(TransportError, match="is not a regular file"):
            call()


def _fleet_file(tmp_path: Path, cyan_scope: str = "user") -> Path:
    inventory = tmp_path / "fleet.toml"
    inventory.write_text(
        f'schema = 1\n[transport]\nconnect_timeout_s = 2\n'
        f'[nodes.cyan]\nhost = "127.76.0.2"\nport = 2299\nprofile = "{PRODUCTION}"\nscope = "{cyan_scope}"\n'
        + ('runtime_dir = "/run/user/0"\n' if cyan_scope == "user" else "")
        + f'[nodes.peacock]\nhost = "127.76.0.3"\nport = 2299\nprofile = "{PRODUCTION}"\n')
    return inventory


def test_doctor_names_a_scope_mismatch_for_its_node_and_goes_on_to_the_next(tmp_path):
    result = run_cli("doctor", "--inventory", str(_fleet_file(tmp_path)), "--root", str(REPO))
    assert result.returncode == 1 and "Traceback" not in result.stdout + result.stderr
    assert re.search(r"FAIL +cyan reach: .*nodes\.cyan\.scope is 'user' but its profile", result.stdout), result.stdout
    assert re.search(r"FAIL +peacock reach: ", result.stdout), result.stdout  # checked all the same


def test_files_that_are_not_regular_are_refused_not_waited_on(tmp_path):
    import os

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    inventory = run_cli("status", "--inventory", str(fifo))
    assert inventory.returncode == 2 and "is not a regular file" in inventory.stderr, inventory.stderr
    checkout = copy_checkout(REPO, tmp_path / "checkout")
    empty = tmp_path / "empty.so"
    empty.write_bytes(b"")
    for module, said in ((fifo, "is not a regular file"), (empty, "empty")):
        before = snapshot(checkout)
        pinned = run_cli("profiles", "pin-module", "--file", str(module), "--root", str(checkout))
        assert pinned.returncode == 2 and said in pinned.stderr, pinned.stderr
        assert snapshot(checkout) == before


@pytest.mark.parametrize("options, said", [
    (["--deadline", "inf"], "argument --deadline"), (["--deadline", "nan"], "argument --deadline"),
    (["--deadline", "0"], "argument --deadline"), (["--textfile", ""], "argument --textfile")])
def test_serving_check_refuses_options_that_mean_nothing(tmp_path, options, said):
    result = subprocess.run([str(Path(sys.executable).parent / "serving-check"), "--state-dir", str(tmp_path),
                             *options], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert result.returncode == 3 and result.stdout.startswith("SERVING-CHECK UNKNOWN") and said in result.stdout
    assert not (tmp_path / "serving_check.prom").exists()


def test_sandbox_commands_on_a_path_that_is_no_sandbox_say_so(tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    for args in (["down", "--dir", str(a_file)], ["reboot", "--node", "cyan", "--dir", str(a_file)],
                 ["reboot", "--node", "cyan", "--dir", str(tmp_path / "none")]):
        result = run_cli("sandbox", *args)
        assert result.returncode == 2 and "not a sandbox directory" in result.stderr, (args, result.stderr)
        assert "Traceback" not in result.stderr
    assert not (tmp_path / "none").exists()


def test_a_user_name_with_a_control_character_is_named_as_such(tmp_path):
    result = run_cli("hold", "place", "--node", "cyan", "-m", "E2", "--inventory", str(tmp_path / "none.toml"),
                     env={"LOGNAME": "evil\nuser", "USER": "evil\nuser"})
    assert result.returncode == 2 and "your user@host evil\\nuser@" in result.stderr, result.stderr


@pytest.mark.parametrize("value", ["sha256:" + "A" * 43, "SHA256:" + "A" * 43 + "=", "A" * 43, "SHA256:a\nb"])
def test_a_mistyped_fingerprint_is_named_as_mistyped(tmp_path, value):
    result = run_cli("node", "bootstrap", "--node", "cyan", "--accept-host-key", value,
                     "--inventory", str(_fleet_file(tmp_path)))
    assert result.returncode == 2 and "is not a fingerprint as 'ssh-keygen -lf KEY.pub' prints it" in result.stderr
    assert "\n" not in result.stderr.strip()


@pytest.mark.parametrize("document", ['{"measurements": [{"canary": "x"}]}',
                                      '{"measurements": [{"canary": {"start_s": "abc"}}]}',
                                      '{"measurements": [{"canary": {"start_s": -1e300}}]}',
                                      '{"measurements": [{"canary": {"start_s": true}}]}',
                                      '{"measurements": "all"}', '{"summary": {"a": 1}}', '[1]'])
def test_a_hostile_analysis_document_is_refused_by_the_node_in_one_line_and_nothing_is_written(tmp_path, document):
    # What the operator's side sends `flatshare-node record-analysis` (a breaker's cases): never a traceback,
    # and the node's history is not touched.
    state = tmp_path / "state"
    (state / "releases").mkdir(parents=True)
    result = subprocess.run(
        [sys.executable, "-m", "flatshare_ops.node", "record-analysis", "--node", "cyan", "--state-dir", str(state),
         "--scope", "user", "--runtime-dir", str(tmp_path), "--switch", "hostile1"],
        input=document + "\n", capture_output=True, text=True, timeout=60)
    said = result.stderr.strip()  # for a person: one line
    assert result.returncode == 2 and "Traceback" not in said + result.stdout, said + result.stdout
    assert said.count("\n") == 0 and "stdin is not an analysis document" in said, said
    (answer,) = result.stdout.strip().splitlines()  # for the operator's side: the same, as fields
    assert json.loads(answer.removeprefix("::flatshare:error ")) == {
        "code": 2, "message": said.removeprefix("flatshare-node: ")}, answer
    assert not (state / "releases/history.jsonl").exists()


@pytest.mark.parametrize("answer,said", [(b"HTTP/1.0 200 OK\r\n\r\n" + b"x" * (9 << 20), "answered more than 8 MiB"),
                                         (b"SSH-2.0-OpenSSH_9.2\r\n", "answered something that is not HTTP")])
def test_an_oversized_or_foreign_answer_is_named_as_such_never_as_a_timeout(answer, said):
    # A breaker's case: a /metrics of 9 MiB, answered in 60 ms, was reported "did not answer within 5 s".
    import socket
    import threading

    from flatshare_ops.common.http import http_fetch

    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def serve():
        conn, _ = server.accept()
        with conn:
            conn.recv(65536)
            try:
                conn.sendall(answer)
            except OSError:
                pass  # the reader stopped at its bound

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        status, body, why = http_fetch(f"http://127.0.0.1:{port}/metrics", 5.0)
    finally:
        thread.join(10)
        server.close()
    assert (status, body, why) == (0, b"", said)


def test_one_node_listed_twice_in_the_inventory_is_refused_at_load(tmp_path):
    # A breaker's case: the same host and port under two names counted as two nodes taking calls.
    from flatshare_ops.config.inventory import load_inventory
    from flatshare_ops.errors import ProfileError

    path = tmp_path / "fleet.toml"
    path.write_text(f'schema = 1\nmin_serving = 2\n[nodes.cyan]\nhost = "127.0.0.2"\nprofile = "{PRODUCTION}"\n'
                    f'[nodes.peacock]\nhost = "127.0.0.3"\nport = 2222\nprofile = "{PRODUCTION}"\n'
                    f'[nodes.ghost]\nhost = "127.0.0.3"\nport = 2222\nprofile = "{PRODUCTION}"\n')
    with pytest.raises(ProfileError) as raised:
        load_inventory(path)
    assert str(raised.value) == (f"{path}: nodes: ghost and peacock are both 127.0.0.3 port 2222: list each node once "
                                 "(the admission to drain counts every entry as a node of its own)")


@pytest.mark.parametrize("key,value,said", [
    ("min_serving", '"0%"', "min_serving: must be a count or a share from \"1%\" to \"100%\" (a whole number and %), got \"0%\""),
    ("min_serving", "true", "min_serving: must be a count (0 or more) or a share from \"1%\" to \"100%\", got true"),
    ("min_serving", "1.5", "min_serving: must be a count (0 or more) or a share from \"1%\" to \"100%\", got 1.5"),
    ("min_serving", "-1", "min_serving: must be a count of 0 or more, or a share such as \"50%\", got -1"),
    ("rollout.batch", '"150%"', "rollout.batch: must be a count or a share from \"1%\" to \"100%\" (a whole number and "
                                "%), got \"150%\""),
    ("rollout.batch", "0", "rollout.batch: must be a count from 1 to 1000, or a share such as \"50%\", got 0"),
    ("min_serving", "2026-01-01", "min_serving: must be a count (0 or more) or a share from \"1%\" to \"100%\", "
                                  "got 2026-01-01"),
    ("rollout.batch", '" 50%"', "rollout.batch: must be a count or a share from \"1%\" to \"100%\" (a whole number "
                                "and %), got \" 50%\""),
])
def test_a_count_or_share_in_the_inventory_is_refused_in_its_own_words_at_its_line(tmp_path, key, value, said):
    # A breaker's cases: pydantic's union errors named a key no file has (min_serving.constrained-int) and said
    # "integer" of a field that takes a share.
    from flatshare_ops.config.inventory import load_inventory
    from flatshare_ops.errors import ProfileError

    table, _, name = key.rpartition(".")
    nodes = "".join(f'[nodes.{n}]\nhost = "127.0.0.{i}"\nprofile = "{PRODUCTION}"\n' for i, n in ((2, "a"), (3, "b")))
    text = f"schema = 1\n{name} = {value}\n{nodes}" if not table else f"schema = 1\n{nodes}[{table}]\n{name} = {value}\n"
    path = tmp_path / "fleet.toml"
    path.write_text(text)
    line = next(i for i, row in enumerate(text.splitlines(), 1) if row.startswith(f"{name} ="))
    with pytest.raises(ProfileError) as raised:
        load_inventory(path)
    assert str(raised.value) == f"{path}:{line}: {said}"


@pytest.mark.parametrize("host", ["a..b", ".", "x" * 64 + ".example", "-x", "bad_host"])
def test_an_inventory_host_no_connection_could_use_is_refused_at_its_line(tmp_path, host):
    # A breaker's case: "a..b" (an empty label) and a 64-character label passed the inventory and stopped every
    # command with UnicodeError's traceback, raised by Python's idna codec at connect time.
    from flatshare_ops.config.inventory import load_inventory
    from flatshare_ops.errors import ProfileError

    path = tmp_path / "fleet.toml"
    text = f'schema = 1\nmin_serving = 0\n[nodes.cyan]\nhost = "{host}"\nprofile = "{PRODUCTION}"\n'
    path.write_text(text)
    with pytest.raises(ProfileError) as raised:
        load_inventory(path)
    assert str(raised.value).startswith(f"{path}:4: nodes.cyan.host: must be an IP address or a host name"), raised.value


@pytest.mark.parametrize("host", ["127.0.0.2", "::1", "gpu-2.example.org", "gpu-2.example.org.", "localhost"])
def test_an_inventory_host_that_is_an_address_or_a_name_loads(tmp_path, host):
    from flatshare_ops.config.inventory import load_inventory

    path = tmp_path / "fleet.toml"
    path.write_text(f'schema = 1\nmin_serving = 0\n[nodes.cyan]\nhost = "{host}"\nprofile = "{PRODUCTION}"\n')
    assert load_inventory(path).nodes["cyan"].host == host


def test_a_connection_to_a_name_pythons_idna_codec_refuses_is_a_transport_error_not_a_traceback():
    # The same name reached through an SSH config's HostName, which the inventory's check never sees.
    from flatshare_ops.control.ssh import SSHTarget, open_socket
    from flatshare_ops.errors import TransportError

    target = SSHTarget(node="cyan", host="a..b", port=22, user="root", known_hosts=Path("/nonexistent"),
                       connect_timeout_s=1.0)
    with pytest.raises(TransportError) as raised:
        open_socket(target)
    assert str(raised.value).startswith("cyan: the name a..b does not resolve (not a host name"), raised.value


def test_a_node_table_named_against_the_rule_is_named_at_its_line_in_plain_words(tmp_path):
    # A breaker's case: "nodes.Peacock.[key]: String should match pattern '^[a-z][a-z0-9-]*$'" (no line, a key no
    # file has, a regular expression for a rule).
    from flatshare_ops.config.inventory import load_inventory
    from flatshare_ops.errors import ProfileError

    path = tmp_path / "fleet.toml"
    path.write_text(f'schema = 1\nmin_serving = 0\n[nodes.Peacock]\nhost = "127.0.0.3"\nprofile = "{PRODUCTION}"\n')
    with pytest.raises(ProfileError) as raised:
        load_inventory(path)
    assert str(raised.value) == (f'{path}:3: nodes.Peacock: node name "Peacock" must be lowercase letters, digits '
                                 "and '-', starting with a letter (as cyan or gpu-2); rename the table")


@pytest.mark.parametrize("key,value", [("command_timeout_s", "1e-300"), ("connect_timeout_s", "0.01"),
                                       ("reconnect_s", "0.001")])
def test_a_transport_bound_no_exchange_could_keep_is_refused_at_its_line(tmp_path, key, value):
    # A breaker's case: command_timeout_s = 1e-300 loaded, and every node was then "UNKNOWN: did not finish within
    # 1e-300 s" (exit 6, unreachable) instead of the inventory's error (exit 2).
    from flatshare_ops.config.inventory import load_inventory
    from flatshare_ops.errors import ProfileError

    path = tmp_path / "fleet.toml"
    path.write_text(f'schema = 1\nmin_serving = 0\n[nodes.cyan]\nhost = "127.0.0.2"\nprofile = "{PRODUCTION}"\n'
                    f"[transport]\n{key} = {value}\n")
    with pytest.raises(ProfileError) as raised:
        load_inventory(path)
    assert str(raised.value).startswith(f"{path}:7: transport.{key}: Input should be greater than or equal to"), \
        raised.value


@pytest.mark.parametrize("name", ["cy\x1b[31man", "cyan\nSERVING-CHECK OK"])
def test_an_unknown_node_name_is_echoed_escaped_on_one_line(tmp_path, name):
    # A breaker's case: --node's value went into "no node ..." raw, a terminal escape or a newline included.
    path = tmp_path / "fleet.toml"
    path.write_text(f'schema = 1\nmin_serving = 0\n[nodes.cyan]\nhost = "127.0.0.2"\nprofile = "{PRODUCTION}"\n')
    result = run_cli("status", "--node", name, "--inventory", str(path))
    assert result.returncode == 2, result.stdout + result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "\x1b[" not in result.stderr, repr(result.stderr)
    assert name.encode("unicode_escape").decode() in result.stderr, repr(result.stderr)
