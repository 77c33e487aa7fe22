"""Whether the node takes calls, decided from what serving-check has gathered (pure).

The same rule as the admission to drain (docs/reference/release-protocol.md, "Admission to drain";
``node/calls.py`` asks for it on its own): a node takes calls when a caller would be served there,
that is its managed services are active, its gateway and its engine answer ``GET /health`` 200, and
no voice drain file is present. serving-check has the services' states and the engine's answer from
its checks; the gateway's answer is one more bounded probe (``check/run.py``). Written as a series
for the alert on ``min_serving`` (PRODUCTION.md, "serving-check").
"""

from __future__ import annotations


def takes_calls(states: dict[str, str], engine_health: int, gateway_health: int, drain_present: bool) -> bool:
    """True when every part was seen serving.

    Args:
        states: managed service unit -> its ``ActiveState`` (systemd).
        engine_health, gateway_health: the HTTP status ``/health`` answered (0: nothing answered in time).
        drain_present: the voice drain file exists.
    """
    return (all(state == "active" for state in states.values()) and engine_health == 200
            and gateway_health == 200 and not drain_present)
