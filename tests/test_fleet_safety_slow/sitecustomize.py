"""For tests/test_fleet_safety.py only: vLLM's parser takes ``FLEET_SAFETY_SLOW_PARSE_S`` seconds to start.

Put into the node's serve module directory (the engine's PYTHONPATH), this reaches the node's
preflight, which runs ``ENGINE_VENV/bin/python .../vllm_serve_parse.py preflight`` with the engine's
environment: the preflight then starts as slowly as a real vLLM import on a busy node. Every other
interpreter (the engine itself) is left alone.
"""

import os
import sys
import time

_ARGV = getattr(sys, "orig_argv", sys.argv)
if any(str(a).endswith("vllm_serve_parse.py") for a in _ARGV) and os.environ.get("FLEET_SAFETY_SLOW_PARSE_S"):
    time.sleep(float(os.environ["FLEET_SAFETY_SLOW_PARSE_S"]))
