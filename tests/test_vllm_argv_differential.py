"""vllm_argv.read_argv against vLLM's own `vllm serve` parser, line by line.

Every command line of CORPUS (the production render and hostile variations)
is parsed by vLLM itself, in ONE process per vLLM release, with
flatshare_ops/common/vllm_serve_parse.py's `parse-many` mode, run by the
interpreter of the parser venv that scripts/vllm-venvs.sh builds:
.venv-vllm (vLLM 0.32.0; missing is a failure unless
FLATSHARE_SKIP_VLLM_PARSER=1) and .venv-vllm-0.33 (vLLM 0.33.0; skipped when
missing). For each line, vllm_argv.read_argv must take the same decision
(accept / reject); for a rejected line give vLLM's message; for an accepted
line give, for every flag given, the value vLLM's namespace holds, with its
type, and miss no flag that vLLM set.

The committed option tables (flatshare_ops/common/vllm_options/RELEASE.json)
must equal what `vllm_serve_parse.py options` prints from each venv. The
parser vllm_argv builds from them is argparse's; the lines that exercise
argparse's own rules (prefixes, `=`, nargs, `--`, negative numbers; `--a` to
`--z` and `-a` to `-z` list every ambiguous candidate in vLLM's registration
order) hold it to vLLM's.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from conftest import vllm_parse_many
from flatshare_ops.common import vllm_argv

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "flatshare_ops/common/vllm_serve_parse.py"
VENVS = {"0.32.0": REPO / ".venv-vllm", "0.33.0": REPO / ".venv-vllm-0.33"}
ENV = {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"}


def production_words() -> list[str]:
    """The production render's words after `vllm serve`.

    From the renderer when it imports, else from the rendered
    profiles/rtx-5060-ti-serve.serving.json (which `make profiles` keeps equal
    to the render).
    """
    try:
        from flatshare_ops.config.profile import load_profile
        from flatshare_ops.render import render_profile

        argv = render_profile(load_profile(REPO / "profiles/rtx-5060-ti-serve.toml")).argv
    except ImportError:
        serving = json.loads((REPO / "profiles/rtx-5060-ti-serve.serving.json").read_text())
        argv = serving["engine"]["argv"]
    assert argv[1] == "serve", argv
    return argv[2:]


P = production_words()
M = P[0]


def _dotted_as_json(words: list[str]) -> dict:
    """The render's ``--additional-config.A.B VALUE`` words as the one JSON document they spell, every level's
    keys in reverse order (a JSON value stays one; a path stays a string): production's --additional-config,
    whatever values the checkout's profile holds."""
    document: dict = {}
    for flag, value in zip(words, words[1:]):
        if flag.startswith("--additional-config."):
            *path, leaf = flag.removeprefix("--additional-config.").split(".")
            node = document
            for key in path:
                node = node.setdefault(key, {})
            try:
                node[leaf] = json.loads(value)
            except ValueError:
                node[leaf] = value

    def reversed_keys(value):
        return {k: reversed_keys(v) for k, v in reversed(value.items())} if isinstance(value, dict) else value

    return reversed_keys(document)


ADDITIONAL = _dotted_as_json(P)  # the production --additional-config, as JSON (keys reordered)
assert set(ADDITIONAL) == {"flatshare_jit", "make_room"}, ADDITIONAL


def _without_dotted(words: list[str]) -> list[str]:
    out, i = [], 0
    while i < len(words):
        if words[i].startswith("--additional-config."):
            i += 2
        else:
            out.append(words[i])
            i += 1
    return out


def _eq_forms(words: list[str]) -> list[str]:
    """--flag value -> --flag=value wherever the next word is a value."""
    out, i = [words[0]], 1
    while i < len(words):
        if words[i].startswith("--") and i + 1 < len(words) and not words[i + 1].startswith("--"):
            out.append(f"{words[i]}={words[i + 1]}")
            i += 2
        else:
            out.append(words[i])
            i += 1
    return out


def _underscores(words: list[str]) -> list[str]:
    """--max-num-seqs -> --max_num_seqs (the name only: not after '=' or the first '.')."""
    out = []
    for w in words:
        if w.startswith("--"):
            name, sep, rest = w[2:].partition("=")
            head, dot, tail = name.partition(".")
            w = "--" + head.replace("-", "_") + dot + tail + sep + rest
        out.append(w)
    return out


def _reversed_pairs(words: list[str]) -> list[str]:
    groups, i = [], 1
    while i < len(words):
        if i + 1 < len(words) and not words[i + 1].startswith("--"):
            groups.append(words[i:i + 2])
            i += 2
        else:
            groups.append(words[i:i + 1])
            i += 1
    return [words[0]] + [w for g in reversed(groups) for w in g]


BASE = _without_dotted(P)
SPEC = '{"method": "eagle3", "model": "/m/draft", "num_speculative_tokens": 2}'
SPEC_REORDERED = '{ "num_speculative_tokens":2,"model":"/m/draft" , "method":"eagle3"}'

# (id, words after `vllm serve`). The first line is the bare model: the test
# uses its namespace as vLLM's defaults.
CORPUS: list[tuple[str, list[str]]] = [
    ("bare-model", ["/m"]),
    ("production", P),
    ("production-eq-forms", _eq_forms(P)),
    ("production-underscores", _underscores(P)),
    ("production-reordered", _reversed_pairs(P)),
    ("production-json-form", BASE + ["--additional-config", json.dumps(ADDITIONAL)]),
    ("production-json-compact", BASE + ["--additional-config", json.dumps(ADDITIONAL, separators=(",", ":"))]),
    ("json-then-dotted", BASE + ["--additional-config", '{"make_room": {"decode_hold_tokens": 0, "x": 1}}',
                                 "--additional-config.make_room.decode_hold_tokens", "48"]),
    ("dotted-then-json", [M, "--additional-config.make_room.decode_hold_tokens", "48",
                          "--additional-config", '{"make_room": {"decode_hold_tokens": 0}}']),
    ("json-eq-then-dotted", [M, '--additional-config={"a": 1}', "--additional-config.b", "2"]),
    ("json-only", [M, "--additional-config", '{"make_room": {"decode_hold_tokens": 48}}']),
    ("json-not-an-object", [M, "--additional-config", "foo"]),
    ("json-broken", [M, "--additional-config", "{not json}"]),
    ("json-None", [M, "--additional-config", "None"]),
    ("repeated-flag", P + ["--max-num-seqs", "16"]),
    ("repeated-eq-forms", [M, "--port=8000", "--port", "8001"]),
    ("repeated-abbreviated", [M, "--port", "8000", "--por", "8002"]),
    ("repeated-dotted-key", [M, "--additional-config.make_room.decode_hold_tokens", "0",
                             "--additional-config.make_room.decode_hold_tokens", "48"]),
    ("dotted-two-spellings", [M, "--additional_config.make_room.decode_hold_tokens", "0",
                              "--additional-config.make_room.decode_hold_tokens", "48"]),
    ("dotted-abbreviated-prefix", [M, "--additional.make_room.x", "1"]),
    ("dotted-two-prefixes", [M, "--additional-config.a", "1", "--additional.b", "2"]),
    ("dotted-eq", [M, "--additional-config.make_room.decode_hold_tokens=48"]),
    ("dotted-eq-json-value", [M, '--additional-config.a={"b": [1, 2]}']),
    ("dotted-quoted-48", [M, "--additional-config.make_room.decode_hold_tokens", '"48"']),
    ("dotted-1-vs-true", [M, "--additional-config.make_room.take_reservations", "1"]),
    ("dotted-True", [M, "--additional-config.make_room.take_reservations", "True"]),
    ("dotted-float", [M, "--additional-config.make_room.retain_s", "30.0"]),
    ("dotted-human-readable", [M, "--additional-config.make_room.retain_tokens", "3.5k"]),
    ("dotted-human-binary-decimal", [M, "--additional-config.make_room.retain_tokens", "1.5K"]),
    ("dotted-unquoted-path", [M, "--additional-config.flatshare_jit.step_time_model", "/var/x.json"]),
    ("dotted-list-append", [M, "--additional-config.jit.tags+", "a,b", "--additional-config.jit.tags+=c"]),
    ("dotted-value-looks-like-flag", [M, "--additional-config.a", "--port", "8000"]),
    ("dotted-missing-value", [M, "--port", "8000", "--additional-config.make_room.x"]),
    ("human-readable-ints", [M, "--max-model-len", "16k", "--max-num-batched-tokens", "4K"]),
    ("human-readable-decimal", [M, "--max-model-len", "25.6k"]),
    ("human-readable-binary-decimal", [M, "--max-num-batched-tokens", "1.5K"]),
    ("max-model-len-auto", [M, "--max-model-len", "auto"]),
    ("negative-int-value", [M, "--max-model-len", "-1"]),
    ("negative-decimal-is-dotted", [M, "--gpu-memory-utilization", "-0.5", "--port", "8000"]),
    ("int-underscores-spaces", [M, "--max-num-seqs", "1_000", "--port", " 8001 "]),
    ("float-exponent", [M, "--gpu-memory-utilization", "9e-1"]),
    ("bad-int", [M, "--max-num-seqs", "many"]),
    ("bad-float", [M, "--gpu-memory-utilization", "high"]),
    ("empty-int", [M, "--port", ""]),
    ("bad-choice", [M, "--kv-offloading-backend", "disk"]),
    ("kv-cache-dtype-unknown", [M, "--kv-cache-dtype", "fp9"]),
    ("no-booleans", [M, "--no-enable-prefix-caching", "--no-async-scheduling", "--no-enforce-eager"]),
    ("boolean-twice", [M, "--enable-prefix-caching", "--no-enable-prefix-caching"]),
    ("boolean-explicit-value", [M, "--enforce-eager=1"]),
    ("boolean-explicit-empty", [M, "--enable-prefix-caching="]),
    ("enable-disable-spelling", [M, "--disable-prefix-caching"]),
    ("abbreviations", [M, "--max-num-se", "32", "--gpu-mem", "0.8", "--kv-offloading-s", "24", "--enable-prefix"]),
    ("ambiguous-abbreviation", [M, "--max-num", "3"]),
    ("ambiguous-config", [M, "--conf", "x.yaml"]),
    ("ambiguous-short", [M, "-d", "2"]),
    ("short-options", [M, "-tp", "2", "-q", "fp8", "-dp=1"]),
    ("short-option-attached", [M, "-qfp8"]),
    ("short-option-unknown", [M, "-tp2"]),
    ("unknown-flag", [M, "--kv-offload-size", "24"]),
    ("unknown-flag-eq", [M, "--kv-offload-size=24"]),
    ("unknown-task-hint", [M, "--task", "embed"]),
    ("missing-value-at-end", [M, "--port"]),
    ("missing-value-before-flag", [M, "--served-model-name", "--port", "8000"]),
    ("missing-value-before-flag-2", [M, "--max-num-seqs", "--port", "8000"]),
    ("served-model-names", [M, "--served-model-name", "a", "b", "c"]),
    ("served-model-name-None", [M, "--served-model-name", "None"]),
    ("served-model-name-empty", [M, "--served-model-name", ""]),
    ("served-model-name-eq", [M, "--served-model-name=a=b"]),
    ("served-model-name-with-space", [M, "--served-model-name", "--x y"]),
    ("value-with-dot-eq", [M, "--scheduler-cls=flatshare_make_room_serve.AsyncScheduler"]),
    ("speculative-json", [M, "--speculative-config", SPEC]),
    ("speculative-json-reordered", [M, "--speculative-config", SPEC_REORDERED]),
    ("speculative-short", [M, "-sc", SPEC]),
    ("speculative-dotted", [M, "--speculative-config.method", "eagle3", "--speculative-config.model",
                            "/m/draft", "--speculative-config.num_speculative_tokens", "2"]),
    ("speculative-json-and-dotted", [M, "--speculative-config", SPEC,
                                     "--speculative-config.num_speculative_tokens", "3"]),
    ("speculative-None", [M, "--speculative-config", "None"]),
    ("speculative-broken", [M, "--speculative-config", "{method: eagle3}"]),
    ("generation-config-override", [M, "--override-generation-config", '{"repetition_penalty":1.5,"top_k":20}']),
    ("generation-config-override-reordered", [M, "--override-generation-config", '{ "top_k": 20, "repetition_penalty": 1.5 }']),
    ("generation-config-override-broken", [M, "--override-generation-config", "{top_k: 20}"]),
    ("optimization-O3", [M, "-O3"]),
    ("optimization-O-space", [M, "-O", "3"]),
    ("optimization-O-eq", [M, "-O=1"]),
    ("optimization-O-alone", [M, "-O"]),
    ("model-option", ["--model", M, "--port", "8000"]),
    ("model-option-eq", ["--port", "8000", f"--model={M}"]),
    ("model-twice", [M, "--model", "/other"]),
    ("model-option-missing", ["--port", "8000", "--model"]),
    ("no-model-served-name", ["--served-model-name", "x"]),
    ("double-dash", ["--", M]),
    ("extra-positional", [M, "/other"]),
    ("help", [M, "--help"]),
    ("config-eq", [M, "--config=x.yaml"]),
    ("hf-overrides", [M, "--hf-overrides", '{"x": 1}', "--hf-overrides.y", "2"]),
    ("hf-overrides-string", [M, "--hf-overrides", "some-string"]),
    ("compilation-config-json", [M, "--compilation-config", '{"mode": 3}']),
    ("compilation-config-dotted", [M, "-cc.mode", "3", "-cc.cudagraph_capture_sizes", "[1, 2]"]),
    ("device-ids", [M, "--device-ids", "0, 1,GPU-x"]),
    ("moe-backend-normalised", [M, "--moe-backend", "Triton-Unfused"]),
    ("lora-modules", [M, "--enable-lora", "--lora-modules", "a=/p", '{"name": "b", "path": "/q"}']),
    ("middleware-append", [M, "--middleware", "a", "--middleware=b"]),
    ("reasoning-parser-none", [M, "--reasoning-parser", "None"]),
    ("optional-none-values", [M, "--quantization", "None", "--host", ""]),
    ("production-with-interpreter-words", P + ["--enforce-eager"]),
    ("optional-value-flag-bare", [M, "--hf-token"]),
    ("optional-value-flag-given", [M, "--hf-token", "hf_x"]),
    ("int-choices-bad", [M, "--max-lora-rank", "7"]),
    ("help-search", [M, "--help=max-model-len"]),
    ("lora-broken-json", [M, "--lora-modules", "{broken"]),
    ("nargs-plus-empty-explicit", [M, "--served-model-name="]),
    ("int-empty-explicit", [M, "--max-num-seqs="]),
    ("int-fullwidth-digits", [M, "--port", "\uff18\uff10\uff10\uff11"]),
    ("dotted-int-underscores", [M, "--additional-config.make_room.retain_tokens", "1_000"]),
    ("repeated-across-spellings", [M, "--kv-offloading-size", "24", "--kv_offloading_size=25"]),
    ("optimization-repeated", [M, "-O3", "--optimization-level", "1"]),
    ("boolean-abbreviated-no", [M, "--no-enable-prefix", "--enforce"]),
    # Where a parser built from the table could differ from vLLM's (argparse's own rules).
    ("prefix-unique", [M, "--max-model", "4096", "--gpu-memory", "0.5"]),
    ("prefix-eq", [M, "--po=8001"]),
    ("prefix-of-no-boolean", [M, "--no-enable-prefix-c"]),
    ("prefix-no-ambiguous", [M, "--no-"]),
    ("prefix-enable-disable", [M, "--disable-"]),
    ("prefix-help-in-serve", [M, "--he"]),
    ("top-level-version", [M, "-v"]),
    ("top-level-version-long", [M, "--version"]),
    ("top-level-version-prefix", [M, "--vers"]),
    ("top-level-ambiguous", [M, "--=x"]),
    ("single-dash-word", [M, "-"]),
    ("triple-dash", [M, "---port", "1"]),
    ("eq-doubled", [M, "--port==8000"]),
    ("eq-empty-json", [M, "--additional-config="]),
    ("eq-short", [M, "-tp=2", "-q=fp8"]),
    ("eq-choice", [M, "--kv-cache-dtype=fp8"]),
    ("eq-nargs-plus", [M, "--served-model-name=a", "b"]),
    ("nargs-plus-then-flag", [M, "--served-model-name", "a", "b", "--port", "1"]),
    ("nargs-plus-bare", [M, "--lora-modules"]),
    ("nargs-optional-before-flag", [M, "--hf-token", "--port", "8000"]),
    ("nargs-optional-at-end", [M, "--port", "8000", "--hf-token"]),
    ("append-bare", [M, "--middleware"]),
    ("value-looks-like-option", [M, "--served-model-name", "-x"]),
    ("value-looks-like-long-option", [M, "--response-role", "--port"]),
    ("value-dash", [M, "--response-role", "-"]),
    ("value-with-space-and-dash", [M, "--host", "-bad host"]),
    ("value-negative-for-name", [M, "--served-model-name", "-1"]),
    ("end-of-options-after-model", [M, "--", "--port", "8000"]),
    ("end-of-options-as-value", [M, "--port", "--", "8000"]),
    ("end-of-options-first", ["--", M, "--port", "8000"]),
    ("end-of-options-in-nargs", [M, "--served-model-name", "a", "--", "b"]),
    ("end-of-options-before-nargs-value", [M, "--served-model-name", "--", "a"]),
    ("end-of-options-alone", [M, "--"]),
    ("end-of-options-twice", [M, "--", "--"]),
    ("negative-port", [M, "--port", "-1"]),
    ("negative-seed", [M, "--seed", "-5"]),
    ("negative-human-readable", [M, "--max-model-len", "-1k"]),
    ("negative-exponent", [M, "--kv-offloading-size", "-1e3"]),
    ("negative-positional", [M, "-5"]),
    ("negative-model", ["-5", "--port", "8000"]),
    ("negative-float-for-int", [M, "--max-num-seqs", "-.5"]),
    *[(f"prefix--{c}", [M, f"--{c}"]) for c in "abcdefghijklmnopqrstuvwxyz"],
    *[(f"prefix-{c}", [M, f"-{c}"]) for c in "abcdefghijklmnopqrstuvwxyz"],
]


def _full_argv(i: int, words: list[str]) -> list[str]:
    """Alternate the shapes /proc/PID/cmdline shows."""
    if i % 3 == 0:
        return ["/opt/flatshare/engine-venv/bin/python3", "/opt/flatshare/engine-venv/bin/vllm", "serve", *words]
    if i % 3 == 1:
        return ["/opt/flatshare/engine-venv/bin/vllm", "serve", *words]
    return ["vllm", "serve", *words]


def _venv_python(release: str) -> Path:
    python = VENVS[release] / "bin/python"
    if not python.exists():
        if release != "0.32.0":
            pytest.skip(f"{VENVS[release]} not built (scripts/vllm-venvs.sh builds it)")
        if os.environ.get("FLATSHARE_SKIP_VLLM_PARSER") == "1":
            pytest.skip("FLATSHARE_SKIP_VLLM_PARSER=1")
        pytest.fail(f"{python} missing: run scripts/vllm-venvs.sh (make test does)")
    return python


_RESULTS: dict[str, list[dict]] = {}


def vllm_results(release: str) -> list[dict]:
    """vLLM's result for every CORPUS line: one parse-many process per release."""
    if release not in _RESULTS:
        python = _venv_python(release)
        # vllm_serve_parse.py's parse-many, in the parser kept for this test process (tests/conftest.py).
        _RESULTS[release] = vllm_parse_many(python, [w for _, w in CORPUS])
        assert len(_RESULTS[release]) == len(CORPUS)
    return _RESULTS[release]


def test_the_corpus_is_large_and_unique():
    assert len(CORPUS) >= 60
    assert len({name for name, _ in CORPUS}) == len(CORPUS)


def _same(a, b) -> bool:
    """Equal by meaning, independently of the module under test: JSON with sorted keys keeps types apart
    (1 vs 1.0 vs true vs "1") and ignores dict key order."""
    return json.dumps(a, sort_keys=True, default=repr) == json.dumps(b, sort_keys=True, default=repr)


def _subset(mine, fields) -> bool:
    """Every key given (vllm_argv's dict) has the value pydantic validated."""
    if isinstance(mine, list):
        return isinstance(fields, list) and len(mine) == len(fields) and all(
            _subset(m, f) for m, f in zip(mine, fields))
    return isinstance(fields, dict) and all(k in fields and _same(v, fields[k]) for k, v in mine.items())


def _norm(message: str) -> str:
    return re.sub(r" at 0x[0-9a-fA-F]+", "", message)


# Lines whose rejection message vllm_argv cannot reproduce word for word:
# pydantic's ValidationError text for config dataclasses.
APPROXIMATE_MESSAGES: set[str] = set()


@pytest.mark.parametrize("release", sorted(VENVS))
@pytest.mark.parametrize("index", range(len(CORPUS)), ids=[name for name, _ in CORPUS])
def test_vllm_argv_reads_like_vllm(release, index):
    name, words = CORPUS[index]
    results = vllm_results(release)
    theirs, bare = results[index], results[0]
    assert bare["ok"], bare
    mine = vllm_argv.read_argv(_full_argv(index, words), release)
    context = f"{name} {words!r}\nvLLM {release}: {json.dumps(theirs)[:1500]}\nvllm_argv: {mine!r}"

    if not theirs["ok"] and theirs["stage"] == "validate":
        # Not mirrored (documented): what ServeSubcommand.validate checks after parsing.
        pytest.fail(f"corpus line rejected only by validate(): {context}")
    assert mine.ok == theirs["ok"], context
    if not theirs["ok"]:
        if name not in APPROXIMATE_MESSAGES:
            assert _norm(mine.errors[0]) == _norm(theirs["error"]), context
        return

    ns, fields = theirs["namespace"], theirs["dataclass_fields"]
    assert mine.model == (ns["model_tag"] if ns["model_tag"] is not None else mine.values.get("model")), context
    for dest, value in mine.values.items():
        assert dest in ns, f"{dest}: {context}"
        if dest in fields:
            assert _subset(value, fields[dest]), f"{dest}: {value!r} vs {fields[dest]!r}\n{context}"
        else:
            assert _same(value, ns[dest]), f"{dest}: {value!r} vs {ns[dest]!r}\n{context}"
    for dest, value in ns.items():
        if dest == "model_tag" or dest in mine.values:
            continue
        assert _same(value, bare["namespace"].get(dest)), (
            f"vLLM set {dest}={value!r}, vllm_argv did not read it\n{context}")
    # vLLM warns "Found duplicate keys K, ..." for a key given twice (by spelling,
    # append flags included); vllm_argv must warn for each that overrides.
    table = json.loads((REPO / f"flatshare_ops/common/vllm_options/{release}.json").read_text())
    appending = {o for a in table["actions"] if a["action"] == "append" for o in a["option_strings"]}
    for warning in theirs["warnings"]:
        if warning.startswith("Found duplicate keys "):
            keys = warning.removeprefix("Found duplicate keys ").split(", ")
            for key in keys:
                if key not in appending:
                    flag = key.split(".")[0]
                    assert any(key in w or flag in w for w in mine.warnings), f"{key}: {context}"


@pytest.mark.parametrize("release", sorted(VENVS))
def test_committed_option_tables_are_what_vllm_prints(release):
    python = _venv_python(release)
    proc = subprocess.run([str(python), str(SCRIPT), "options"], capture_output=True, text=True,
                          timeout=600, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    committed = REPO / f"flatshare_ops/common/vllm_options/{release}.json"
    assert json.loads(proc.stdout) == json.loads(committed.read_text()), (
        f"{committed} is stale: run scripts/dump-vllm-options.sh")


# --------------------------------------------------------------------------
# vllm_argv on its own: comparing, showing, what it does not mirror


def _read(*words, release="0.32.0"):
    return vllm_argv.read_argv(["/opt/flatshare/engine-venv/bin/vllm", "serve", *words], release)


def test_differences_by_meaning_not_spelling():
    profile = _read(*P)
    running = vllm_argv.read_argv(
        ["/opt/flatshare/engine-venv/bin/python3", "/opt/flatshare/engine-venv/bin/vllm", "serve",
         *_reversed_pairs(_underscores(_eq_forms(BASE))), "--additional-config", json.dumps(ADDITIONAL)])
    assert running.ok and profile.ok
    assert vllm_argv.differences(running, profile) == []
    # A flag given at its default on one side only is no difference.
    assert vllm_argv.differences(_read(M, "--no-enforce-eager", "--port", "8000"), _read(M)) == []


def test_differences_lines():
    profile = _read(M, "--max-num-seqs", "32", "--additional-config.make_room.decode_hold_tokens", "48",
                    "--additional-config.flatshare_jit.margin_ms", "30", "--speculative-config", SPEC)
    running = _read(M, "--enforce-eager", "--additional-config",
                    '{"flatshare_jit": {"margin_ms": 30}, "make_room": {"decode_hold_tokens": 0}}',
                    "--speculative-config", SPEC_REORDERED)
    assert vllm_argv.differences(running, profile, "0.32.0") == [
        "--additional-config.make_room.decode_hold_tokens: running 0, profile 48",
        "--enforce-eager: extra (running on)",
        "--max-num-seqs: missing (profile 32)",
    ]
    # Types matter: the string "48" is not the number 48, 1 is not true, 30 is not 30.0.
    assert vllm_argv.differences(
        _read(M, "--additional-config.a", '"48"', "--additional-config.b", "1",
              "--additional-config.c", "30.0"),
        _read(M, "--additional-config.a", "48", "--additional-config.b", "true",
              "--additional-config.c", "30")) == [
        '--additional-config.a: running "48", profile 48',
        "--additional-config.b: running 1, profile on",
        "--additional-config.c: running 30.0, profile 30",
    ]
    assert vllm_argv.differences(_read("/m/a"), _read("/m/b"), labels=("engine", "checkout")) == [
        "model: engine /m/a, checkout /m/b"]
    assert vllm_argv.differences(_read(M, "--speculative-config", SPEC), _read(M)) == [
        '--speculative-config: extra (running {"method": "eagle3", "model": "/m/draft", '
        '"num_speculative_tokens": 2})']


def test_show():
    assert [vllm_argv.show(v) for v in (True, False, "/m", 48, 0.9, None, ["a"], {"b": 1, "a": 2})] == [
        "on", "off", "/m", "48", "0.9", "null", '["a"]', '{"a": 2, "b": 1}']


def test_reading_of_the_production_render():
    reading = _read(*P)
    assert reading.ok and not reading.warnings and not reading.unverified
    assert reading.model == M
    profile = tomllib.loads((REPO / "profiles/rtx-5060-ti-serve.toml").read_text())  # the operator's values
    assert reading.values["additional_config"]["make_room"]["decode_hold_tokens"] == \
        profile["engine"]["make_room"]["decode_hold_tokens"]
    assert reading.values["additional_config"]["make_room"]["take_reservations"] is True
    assert reading.values["served_model_name"] == ["flatshare-chat"]
    assert reading.values["kv_offloading_size"] == 24.0


def test_warnings_name_what_vllm_ignores():
    r = _read(M, "--additional-config", '{"a": 1}', "--additional-config.b", "2")
    assert r.values == {"additional_config": {"b": 2}}
    assert r.warnings == ["--additional-config '{\"a\": 1}' is ignored: dotted keys of --additional-config "
                          "are given (--additional-config.b 2), and vLLM keeps only those"]
    r = _read(M, "--port", "1", "--port=2")
    assert r.values == {"port": 2}
    assert r.warnings == ["--port given more than once (--port 1 is ignored): vLLM keeps the last, 2"]
    r = _read(M, "--additional-config.a.b", "1", "--additional-config.a.b", "2")
    assert r.warnings == ["--additional-config.a.b given more than once: vLLM keeps the last, 2"]
    assert "is ignored" in _read(M, "--config=x.yaml").warnings[0]


def test_what_is_not_mirrored_is_reported():
    r = _read(M, "--config", "x.yaml")
    assert not r.ok and r.errors[0].startswith("unsupported: --config FILE")
    r = _read(M, "--compilation-config", '{"mode": 3}')
    assert r.ok and r.unverified and "CompilationConfig" in r.unverified[0]
    # validate() is not mirrored: vLLM refuses this after parsing, vllm_argv accepts it.
    assert _read(M, "--enable-auto-tool-choice").ok


def test_argv_shapes_and_releases():
    words = [M, "--port", "8001"]
    for prefix in (["/v/bin/python3", "/v/bin/vllm"], ["/v/bin/vllm"], ["vllm"], [],
                   ["python", "-m", "vllm.entrypoints.cli.main"]):
        assert vllm_argv.read_argv([*prefix, "serve", *words]).values == {"port": 8001}
    assert vllm_argv.read_argv(["/v/bin/python3", "-m", "http.server"]).errors == [
        "not a `vllm serve` command line"]
    assert vllm_argv.known_releases() == ["0.32.0", "0.33.0"]
    with pytest.raises(ValueError, match="no option table for vLLM 0.9.9"):
        vllm_argv.read_argv(["vllm", "serve", M], "0.9.9")
    # A local label is the release's own build (PEP 440): vLLM 0.32.0+cpu reads with 0.32.0's table.
    assert vllm_argv.read_argv(["vllm", "serve", M, "--port", "8001"], "0.32.0+cpu").values == {"port": 8001}
    with pytest.raises(ValueError, match="no option table for vLLM 0.9.9"):
        vllm_argv.read_argv(["vllm", "serve", M], "0.9.9+cpu")
    # 0.33.0 pairs --enable-x with --disable-x; 0.32.0 does not know --disable-x.
    assert _read(M, "--disable-prefix-caching", release="0.33.0").values == {"enable_prefix_caching": False}
    assert not _read(M, "--disable-prefix-caching").ok
    assert vllm_argv.flag_name("max_num_seqs") == "--max-num-seqs"


def test_vllm_argv_imports_only_the_standard_library():
    # (what it costs is bench/'s to measure, not a test's)
    code = ("import json, sys; before = set(sys.modules); import flatshare_ops.common.vllm_argv; "
            "print(json.dumps(sorted(set(sys.modules) - before)))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    modules = json.loads(proc.stdout)
    not_stdlib = [m for m in modules if m.split(".")[0] not in sys.stdlib_module_names
                  and not m.startswith("flatshare_ops")]
    assert not_stdlib == []
    assert "flatshare_ops.common.vllm_argv" in modules
