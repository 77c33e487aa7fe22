"""The rendered engine flags, parsed by vLLM 0.32.0's own `vllm serve` argument parser.

`scripts/vllm-parser-venv.sh` (run by `make test`) builds `.venv-vllm` with
vLLM 0.32.0 and what its parser needs; `vllm_parser/parse_argv.py` builds the
serve parser exactly as `vllm serve` does and prints the parsed namespace.
This is the independent check that our spellings and JSON-typed dotted
values mean, to vLLM, exactly the profile's values.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from conftest import REPO
from flatshare_ops.config.profile import load_profile
from flatshare_ops.render import render_profile

VENV_PYTHON = REPO / ".venv-vllm/bin/python"
PARSER = Path(__file__).parent / "vllm_parser/parse_argv.py"


def _parse(argv_after_serve: list[str]) -> subprocess.CompletedProcess:
    if not VENV_PYTHON.exists():
        if os.environ.get("FLATSHARE_SKIP_VLLM_PARSER") == "1":
            pytest.skip("FLATSHARE_SKIP_VLLM_PARSER=1")
        pytest.fail(f"{VENV_PYTHON} missing: run scripts/vllm-parser-venv.sh (make test does)")
    return subprocess.run(
        [str(VENV_PYTHON), str(PARSER)], input=json.dumps(argv_after_serve), capture_output=True, text=True,
        timeout=300, env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"},
    )


@pytest.fixture(scope="module")
def parsed():
    loaded = load_profile(REPO / "profiles/rtx-5060-ti-serve.toml")
    argv = render_profile(loaded).argv
    assert argv[1] == "serve"
    result = _parse(argv[2:])
    assert result.returncode == 0, result.stderr[-2000:]
    return loaded.profile, json.loads(result.stdout)


def test_vllm_reads_the_profiles_engine_values(parsed):
    profile, ns = parsed
    e = profile.engine
    assert ns["model_tag"] == e.model
    assert ns["served_model_name"] == [e.served_model_name]
    assert (ns["host"], ns["port"]) == (e.host, e.port)
    assert ns["gpu_memory_utilization"] == e.gpu_memory_utilization
    assert (ns["max_model_len"], ns["max_num_seqs"], ns["max_num_batched_tokens"]) == (
        e.max_model_len, e.max_num_seqs, e.max_num_batched_tokens)
    assert ns["enable_prefix_caching"] is e.enable_prefix_caching
    assert ns["kv_cache_dtype"] == e.kv_cache_dtype
    assert ns["kv_offloading_size"] == e.kv_offloading.size_gib
    assert ns["kv_offloading_backend"] == e.kv_offloading.backend
    assert ns["async_scheduling"] is e.async_scheduling
    assert ns["attention_backend"] == e.attention_backend
    assert ns["scheduler_cls"] == e.scheduler_cls


def test_vllm_reads_make_room_and_jit_settings_with_their_types(parsed):
    profile, ns = parsed
    assert ns["additional_config"] == {
        "make_room": profile.engine.make_room.model_dump(),
        "flatshare_jit": profile.engine.flatshare_jit.model_dump(),
    }
    # Typed as the profile types them: ints stay ints, the bool a bool, the path a string.
    make_room = ns["additional_config"]["make_room"]
    assert type(make_room["decode_hold_tokens"]) is int and make_room["decode_hold_tokens"] == profile.engine.make_room.decode_hold_tokens
    assert make_room["take_reservations"] is profile.engine.make_room.take_reservations


def test_vllm_refuses_a_misspelt_flag():
    result = _parse(["/models/m", "--kv-offload-size", "24"])
    assert result.returncode == 2
    assert "unrecognized arguments: --kv-offload-size 24" in result.stderr
