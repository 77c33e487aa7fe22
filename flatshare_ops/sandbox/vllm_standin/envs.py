"""Stand-in for ``vllm.envs``: only ``VLLM_CACHE_ROOT``, resolved as vLLM 0.32.0's envs.py resolves it."""

import os

#: ``$VLLM_CACHE_ROOT``, else ``$XDG_CACHE_HOME/vllm``, else ``~/.cache/vllm`` (vllm/envs.py).
VLLM_CACHE_ROOT = os.path.expanduser(
    os.getenv("VLLM_CACHE_ROOT", os.path.join(os.getenv("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache")), "vllm"))
)
