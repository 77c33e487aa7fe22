#!/usr/bin/env bash
# Regenerate flatshare_ops/common/vllm_options/RELEASE.json, the `vllm serve`
# option tables engine_argv.py reads, from the vLLM parser venvs that
# scripts/vllm-venvs.sh builds (one release per venv). Each run imports
# vLLM (~10 s of CPU), under nice, one after the other.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/vllm-venvs.sh
out=flatshare_ops/common/vllm_options
mkdir -p "$out"
for venv in .venv-vllm .venv-vllm-0.33; do
  release=$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm"))')
  VLLM_LOGGING_LEVEL=ERROR nice -n 10 "$venv/bin/python" flatshare_ops/common/vllm_serve_parse.py options \
    > "$out/$release.json.tmp"
  mv "$out/$release.json.tmp" "$out/$release.json"
  echo "$out/$release.json ($venv)"
done
