#!/usr/bin/env python
"""Parse a `vllm serve` argv with vLLM's own parser (a thin wrapper).

stdin : JSON list of strings = the arguments after `vllm serve`
        (starting with the model path), e.g. ["/models/m", "--port", "8000"].
stdout: JSON object = vars(args) after parse + ServeSubcommand.validate().

The work is flatshare_ops/common/vllm_serve_parse.py's `parse` mode (which
builds the parser exactly as `vllm serve` does, for vLLM 0.32.0 and 0.33.0);
this wrapper keeps the old contract: argparse errors exit with code 2 and
"vllm serve: error: MESSAGE" (or "vllm: error: ..." for unrecognized
arguments) on stderr, as with the real CLI; validate errors and vLLM's own
exceptions exit with code 1.
"""
import importlib.util
import json
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "flatshare_ops/common/vllm_serve_parse.py"


def main() -> int:
    argv = json.load(sys.stdin)
    if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
        print("stdin must be a JSON list of strings", file=sys.stderr)
        return 2
    spec = importlib.util.spec_from_file_location("vllm_serve_parse", SCRIPT)
    vsp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(vsp)

    real_stdout, sys.stdout = sys.stdout, sys.stderr  # vLLM's logs never reach the JSON
    try:
        result = vsp.ServeParser().parse(argv)
    finally:
        sys.stdout = real_stdout
    if not result["ok"]:
        prefix = f"{result['prog']}: error: " if result.get("prog") else f"{result['stage']} failed: "
        print(prefix + result["error"], file=sys.stderr)
        return result["exit_code"] if result["stage"] == "parse" and result.get("exit_code") else 1
    json.dump(result["namespace"], sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
