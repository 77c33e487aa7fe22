#!/usr/bin/env bash
# Build .venv-vllm: vLLM 0.32.0 itself (no GPU needed), with just enough of its
# dependencies to build and run its own `vllm serve` argument parser, so the
# tests can check the rendered flags with vLLM's parser rather than ours.
# About 80 s and 2.1 GB the first time; nothing on later runs.
set -euo pipefail
cd "$(dirname "$0")/.."
V=.venv-vllm
stamp=$V/.complete
# Rebuild only when this script's content changed (not its mtime: a fresh clone is always newer).
want=$(sha256sum "$0" | cut -d' ' -f1)
[ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && exit 0
rm -rf "$V"
PYTHON=${PYTHON:-python3}
"$PYTHON" -m venv "$V"
pip() { "$V/bin/pip" install -q --no-warn-conflicts "$@" 2> >(grep -v 'Location .* is ignored' >&2); }
echo "vllm-parser: building $V (vLLM 0.32.0's argument parser, CPU only)"
pip --no-deps vllm==0.32.0
# CPU torch: vLLM 0.32.0 pins torch==2.13.0; this machine kind keeps a CPU wheel in PIP_FIND_LINKS.
pip torch==2.13.0
# What importing and building the serve parser actually needs.
pip numpy==2.4.6 regex==2026.11.19 PyYAML==6.0.4 packaging==26.4 \
  pydantic==2.14.4 cbor2==6.3.0 psutil==7.2.2 pyzmq==27.3.0 urllib3==2.8.0 \
  transformers==5.19.0 aiohttp==3.14.5 requests==2.34.2 oss-harmony==0.0.11 \
  openai==3.57.0 msgspec==0.23.0 cloudpickle==3.1.3 pillow==13.0.0 \
  pybase64==1.5.1 cachetools==8.0.2 uvloop==0.23.0 py-cpuinfo==9.0.0 \
  fastapi==0.136.3 prometheus_client==0.26.0 partial-json-parser==0.2.1.1.post7 \
  llguidance==1.7.6 uvicorn==0.54.0 watchfiles==1.3.0
# xgrammar is imported at module level, but its hard dependency triton (1 GB) is not needed to parse.
pip --no-deps xgrammar==0.2.8 apache-tvm-ffi==0.1.11
echo "$want" > "$stamp"
