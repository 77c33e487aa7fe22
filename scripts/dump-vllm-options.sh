#!/usr/bin/env bash
# Regenerate flatshare_ops/common/vllm_options/RELEASE.json, the `vllm serve`
# option tables vllm_argv.py builds its parsers from, from the vLLM parser
# venvs that scripts/vllm-venvs.sh builds (one release per venv). Each
# run imports vLLM (~10 s of CPU), under nice, one after the other.
#   --as-built   use the venvs as they are (do not run vllm-venvs.sh,
#                e.g. when they are shared with another checkout)
# RELEASE is the table's own vllm_release: the public version, so a venv whose
# vLLM says 0.32.0+cpu writes 0.32.0.json.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" != "--as-built" ]; then
  ./scripts/vllm-venvs.sh
fi
out=flatshare_ops/common/vllm_options
mkdir -p "$out"
for venv in .venv-vllm .venv-vllm-0.33; do
  tmp=$(mktemp "$out/.table.XXXXXX")
  VLLM_LOGGING_LEVEL=ERROR nice -n 10 "$venv/bin/python" flatshare_ops/common/vllm_serve_parse.py options > "$tmp"
  release=$("$venv/bin/python" -c 'import json, sys; print(json.load(open(sys.argv[1]))["vllm_release"])' "$tmp")
  chmod 644 "$tmp"
  mv "$tmp" "$out/$release.json"
  echo "$out/$release.json ($venv, $(wc -c < "$out/$release.json") bytes)"
done
