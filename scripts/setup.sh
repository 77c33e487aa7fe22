#!/usr/bin/env bash
# Install what flatshare-ops and its tests need on a fresh Debian machine, as root:
# Debian packages (pystemd builds against libsystemd; the sandbox runs systemd and sshd)
# and a venv in .venv: every dependency from requirements-dev.lock (exact versions, hashes
# checked: the same pins a node installs from requirements.lock), then the project itself
# in editable mode.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(systemd dbus libsystemd-dev pkg-config gcc python3-dev python3-venv openssh-server openssh-client curl make util-linux)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing Debian packages: ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.flatshare-installed
want=$(cat pyproject.toml requirements.lock requirements-dev.lock | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  pip() { .venv/bin/pip install -q "$@" 2> >(grep -v 'Location .* is ignored' >&2); }
  pip --require-hashes -r requirements-dev.lock
  pip --no-deps -e .
  echo "$want" > "$stamp"
fi
