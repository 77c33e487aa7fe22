"""Whether this node takes calls right now, read from what serves them (no state of flatshare-ops's own).

A node takes calls when its services are active, its engine answers
``/health`` and no voice drain file is present (docs/reference/release-protocol.md,
"Admission to drain"). Kept light: the admission probe another node's release
waits for imports only this, the lock table and the release store.
"""

from __future__ import annotations

from pathlib import Path

from .. import systemd
from ..common import serving_shape
from ..common.files import Damaged, read_json_object
from ..common.http import HTTP_TIMEOUT_S, http_get
from ..common.units import SERVICE_UNITS
from ..errors import SystemdError
from .context import NodeContext


def active_serving(ctx: NodeContext, current: str | None) -> dict | None:
    """The active release's serving.json, or None when there is none or it is damaged or of the wrong shape
    (the callers fall back to the bundle's, or to nothing; the damage is named where it is read in full)."""
    if current is None:
        return None
    try:
        serving = read_json_object(ctx.releases / current / "serving.json")
    except Damaged:
        return None
    return serving if serving is not None and not serving_shape.problem(serving) else None


def takes_calls(ctx: NodeContext, serving: dict | None) -> list[str]:
    """Why this node does not take calls right now (empty when it does): its services are active,
    its engine answers /health and no voice drain file is present."""
    if serving is None:
        return ["no active release"]
    problems = []
    try:
        states = systemd.properties(ctx.address, [(u, "Unit", "ActiveState") for u in SERVICE_UNITS])
    except SystemdError as err:
        return [str(err)]
    problems += [f"{u} is {states[f'{u}/ActiveState']}" for u in SERVICE_UNITS if states[f"{u}/ActiveState"] != "active"]
    try:
        url = serving["engine"]["url"] + "/health"
        drain_file = Path(serving["voice"]["drain_file"])
    except (KeyError, TypeError):
        return ["the active release's serving.json is damaged"]
    status = http_get(url, HTTP_TIMEOUT_S)[0]
    if status != 200:
        problems.append(f"{url} answered {status or 'nothing'}")
    if drain_file.exists():
        problems.append(f"{drain_file} is present (the voice worker is drained)")
    return problems
