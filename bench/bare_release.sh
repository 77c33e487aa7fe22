#!/usr/bin/env bash
# The baseline a release is measured against: only what a release must do, as a bare shell script.
# Usage: bare_release.sh STAGED_UNITS_DIR UNIT_DIR ENGINE_URL   (XDG_RUNTIME_DIR set to the node manager's)
set -eu
staged=$1 units=$2 url=$3
systemctl --user stop flatshare-gateway.service
cp "$staged"/* "$units"/
systemctl --user daemon-reload
systemctl --user restart flatshare-engine.service
until curl -sf -o /dev/null "$url/health"; do sleep 0.05; done
systemctl --user start flatshare-gateway.service
