"""The engine's command line: ``vllm serve MODEL`` and flags, spelled as vLLM 0.32.0 spells them.

Flag spellings are taken from vLLM 0.32.0's own argument parser (docs/reference/vllm.md#flag-spellings). make-room's and the JIT scheduler's settings
go as dotted ``--additional-config.PREFIX.KEY VALUE`` flags, one per key,
never mixed with a JSON ``--additional-config`` (vLLM keeps only the dotted
keys then, silently). Dotted values are read by vLLM with ``json.loads``, so
each value is written as JSON: ``48``, ``true``, ``"/path"``.
"""

from __future__ import annotations

import json
from pathlib import PurePosixPath

from ..config.profile import Engine

# The order flags are written in: stable, so rendered files never churn.
MAKE_ROOM_KEYS = (
    "retain_tokens",
    "retain_s",
    "hint_hold_ms",
    "take_reservations",
    "decode_hold_tokens",
    "recompute_tokens",
)
FLATSHARE_JIT_KEYS = ("margin_ms", "step_time_model")


def dotted_value(value: bool | int | float | str) -> str:
    """A value for a dotted ``--additional-config`` flag, as JSON text.

    vLLM parses dotted values with ``json.loads`` (docs/reference/vllm.md#dotted-value-typing): ``true`` is a
    bool (``True`` would stay a string) and a string must be JSON-quoted to
    stay a string whatever it holds (``"48"``).
    """
    return json.dumps(value)


def _bool_flag(name: str, on: bool) -> str:
    return f"--{name}" if on else f"--no-{name}"


def _number(value: float) -> str:
    return json.dumps(value)


def engine_flags(engine: Engine) -> list[str]:
    """The flags after ``vllm serve MODEL``, in their fixed order.

    Returns:
        A flat list of argv words: ``["--served-model-name", "x", "--host", ...]``.
    """
    flags = [
        "--served-model-name", engine.served_model_name,
        "--host", engine.host,
        "--port", str(engine.port),
        "--gpu-memory-utilization", _number(engine.gpu_memory_utilization),
        "--max-model-len", str(engine.max_model_len),
        "--max-num-seqs", str(engine.max_num_seqs),
        "--max-num-batched-tokens", str(engine.max_num_batched_tokens),
        _bool_flag("enable-prefix-caching", engine.enable_prefix_caching),
        "--kv-cache-dtype", engine.kv_cache_dtype,
    ]
    if engine.kv_offloading.enabled:
        flags += [
            "--kv-offloading-size", _number(engine.kv_offloading.size_gib),
            "--kv-offloading-backend", engine.kv_offloading.backend,
        ]
    flags += [
        _bool_flag("async-scheduling", engine.async_scheduling),
        _bool_flag("enforce-eager", engine.enforce_eager),
        "--attention-backend", engine.attention_backend,
        "--scheduler-cls", engine.scheduler_cls,
    ]
    for key in MAKE_ROOM_KEYS:
        flags += [f"--additional-config.make_room.{key}", dotted_value(getattr(engine.make_room, key))]
    for key in FLATSHARE_JIT_KEYS:
        flags += [f"--additional-config.flatshare_jit.{key}", dotted_value(getattr(engine.flatshare_jit, key))]
    if engine.speculative is not None and engine.speculative.enabled:
        # One JSON form, never dotted keys beside it (docs/reference/vllm.md#mixing-json-and-dotted-forms);
        # compact and key-sorted, so the render never churns.
        flags += ["--speculative-config",
                  json.dumps(engine.speculative.vllm_config(), sort_keys=True, separators=(",", ":"))]
    generation = engine.override_generation_config.vllm_config()
    if generation:  # none set: the model's own defaults, and no flag
        flags += ["--override-generation-config", json.dumps(generation, sort_keys=True, separators=(",", ":"))]
    return flags


def vllm_executable(engine: Engine) -> str:
    """Path of the ``vllm`` console script in the engine's venv."""
    return str(PurePosixPath(engine.venv) / "bin" / "vllm")


def engine_argv(engine: Engine) -> list[str]:
    """The whole engine command: ``[VENV/bin/vllm, "serve", MODEL, *flags]``."""
    return [vllm_executable(engine), "serve", engine.model, *engine_flags(engine)]
