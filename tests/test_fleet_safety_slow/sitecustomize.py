"""For tests/test_fleet_safety.py only: vLLM's parser takes ``FLEET_SAFETY_SLOW_PARSE_S`` seconds to start.

On PYTHONPATH of a local release, this reaches the node's preflight, which runs
``ENGINE_VENV/bin/python .../vllm_serve_parse.py parse`` with the node's
environment: the parse then starts as slowly as a real vLLM import on a busy node.
Every other interpreter (the node's side itself) is left alone.
"""

import os
import sys
import time

_ARGV = getattr(sys, "orig_argv", sys.argv)
if any(str(a).endswith("vllm_serve_parse.py") for a in _ARGV) and os.environ.get("FLEET_SAFETY_SLOW_PARSE_S"):
    time.sleep(float(os.environ["FLEET_SAFETY_SLOW_PARSE_S"]))
