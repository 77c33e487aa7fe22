#!/usr/bin/env bash
# The same probes serving-check makes, as a shell script: the baseline its cost is measured against.
# Usage: serving_check_baseline.sh STATE_DIR UNIT_DIR ENGINE_VENV ENGINE_URL GATEWAY_URL
#        (XDG_RUNTIME_DIR set to the node manager's)
set -u
state=$1 units=$2 venv=$3 url=$4 gateway=$5
cat "$state/releases/current/serving.json" >/dev/null
cat /proc/locks >/dev/null
test -e "$state/releases/switching.json"
all="flatshare-engine.service flatshare-gateway.service flatshare-voice.service flatshare.target serving-check.service serving-check.timer"
systemctl --user show -p DropInPaths,NeedDaemonReload $all >/dev/null
systemctl --user show -p ActiveState flatshare-engine.service flatshare-gateway.service flatshare-voice.service >/dev/null
systemctl --user show -p UnitPath >/dev/null
pid=$(systemctl --user show -p MainPID --value flatshare-engine.service)
systemctl --user show -p LoadState,ActiveState,ExecMainStartTimestamp flatshare-engine.service >/dev/null
tr '\0' ' ' < "/proc/$pid/cmdline" >/dev/null
curl -s "$url/health" >/dev/null
curl -s "$url/version" >/dev/null
curl -s "$url/metrics" >/dev/null
curl -s "$gateway/health" >/dev/null
readlink "$state/releases/current" >/dev/null
sha256sum "$state"/module/*.py "$units"/*.service "$units"/*.target "$units"/*.timer >/dev/null
stat -c %Y "$state"/module/*.py >/dev/null
ls -d "$units"/*.d "$units"/*-.service.d "$units"/service.d 2>/dev/null >/dev/null
cat "$venv"/lib/python*/site-packages/vllm-*.dist-info/METADATA >/dev/null
