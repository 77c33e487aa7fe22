#!/usr/bin/env bash
# The baseline a release is measured against: only what a release must do, as a bare shell script.
# Usage: bare_release.sh STAGED_UNITS_DIR UNIT_DIR ENGINE_URL   (XDG_RUNTIME_DIR set to the node manager's)
set -eu
staged=$1 units=$2 url=$3
systemctl --user stop flatshare-gateway.service
cp "$staged"/* "$units"/
systemctl --user daemon-reload
systemctl --user restart flatshare-engine.service
deadline=$((SECONDS + 300))  # an engine that never answers ends the bench, not hangs it
until curl -sf -o /dev/null "$url/health"; do
  if ((SECONDS > deadline)); then echo "the engine did not answer $url/health within 300 s" >&2; exit 1; fi
  sleep 0.05
done
systemctl --user start flatshare-gateway.service
