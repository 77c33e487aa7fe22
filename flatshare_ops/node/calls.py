"""Whether this node takes calls right now, as a caller would find it (no state of flatshare-ops's own).

A node takes calls when a caller would be served there: its services are
active (systemd), its gateway answers ``GET /health`` 200 and its engine
does too, each within its bound, and no voice drain file is present
(docs/reference/release-protocol.md, "Admission to drain"). What a caller
meets is the only judge, never whether flatshare-ops's own files can be read:

- the answer is ``True`` only when every part was seen serving;
- ``False`` only when something was seen not serving (a service not active,
  a health endpoint that answered otherwise or not within its bound, a drain
  file present) at addresses the node's active release names;
- ``None`` when it could not be established: systemd did not answer, or the
  addresses to ask are not known for sure (the active release is missing or
  damaged, or names no gateway URL). The admission probe of another node
  counts ``None`` as not taking calls; a node's own release counts it as
  taking calls (it asks for admission), so that neither guess can cost the
  fleet its last serving node.

Kept light: the admission probe another node's release waits for imports
only this, the lock table, the release store and the reader of a stored release.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from . import systemd
from ..common import serving_shape
from ..common.files import Damaged, loads
from ..common.release_files import read_release
from ..common.http import HTTP_TIMEOUT_S, http_get
from ..common.units import GATEWAY_UNIT, SERVICE_UNITS
from ..errors import SystemdError
from .context import NodeContext

if TYPE_CHECKING:
    from .output import ReleaseOutput


@dataclass(frozen=True)
class Calls:
    """Whether a node takes calls.

    Attributes:
        takes: True (seen serving), False (seen not serving), None (could not be established).
        reasons: why not, or what could not be established (empty when ``takes`` is True).
    """

    takes: bool | None
    reasons: list[str] = field(default_factory=list)


def active_serving(ctx: NodeContext, current: str | None) -> dict | None:
    """The active release's serving.json, verified with the rest of the release against its id
    (:func:`common.release_files.read_release`); None when there is none, or it is damaged or of the wrong
    shape: an edited serving.json never names the addresses to ask or the drain file to remove (the callers
    fall back to the bundle's, or to nothing; the damage is named where it is read in full: status, the
    switch's plan, serving-check)."""
    if current is None:
        return None
    try:
        files = read_release(ctx.releases / current, current)
        serving = loads(files["serving.json"])
    except (Damaged, ValueError):
        return None
    return serving if isinstance(serving, dict) and not serving_shape.problem(serving) else None


def node_calls(ctx: NodeContext, serving: dict | None, trusted: bool = True, timeout_s: float = HTTP_TIMEOUT_S) -> Calls:
    """Whether this node takes calls right now, as a caller would find it.

    Args:
        ctx: the node.
        serving: the serving.json naming where the gateway, the engine and the drain file are (the
            active release's; None when it cannot be read).
        trusted: ``serving`` is the active release's own. When it is another's (a bundle's, standing in
            for a damaged active release), an endpoint that does not answer may only be the wrong
            address: it then makes the answer unknown (None), never "does not take calls".
        timeout_s: the bound of each health request (seconds).

    Returns:
        A :class:`Calls`.
    """
    try:
        states = systemd.properties(ctx.address, [(u, "Unit", "ActiveState") for u in SERVICE_UNITS])
    except SystemdError as err:
        return Calls(None, [f"systemd did not say whether the services run: {err}"])
    down = [f"{u} is {states[f'{u}/ActiveState']}" for u in SERVICE_UNITS if states[f"{u}/ActiveState"] != "active"]
    if down:
        return Calls(False, down)  # systemd's own word: no file of ours is involved
    if serving is None:
        return Calls(None, ["its services run, but its active release cannot be read (missing or damaged), so "
                            "where its gateway answers is not known"])
    gateway = (serving.get("gateway") or {}).get("url")
    if not isinstance(gateway, str):
        return Calls(None, ["its services run, but its release names no gateway URL (made before gateway.url), "
                            "so what callers meet is not known"])
    seen: list[str] = []
    for what, url in (("gateway", gateway + "/health"), ("engine", serving["engine"]["url"] + "/health")):
        status = http_get(url, timeout_s)[0]
        if status != 200:
            heard = f"answered {status}" if status else f"did not answer within {timeout_s:g} s"
            seen.append(f"its {what}'s {url} {heard}")
    drain_file = Path(serving["voice"]["drain_file"])
    if drain_file.exists():
        seen.append(f"{drain_file} is present (the voice worker is drained)")
    if not seen:
        return Calls(True)
    if not trusted:
        return Calls(None, [f"{reason} (at the new release's addresses: its active release cannot be read)"
                            for reason in seen])
    return Calls(False, seen)


def takes_calls(ctx: NodeContext, serving: dict | None) -> list[str]:
    """Why this node does not take calls, or could not be seen to (empty when it does): see :func:`node_calls`."""
    return node_calls(ctx, serving).reasons


def give_calls_back(ctx: NodeContext, serving: dict | None, out: ReleaseOutput) -> None:
    """With no switch running: remove a voice drain file left behind, and start a stopped gateway
    whose engine answers /health. Never raises: it only ever gives calls back."""
    from . import drain

    if serving is None:
        return
    try:
        drain_file = Path(serving["voice"]["drain_file"])
        url = serving["engine"]["url"] + "/health"
    except (KeyError, TypeError):
        return
    try:
        if drain.end_if_present(drain_file):
            out.line(f"{ctx.node}: removed {drain_file} left behind: the voice worker takes calls again")
    except OSError as err:
        out.line(f"{ctx.node}: could not remove {drain_file} ({err.strerror or err}): the voice worker stays drained")
    try:
        state = systemd.properties(ctx.address, [(GATEWAY_UNIT, "Unit", "ActiveState")])[f"{GATEWAY_UNIT}/ActiveState"]
        if state != "active" and http_get(url, HTTP_TIMEOUT_S)[0] == 200:
            systemd.job(ctx.address, "start", GATEWAY_UNIT, 60,
                        lambda waited: out.line(f"  still waiting for {GATEWAY_UNIT} to start ({waited:.0f} s of 60 s)"))
            out.line(f"{ctx.node}: started {GATEWAY_UNIT} again (the engine answers /health)")
    except SystemdError as err:
        out.line(f"{ctx.node}: could not check or start {GATEWAY_UNIT}: {err}")
