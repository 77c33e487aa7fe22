"""The engine's command line: vLLM 0.32.0's spellings, and exactly the profile's values."""

from __future__ import annotations

import json

from conftest import REPO
from flatshare_ops.config.profile import load_profile
from flatshare_ops.render import render_profile

# docs/reference/vllm.md#flag-spellings (read from vLLM 0.32.0's own argument parser).
VLLM_0_32_FLAGS = {
    "--scheduler-cls", "--async-scheduling", "--no-async-scheduling", "--attention-backend",
    "--kv-cache-dtype", "--kv-offloading-size", "--kv-offloading-backend",
    "--gpu-memory-utilization", "--max-model-len", "--max-num-seqs", "--max-num-batched-tokens",
    "--enable-prefix-caching", "--no-enable-prefix-caching",
    "--host", "--port", "--served-model-name", "--api-server-count", "--speculative-config",
    "--compilation-config", "--enforce-eager", "--no-enforce-eager",
}
BOOLEAN_FLAGS = {"--async-scheduling", "--no-async-scheduling", "--enable-prefix-caching", "--no-enable-prefix-caching",
                 "--enforce-eager", "--no-enforce-eager"}


def parse_like_vllm(words: list[str]) -> tuple[dict[str, str | bool], dict]:
    """Read flags by docs/reference/vllm.md's rules: booleans stand alone, dotted additional-config
    values go through json.loads and merge into one dict per prefix."""
    flags: dict[str, str | bool] = {}
    additional: dict = {}
    i = 0
    while i < len(words):
        word = words[i]
        assert word.startswith("--"), f"stray word {word!r}"
        if word.startswith("--additional-config."):
            *path, leaf = word.removeprefix("--additional-config.").split(".")
            node = additional
            for part in path:
                node = node.setdefault(part, {})
            assert leaf not in node, f"duplicate dotted key {word}"
            node[leaf] = json.loads(words[i + 1])
            i += 2
        elif word in BOOLEAN_FLAGS:
            flags[word] = True
            i += 1
        else:
            assert word not in flags, f"repeated flag {word}"
            flags[word] = words[i + 1]
            i += 2
    return flags, additional


def _rendered():
    loaded = load_profile(REPO / "profiles/rtx-5060-ti-serve.toml")
    return loaded, render_profile(loaded)


def test_engine_command_is_vllm_serve_model_from_the_engine_venv():
    loaded, rendered = _rendered()
    assert rendered.argv[:3] == ["/opt/flatshare/engine-venv/bin/vllm", "serve", loaded.profile.engine.model]


def test_every_flag_is_spelled_as_vllm_0_32_spells_it():
    _, rendered = _rendered()
    names = {w for w in rendered.argv[3:] if w.startswith("--") and not w.startswith("--additional-config.")}
    assert names <= VLLM_0_32_FLAGS, names - VLLM_0_32_FLAGS


def test_flags_give_exactly_the_profiles_values():
    loaded, rendered = _rendered()
    e = loaded.profile.engine
    flags, additional = parse_like_vllm(rendered.argv[3:])
    assert flags == {
        "--served-model-name": e.served_model_name,
        "--host": e.host,
        "--port": str(e.port),
        "--gpu-memory-utilization": json.dumps(e.gpu_memory_utilization),
        "--max-model-len": str(e.max_model_len),
        "--max-num-seqs": str(e.max_num_seqs),
        "--max-num-batched-tokens": str(e.max_num_batched_tokens),
        "--enable-prefix-caching" if e.enable_prefix_caching else "--no-enable-prefix-caching": True,
        "--kv-cache-dtype": e.kv_cache_dtype,
        **({"--kv-offloading-size": json.dumps(e.kv_offloading.size_gib),
            "--kv-offloading-backend": e.kv_offloading.backend} if e.kv_offloading.enabled else {}),
        "--async-scheduling" if e.async_scheduling else "--no-async-scheduling": True,
        "--enforce-eager" if e.enforce_eager else "--no-enforce-eager": True,
        "--attention-backend": e.attention_backend,
        "--scheduler-cls": e.scheduler_cls,
    }
    # The profile's values, typed as vLLM types dotted values (docs/reference/vllm.md#dotted-value-typing).
    engine = loaded.profile.engine
    assert additional == {"make_room": engine.make_room.model_dump(), "flatshare_jit": engine.flatshare_jit.model_dump()}
    assert all(type(v) is int for k, v in additional["make_room"].items() if k != "take_reservations")
    assert type(additional["make_room"]["take_reservations"]) is bool


def test_additional_config_is_only_ever_dotted_never_json():
    # vLLM keeps only the dotted keys when both forms are given, silently (docs/reference/vllm.md#mixing-json-and-dotted-forms).
    _, rendered = _rendered()
    assert "--additional-config" not in rendered.argv
    assert not any(w.startswith("--additional-config=") for w in rendered.argv)


def test_make_room_flags_are_one_per_key_in_a_stable_order():
    _, rendered = _rendered()
    keys = [w.split(".", 2)[2] for w in rendered.argv if w.startswith("--additional-config.make_room.")]
    assert keys == ["retain_tokens", "retain_s", "hint_hold_ms", "take_reservations", "decode_hold_tokens", "recompute_tokens"]


def test_rendering_is_byte_identical_on_every_run():
    loaded, first = _rendered()
    second = render_profile(load_profile(REPO / "profiles/rtx-5060-ti-serve.toml"))
    assert first.units == second.units and first.serving == second.serving


def test_command_lines_read_from_several_threads_at_once_read_as_each_alone():
    # A suite run's case: a rollout rendered its nodes' releases from several threads (the retry guard, the
    # fleet's preflight), and a render read an engine flag as missing ("engine.model: vLLM 0.32.0 would read
    # ... as None"): the shared parser kept each parse's state on itself. 8 threads x 100 readings, each
    # compared with the same command line read alone.
    import threading

    from flatshare_ops.common import vllm_argv

    argv = ["/v/bin/vllm", "serve", "/m", "--max-num-seqs", "4", "--enable-prefix-caching",
            "--gpu-memory-utilization", "0.9"]
    alone = vllm_argv.read_argv(argv)
    wrong: list = []

    def read() -> None:
        for _ in range(100):
            reading = vllm_argv.read_argv(argv)
            if (reading.model, reading.values, reading.errors) != (alone.model, alone.values, alone.errors):
                wrong.append(reading.values)

    threads = [threading.Thread(target=read) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert alone.model == "/m" and not wrong, wrong[:2]
