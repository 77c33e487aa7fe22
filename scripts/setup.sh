#!/usr/bin/env bash
# Install what flatshare-ops and its tests need on a fresh Debian machine, as root:
# Debian packages (pystemd builds against libsystemd; the sandbox runs systemd and sshd; tests/test_lock.py
# reads the release lock on a loop-mounted btrfs and xfs, made with btrfs-progs and xfsprogs; the machines
# tier boots Debian 12 machines, built with mmdebstrap and booted with systemd-nspawn from systemd-container)
# and a venv in .venv: uv (from requirements-setup.lock), then with uv every dependency from requirements-dev.lock (exact versions, hashes
# checked: the same pins a node installs from requirements.lock), then the project itself
# in editable mode.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(systemd dbus libsystemd-dev pkg-config gcc python3-dev python3-venv openssh-server openssh-client curl make util-linux btrfs-progs xfsprogs systemd-container mmdebstrap)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing Debian packages: ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# promtool (the tests lint and unit-test the rendered alert rules with it) comes only in Debian's
# prometheus package, a Prometheus server beside it: about 22 MB to download, 316 MiB installed with
# its web UI's JavaScript, 8 s (measured on Debian 12). Its maintainer scripts would start and enable
# the server; a policy-rc.d answering 101 ("action forbidden", invoke-rc.d(8)) keeps it from starting,
# and the unit is disabled again where systemd runs, so set-up never leaves a Prometheus running.
if ! command -v promtool >/dev/null; then
  echo "setup: installing Debian package prometheus (for promtool; its server is not started)"
  policy=/usr/sbin/policy-rc.d
  kept=$(mktemp)
  if [ -e "$policy" ]; then cp -p "$policy" "$kept"; else rm -f "$kept"; fi
  restore() { if [ -e "$kept" ]; then mv -f "$kept" "$policy"; else rm -f "$policy"; fi; }
  trap restore EXIT
  printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod 755 "$policy"
  [ ${#missing[@]} -gt 0 ] || apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
  restore
  trap - EXIT
  if [ -d /run/systemd/system ]; then
    systemctl disable --now prometheus.service >/dev/null 2>&1 || true
  fi
fi

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# pip installs uv (requirements-setup.lock), uv the rest: the same locks, hashes checked, in seconds.
# --compile-bytecode, as pip does by default: where PYTHONDONTWRITEBYTECODE is set (this machine kind sets
# it), a module without a .pyc is compiled again by every process that imports it (0.3 s for each of the
# several Python processes a release starts, measured with cProfile).
# The project in setuptools' compat editable mode: a .pth file naming the checkout, which Python reads at no cost,
# where the default mode imports an import hook into every Python process at its start (11 ms of CPU each here,
# and the tests and a release start thousands: bench/node_command_cost.py's baseline shows it).
install_venv() {
  .venv/bin/pip install -q --require-hashes -r requirements-setup.lock 2> >(grep -v 'Location .* is ignored' >&2)
  .venv/bin/uv pip install -q --compile-bytecode --python .venv/bin/python --require-hashes -r requirements-dev.lock
  .venv/bin/uv pip install -q --python .venv/bin/python --no-deps --config-settings editable_mode=compat -e .
}
stamp=.venv/.flatshare-installed
want=$( { declare -f install_venv; cat pyproject.toml requirements-setup.lock requirements.lock requirements-dev.lock; } \
  | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  install_venv
  echo "$want" > "$stamp"
fi

# The wheels `flatshare node bootstrap` installs on a node, built here once per requirements.lock and
# platform (flatshare_ops/control/wheels.py; pystemd compiles: about 30 s the first time, nothing later).
.venv/bin/python -m flatshare_ops.control.wheels
