#!/usr/bin/env python
"""vLLM's `vllm serve` parser kept running for a test process: one process per vLLM release serves every
corpus of the tests (vLLM's import is most of a parse's cost: about 8 s of CPU).

stdin : one request per line: a JSON list of argv lists (the words after `vllm serve`, model first).
stdout: one answer per line: the JSON list of results, one per argv, exactly what
        flatshare_ops/common/vllm_serve_parse.py's `parse-many` mode prints for the same lines: the
        same ServeParser, built once, runs each argv through `parse` (which resets the parser's state
        before each one, as parse-many relies on).

Run by the parser venv's interpreter (tests/conftest.py's vllm_parse_many). Ends at the end of stdin.
"""
import importlib.util
import json
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "flatshare_ops/common/vllm_serve_parse.py"


def main() -> int:
    spec = importlib.util.spec_from_file_location("vllm_serve_parse", SCRIPT)
    vsp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(vsp)
    # As vllm_serve_parse.py's main: vLLM's log handler binds the stream it finds when vllm is imported,
    # so it must see stderr as stdout from the start; stdout keeps our JSON only.
    real_stdout, sys.stdout = sys.stdout, sys.stderr
    parser = vsp.ServeParser()
    for line in sys.stdin:
        data = json.loads(line)
        if not isinstance(data, list):
            print("serve_lines: a request is a JSON list of argv lists", file=sys.stderr)
            return 2
        results = [parser.parse(vsp._read_argv_list(words)) for words in data]
        real_stdout.write(json.dumps(results, sort_keys=True) + "\n")
        real_stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
