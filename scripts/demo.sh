#!/usr/bin/env bash
# The main job on the local sandbox fleet: check the checkout, bring cyan and
# peacock up, release both to what the checkout renders, run serving-check on
# both, and print each node's status.
set -uo pipefail
cd "$(dirname "$0")/.."
bin=.venv/bin
inv=.sandbox/fleet.toml
step() { printf '\n== %s\n' "$*"; }

step "render: the checkout's files match the profile" && $bin/flatshare profiles render || exit $?
step "verify: systemd-analyze verify prints nothing for the units" && $bin/flatshare profiles verify || exit $?
step "sandbox: cyan and peacock, each its own systemd manager and sshd, bootstrapped (a new one has no release yet)" && $bin/flatshare sandbox up || exit $?
step "release: both nodes, one at a time, over SSH (on a new sandbox each node's first release, a real switch; later, what the checkout changed, cyan first as the canary), while calls stream through both gateways"
calls=$(mktemp)
# A call waits (bounded) while no gateway answers yet: on the first run no node has a release until cyan's first switch ends.
# --spread: one seat dials cyan first, the other peacock first, so the canary and its baseline both have
# calls for the canary analysis to measure (a later run with a change analyses cyan against peacock).
$bin/python -m flatshare_ops.sandbox.caller --inventory "$inv" --concurrency 2 --spread --pause 0.5 --for 600 --tokens 32 --timeout 240 --brief >"$calls" 2>&1 &
caller=$!
$bin/flatshare release --all --inventory "$inv"
code=$?
kill -TERM "$caller"; wait "$caller"; calls_code=$?  # SIGTERM: no new calls; those in progress finish
sed 's/^/  /' "$calls"; rm -f "$calls"
case $code in
  0) ;;
  4) echo "(both nodes already run this checkout's release: nothing to do)" ;;
  *) exit $code ;;
esac
[ "$calls_code" -eq 0 ] || { echo "demo: a call did not end with [DONE] during the release"; exit 1; }
step "a voice call at each node's voice worker: each user turn sends its one-token hint to the engine (the serve module counts it), then its reply through the gateway"
$bin/python -m flatshare_ops.sandbox.voice_call --inventory "$inv" --turns 2 | sed 's/^/  /'
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "demo: a voice call's turn was not answered"; exit 1; }
step "serving-check on both nodes, over SSH (turns_announced counts the voice calls' turn hints)" && $bin/flatshare check --all --inventory "$inv" || exit $?
step "status" && $bin/flatshare status --inventory "$inv"
