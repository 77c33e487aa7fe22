#!/usr/bin/env bash
# Build the vLLM parser venvs: vLLM itself (no GPU needed) with just enough of
# its dependencies to build and run its own `vllm serve` argument parser, so the
# tests can check engine flags with vLLM's parser rather than ours.
#   .venv-vllm       vLLM 0.32.0 (the profile's release)
#   .venv-vllm-0.33  vLLM 0.33.0 (the next one)
# About 70 s and 2.1-2.2 GB each the first time; nothing on later runs.
#
# Each venv is rebuilt only when its own recipe changed: its stamp
# ($V/.complete) holds the sha256 of the recipe (the function bodies below as
# bash prints them, so comments do not count, plus the venv's arguments), not
# of this file's mtime or whole content. Changing the 0.33 line rebuilds only
# .venv-vllm-0.33; changing the shared dependency list rebuilds both.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

# The dependency set both venvs share: what importing vLLM and building its
# serve parser actually needs (vLLM itself is installed with --no-deps).
shared_deps() {
  # CPU torch: vLLM 0.32.0 pins torch==2.13.0; this machine kind keeps a CPU
  # wheel in PIP_FIND_LINKS. vLLM 0.33.0 asks for a newer torch, but its
  # parser works with this one (and --no-deps keeps pip from fetching it).
  pip torch==2.13.0
  pip numpy==2.4.6 regex==2026.11.19 PyYAML==6.0.4 packaging==26.4 \
    pydantic==2.14.4 cbor2==6.3.0 psutil==7.2.2 pyzmq==27.3.0 urllib3==2.8.0 \
    transformers==5.19.0 aiohttp==3.14.5 requests==2.34.2 oss-harmony==0.0.11 \
    openai==3.57.0 msgspec==0.23.0 cloudpickle==3.1.3 pillow==13.0.0 \
    pybase64==1.5.1 cachetools==8.0.2 uvloop==0.23.0 py-cpuinfo==9.0.0 \
    fastapi==0.136.3 prometheus_client==0.26.0 partial-json-parser==0.2.1.1.post7 \
    llguidance==1.7.6 uvicorn==0.54.0 watchfiles==1.3.0
  # xgrammar is imported at module level, but its hard dependency triton (1 GB) is not needed to parse.
  pip --no-deps xgrammar==0.2.8 apache-tvm-ffi==0.1.11
}

# build_venv DIR VLLM_VERSION [EXTRA_PACKAGE...]
build_venv() {
  local V=$1 version=$2
  shift 2
  local stamp=$V/.complete want
  want=$( { declare -f build_venv shared_deps; echo "$V $version $*"; } | sha256sum | cut -d' ' -f1)
  [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && return 0
  rm -rf "$V"
  "$PYTHON" -m venv "$V"
  echo '*' > "$V/.gitignore"  # keep git status clean whatever the top-level .gitignore says
  pip() { "$V/bin/pip" install -q --no-warn-conflicts "$@" 2> >(grep -v 'Location .* is ignored' >&2); }
  echo "vllm-parser: building $V (vLLM $version's argument parser, CPU only)"
  pip --no-deps "vllm==$version"
  shared_deps
  if [ $# -gt 0 ]; then pip "$@"; fi
  echo "$want" > "$stamp"
}

build_venv .venv-vllm 0.32.0
# vLLM 0.33.0 imports orjson, which 0.32.0 did not need.
build_venv .venv-vllm-0.33 0.33.0 orjson==3.13.0
