"""The names of the systemd units flatshare-ops renders, installs and checks (standard library only).

The renderer writes them, the node switches them and serving-check reads
them: one list, here.
"""

ENGINE_UNIT = "flatshare-engine.service"
GATEWAY_UNIT = "flatshare-gateway.service"
#: The variable the rendered gateway (and voice) unit passes the profile's gateway.url in.
GATEWAY_URL_VARIABLE = "FLATSHARE_GATEWAY_URL"
#: The voice unit's environment: the file whose presence drains the worker, and the file it writes its state to.
VOICE_DRAIN_VARIABLE = "FLATSHARE_DRAIN_FILE"
VOICE_STATUS_VARIABLE = "FLATSHARE_DRAIN_STATUS"
#: Their names, in the profile's ``layout.run_dir`` (render/units.py): a path of another name is never one of them.
VOICE_DRAIN_NAME, VOICE_STATUS_NAME = "voice.drain", "voice.status"
VOICE_UNIT = "flatshare-voice.service"
#: The voice unit's switch of turn hints (the profile's voice.turn_hints, "1" or "0"; FACTS: it overrides the profile).
TURN_HINTS_VARIABLE = "FLATSHARE_TURN_HINTS"
TARGET_UNIT = "flatshare.target"
CHECK_SERVICE = "serving-check.service"
CHECK_TIMER = "serving-check.timer"

#: Units in the order they are written and installed.
UNIT_NAMES = (ENGINE_UNIT, GATEWAY_UNIT, VOICE_UNIT, TARGET_UNIT, CHECK_SERVICE, CHECK_TIMER)
#: The long-running services a release drains, restarts and checks.
SERVICE_UNITS = (ENGINE_UNIT, GATEWAY_UNIT, VOICE_UNIT)
