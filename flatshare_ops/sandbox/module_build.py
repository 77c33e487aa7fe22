"""The make-room serve module's build, for the sandbox only.

The engine unit's pre-start step runs it, as production builds the real
module at engine start. It writes a deterministic module file atomically, so
the sandbox profile can pin its sha256 (:func:`module_source`). ``--patch``
changes the content (and so the hash), as a make-room patch change does.

Two builds, one per sandbox engine (``flatshare sandbox up --engine``):

- ``vllm``: a real scheduler for vLLM 0.32.0's engine. Its ``AsyncScheduler`` subclasses vLLM's
  (``vllm.v1.core.sched.async_scheduler.AsyncScheduler``), reads ``additional_config["make_room"]``
  and ``["flatshare_jit"]`` (typed values: vLLM's dotted ``--additional-config`` flags), refuses at
  start a ``decode_hold_tokens`` above the engine's context (a reply can hold no more tokens than
  that), prints at start the values it runs with, and counts the turn hints it is sent (a request
  whose ``vllm_xargs`` carry ``flatshare_turn_hint``: vLLM puts them in the request's
  ``sampling_params.extra_args``), printing a line per turn with the running count. Its lines are
  what serving-check reads the turn count from (:data:`LINE_TAG`; docs/reference/vllm.md,
  "The serve module's lines"). It also asks Linux for the AMX state at import (:data:`AMX_REQUEST`), for
  vLLM's CPU attention on CPUs with AMX.
- ``stand-in``: a module the stand-in engine never imports (it counts turns in its own /metrics).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..check.facts import MODULE_LINE_TAG as LINE_TAG
from ..common.durable import write_atomic

MODULE_NAME = "flatshare_make_room_serve"
ENGINES = ("vllm", "stand-in")

_STAND_IN = '''"""Stand-in make-room serve module (sandbox build)."""
PATCH = {patch!r}


class AsyncScheduler:
    """Stand-in for make-room\'s scheduler class."""
'''

_REAL = '''"""Flatshare's make-room serve module, sandbox build for vLLM 0.32.0 (flatshare_ops/sandbox/module_build.py).

vLLM imports it as ``--scheduler-cls flatshare_make_room_serve.AsyncScheduler`` in its engine core process.
"""
import ctypes
import json
import os

from vllm.v1.core.sched.async_scheduler import AsyncScheduler as _VllmAsyncScheduler


def _request_amx():
    # vLLM 0.32.0's CPU attention takes its AMX kernel for a BF16 model on a CPU with AMX (cpu_attn.py
    # _get_attn_isa) and runs tile instructions without asking Linux for the AMX state first: the engine
    # core died of SIGILL at its first request (tilezero, csrc/cpu/cpu_attn_amx.hpp) unless a oneDNN call
    # had asked before. Asked here, in the engine core, before any forward pass: arch_prctl(2)
    # ARCH_REQ_XCOMP_PERM (0x1023) for XFEATURE_XTILEDATA (18); refused harmlessly where there is no AMX.
    try:
        ctypes.CDLL(None, use_errno=True).syscall(158, 0x1023, 18)  # SYS_arch_prctl on x86_64
    except (OSError, AttributeError):
        pass


if os.uname().machine == "x86_64":
    _request_amx()

PATCH = {patch!r}
TAG = {tag!r}


def _say(event, **values):
    # One line per event on stdout (the engine unit's output): serving-check reads the turn count here.
    # engine_pid is the API server's (the unit's main process): the engine core is its child.
    fields = " ".join(f"{{k}}={{json.dumps(v, sort_keys=True, separators=(',', ':'))}}" for k, v in values.items())
    print(f"{{TAG}} event={{event}} engine_pid={{os.getppid()}} pid={{os.getpid()}} {{fields}}", flush=True)


class AsyncScheduler(_VllmAsyncScheduler):
    """vLLM's async scheduler, with make-room's settings read and its turn hints counted."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        extra = self.vllm_config.additional_config or {{}}
        self.make_room = dict(extra.get("make_room") or {{}})
        self.flatshare_jit = dict(extra.get("flatshare_jit") or {{}})
        hold = self.make_room.get("decode_hold_tokens")
        context = self.vllm_config.model_config.max_model_len
        if not isinstance(hold, int) or isinstance(hold, bool) or not 0 <= hold <= context:
            raise ValueError(f"{{TAG}} make_room.decode_hold_tokens must be an integer from 0 to the engine's "
                             f"max_model_len ({{context}}), got {{hold!r}}")
        self.turns_announced = 0
        _say("start", patch=PATCH, make_room=self.make_room, flatshare_jit=self.flatshare_jit)

    def add_request(self, request):
        params = getattr(request, "sampling_params", None)
        extra = (getattr(params, "extra_args", None) or {{}}) if params is not None else {{}}
        if extra.get("flatshare_turn_hint"):
            self.turns_announced += 1
            _say("turn", turns_announced=self.turns_announced)
        return super().add_request(request)
'''


#: What the real build asks of Linux at import, and why (also written in the module it builds).
AMX_REQUEST = ("arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): vLLM 0.32.0's AMX attention kernel for CPUs "
               "runs AMX instructions without asking for the AMX state, and its engine core died of SIGILL")


def module_source(patch: str = "0", engine: str = "stand-in") -> bytes:
    """The bytes the build writes for a patch level and an engine (``vllm`` or ``stand-in``)."""
    if engine == "vllm":
        return _REAL.format(patch=patch, tag=LINE_TAG).encode()
    return _STAND_IN.format(patch=patch).encode()


def main(argv: list[str] | None = None) -> None:
    """``python -m flatshare_ops.sandbox.module_build --out DIR [--patch P] [--engine vllm|stand-in]``."""
    parser = argparse.ArgumentParser(prog="module_build")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--patch", default="0")
    parser.add_argument("--engine", choices=ENGINES, default="stand-in")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out / f"{MODULE_NAME}.py", module_source(args.patch, args.engine))


if __name__ == "__main__":
    main()
