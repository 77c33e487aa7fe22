"""Whether this node takes calls right now, as a caller would find it (no state of flatshare-ops's own).

Two readings, each safe in its own direction (docs/reference/release-protocol.md, "Admission to
drain"); what a caller meets is the only judge, never whether flatshare-ops's own files can be read:

- :func:`node_calls`, for the admission probe of *another* node (counted towards ``min_serving``):
  the node takes calls only when every part was seen serving: its services active (systemd), its
  gateway and its engine answering ``GET /health`` 200 within their bounds, no voice drain file, and
  one call through its gateway streamed to its end (a one-token completion).
  Anything else, or anything not established (``None``), counts as not taking calls.
- :func:`served_here`, for *this* node's own drain (whether it needs admission at all): callers are
  served here when any gateway URL the node may answer at answers 200, whatever the units and the
  drain file say; "not served" (no admission needed) only when every such URL answered otherwise, or
  refused the connection while systemd neither runs the gateway nor restarts it by itself; unknown
  (admission asked) when one did not answer in time, refused while the unit may serve, or a release
  that may be serving cannot be read.

Kept light: the admission probe another node's release waits for imports
only this, the lock table, the release store and the reader of a stored release.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..common import serving_shape
from ..common.files import Damaged, loads
from ..common.release_files import read_release
from ..common.http import HTTP_TIMEOUT_S, http_get
from ..common.units import (GATEWAY_UNIT, GATEWAY_URL_VARIABLE, SERVICE_UNITS, VOICE_DRAIN_NAME,
                            VOICE_DRAIN_VARIABLE, VOICE_STATUS_NAME, VOICE_STATUS_VARIABLE, VOICE_UNIT)
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


@dataclass(frozen=True)
class VoiceFiles:
    """Where a voice worker watches for its drain (``drain_file``) and writes its state (``status_file``)."""

    drain_file: Path
    status_file: Path


def loaded_voice_files(ctx: NodeContext) -> VoiceFiles | None:
    """Where the voice worker systemd has loaded watches: the ``FLATSHARE_DRAIN_FILE`` and
    ``FLATSHARE_DRAIN_STATUS`` of the loaded voice unit's ``Environment=`` (``Service.Environment``,
    org.freedesktop.systemd1(5)), whatever ``current`` or a journal says: after a switch killed before it moved
    ``current``, the running worker watches the new release's files, not the active one's.

    Returns:
        The two paths; None when no voice unit is loaded, systemd did not answer, or they are not a drain file
        and its status file (absolute, named ``voice.drain`` and ``voice.status``, in one directory, as every
        release renders them): a path of any other name is never written, removed or believed through this.
    """
    try:
        found = ctx.manager.properties([(VOICE_UNIT, "Unit", "LoadState"),
                                        (VOICE_UNIT, "Service", "Environment")])
    except SystemdError:
        return None
    if found[f"{VOICE_UNIT}/LoadState"] != "loaded":
        return None
    names = {}
    for entry in found[f"{VOICE_UNIT}/Environment"] or []:
        name, _, value = str(entry).partition("=")
        names[name] = value
    drain_file, status_file = Path(names.get(VOICE_DRAIN_VARIABLE, "")), Path(names.get(VOICE_STATUS_VARIABLE, ""))
    if not (drain_file.is_absolute() and drain_file.name == VOICE_DRAIN_NAME and status_file.name == VOICE_STATUS_NAME
            and drain_file.parent == status_file.parent):
        return None
    return VoiceFiles(drain_file, status_file)


def drain_files(ctx: NodeContext, serving: dict | None) -> list[Path]:
    """Every file whose presence drains this node's voice worker: the one the worker systemd runs watches
    (:func:`loaded_voice_files`) and the one ``serving`` (a release's serving.json) names, each once."""
    paths = []
    loaded = loaded_voice_files(ctx)
    if loaded is not None:
        paths.append(loaded.drain_file)
    named = ((serving or {}).get("voice") or {}).get("drain_file")
    if isinstance(named, str):
        paths.append(Path(named))
    return list(dict.fromkeys(paths))


def services_down(ctx: NodeContext) -> list[str]:
    """The managed services that are not active (``UNIT is STATE``, systemd's ActiveState), in unit order.

    Raises:
        SystemdError: the manager did not answer within its bound.
    """
    states = ctx.manager.properties([(u, "Unit", "ActiveState") for u in SERVICE_UNITS])
    return [f"{u} is {states[f'{u}/ActiveState']}" for u in SERVICE_UNITS if states[f"{u}/ActiveState"] != "active"]


def node_calls(ctx: NodeContext, serving: dict | None, timeout_s: float = HTTP_TIMEOUT_S,
               call_timeout_s: float | None = None) -> Calls:
    """Whether this node takes calls right now, as a caller would find it: the strict reading, for the
    admission probe of another node's drain (anything short of every part seen serving counts against it).
    Once every part answers, one call is placed through the gateway (:func:`call_problem`): a gateway whose
    /health says 200 while its calls fail or hang takes no calls.

    Args:
        ctx: the node.
        serving: the serving.json naming where the gateway, the engine and the drain file are (the
            active release's; None when it cannot be read).
        timeout_s: the bound of each health request (seconds).
        call_timeout_s: the bound of the call (seconds; :data:`CALL_TIMEOUT_S` when None).

    Returns:
        A :class:`Calls`.
    """
    call_timeout_s = CALL_TIMEOUT_S if call_timeout_s is None else call_timeout_s
    try:
        down = services_down(ctx)
    except SystemdError as err:
        return Calls(None, [f"systemd did not say whether the services run: {err}"])
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
    for drain_file in drain_files(ctx, serving):
        if drain_file.exists():
            seen.append(f"{drain_file} is present (the voice worker is drained)")
    if not seen:
        problem = call_problem(gateway, call_timeout_s)
        if problem is None:
            return Calls(True)
        seen.append(problem)
    return Calls(False, seen)


#: The bound of the probe's call through the gateway (seconds): its answer streamed to ``[DONE]``.
CALL_TIMEOUT_S = 10.0
#: The probe call's request id prefix (``X-Request-Id``; vLLM answers ``cmpl-`` + it): its requests are told
#: apart from callers' in the engine's and the gateway's logs.
PROBE_REQUEST_ID = "flatshare-admission-probe"
#: The request id prefix of the call the switch's serving-check step places through its own node's gateway.
SWITCH_CHECK_REQUEST_ID = "flatshare-switch-check"


def call_problem(gateway: str, timeout_s: float = CALL_TIMEOUT_S, request_id: str = PROBE_REQUEST_ID) -> str | None:
    """Place one call through the gateway as a caller would: a streamed completion of one token
    (common/completions.py; no ``model``: vLLM answers with its served model), read to ``[DONE]``.

    Args:
        gateway: the gateway's base URL (``http://HOST:PORT``).
        timeout_s: the bound of the whole call (seconds).
        request_id: the request id's prefix (``X-Request-Id``), which tells the call from callers' in the logs.

    Returns:
        None when it generated a token and ended with ``[DONE]`` and no error event; else what the caller met,
        one line. A token is counted from the engine's own usage chunk (``completion_tokens``) as well as from
        chunks carrying text: a token whose text is empty (a special token, which vLLM's detokenizer skips) is
        still a token the engine served (the real engine's random weights sample one now and then).
    """
    import uuid

    from ..common.completions import post_completion, request_body

    outcome = post_completion(gateway, request_body("w1", 1), f"{request_id}-{uuid.uuid4().hex[:12]}",
                              timeout_s)
    generated = max(outcome.tokens, outcome.completion_tokens or 0)
    if outcome.error is None and outcome.done and generated >= 1:
        return None
    what = outcome.error or ("streamed no token" if outcome.done else "ended without [DONE]")
    return f"a call through its gateway {gateway} failed ({what})"


#: The gateway unit's ActiveStates in which systemd runs it or is about to run it again (org.freedesktop.systemd1(5);
#: a unit waiting out ``RestartSec=`` after a crash is ``activating``, sub-state ``auto-restart``): a refused
#: connection then is a moment, not "nothing serves here".
GATEWAY_MAY_SERVE = ("active", "activating", "reloading", "deactivating", "refreshing")


@dataclass(frozen=True)
class GatewayUnit:
    """The gateway unit as systemd holds it now.

    Attributes:
        url: the ``FLATSHARE_GATEWAY_URL`` of its loaded ``Environment=`` (where the running gateway answers,
            whatever ``current`` or a journal says); None when no gateway unit is loaded or it sets none.
        state: its ``ActiveState`` and ``SubState`` (``"activating (auto-restart)"``), and whether a job is
            queued for it; None when not loaded.
        may_serve: systemd runs it or will run it by itself (:data:`GATEWAY_MAY_SERVE`, or a job queued for it:
            a start waiting for the engine's, ``After=``).
        comes_back: systemd is starting it again (``activating``, or a job queued: a restart whose stop drains it,
            answering 503 meanwhile): an answer other than 200 then is a moment too.
    """

    url: str | None
    state: str | None
    may_serve: bool
    comes_back: bool = False


def gateway_unit(ctx: NodeContext, unknown: list[str]) -> GatewayUnit | None:
    """The gateway unit systemd has loaded: its URL and its state (``Service.Environment``, ``Unit.ActiveState``,
    ``Unit.SubState``, org.freedesktop.systemd1(5)).

    Returns:
        A :class:`GatewayUnit`; None when systemd did not answer (a line is added to ``unknown``).
    """
    try:
        found = ctx.manager.properties([(GATEWAY_UNIT, "Unit", "LoadState"),
                                        (GATEWAY_UNIT, "Unit", "ActiveState"),
                                        (GATEWAY_UNIT, "Unit", "SubState"),
                                        (GATEWAY_UNIT, "Unit", "Job"),
                                        (GATEWAY_UNIT, "Service", "Environment")])
    except SystemdError as err:
        unknown.append(f"systemd did not say where its gateway unit answers: {err}")
        return None
    if found[f"{GATEWAY_UNIT}/LoadState"] != "loaded":
        return GatewayUnit(None, None, False)
    active = str(found[f"{GATEWAY_UNIT}/ActiveState"])
    url = None
    for entry in found[f"{GATEWAY_UNIT}/Environment"] or []:
        name, _, value = str(entry).partition("=")
        if name == GATEWAY_URL_VARIABLE and value:
            url = value.rstrip("/")
    job = found[f"{GATEWAY_UNIT}/Job"]  # (id, path); id 0 when no job is queued
    queued = isinstance(job, (tuple, list)) and len(job) == 2 and str(job[0]).isdigit() and int(job[0]) != 0
    state = f"{active} ({found[f'{GATEWAY_UNIT}/SubState']})" + (", a job queued" if queued else "")
    return GatewayUnit(url, state, active in GATEWAY_MAY_SERVE or queued, active == "activating" or queued)


def served_here(ctx: NodeContext, releases: list[str | None], new: dict, timeout_s: float = HTTP_TIMEOUT_S) -> Calls:
    """Whether callers are served at this node's gateway now: the node's own side of the admission to drain.

    Here the unsafe answer is "not served" (the drain then asks no one), so it is given only when callers
    certainly meet no serving gateway: every gateway URL the node may answer at (the one the gateway unit
    systemd has loaded runs with, whatever our files say; each release in ``releases``, the active one and
    the one an interrupted switch was leaving or going to; and the new release) answered other than 200 while
    systemd is not starting the gateway again (a restart drains it with 503s first), or refused the connection
    while systemd neither runs the gateway unit nor starts it again by itself (:data:`GATEWAY_MAY_SERVE`: a
    gateway crashed and waiting out ``RestartSec=`` serves again in a moment).
    Neither the other units' states nor a voice drain file decide it: a gateway answering 200 serves its callers
    whatever they say. The answer is unknown (the drain then asks) when a URL did not answer within the bound,
    refused while the unit may serve, or when one of ``releases`` cannot be read (where its gateway answers is
    then not known).

    Args:
        ctx: the node.
        releases: ids of the releases the node may be serving from (None entries are skipped).
        new: the new release's serving.json.
        timeout_s: the bound of each health request (seconds).

    Returns:
        A :class:`Calls`: True (a gateway answered 200), False (none serves: the reasons say what each URL
        did), None (not known; the reasons say why).
    """
    from ..common.http import REFUSED, http_fetch

    unknown: list[str] = []
    unit = gateway_unit(ctx, unknown)
    urls = []
    for rid in dict.fromkeys(r for r in releases if r):
        serving = active_serving(ctx, rid)
        if serving is None:
            unknown.append(f"release {rid}'s files cannot be read (missing or damaged), so where its gateway "
                           "answers is not known")
        else:
            urls.append((serving.get("gateway") or {}).get("url"))
    urls.append((new.get("gateway") or {}).get("url"))
    if any(not isinstance(url, str) for url in urls):
        unknown.append("a release names no gateway URL (made before gateway.url), so what callers meet is not known")
    if unit is not None and unit.url:
        urls.insert(0, unit.url)
    not_served: list[str] = []
    for url in dict.fromkeys(u for u in urls if isinstance(u, str)):
        status, _, why = http_fetch(url + "/health", timeout_s)
        if status == 200:
            return Calls(True)
        if status and unit is not None and unit.comes_back:
            unknown.append(f"its gateway's {url}/health answered {status}, but systemd has {GATEWAY_UNIT} {unit.state}: "
                           "it starts it again by itself, so callers may be served in a moment")
        elif status:
            not_served.append(f"its gateway's {url}/health answered {status}")
        elif why == REFUSED and unit is not None and unit.may_serve:
            unknown.append(f"its gateway's {url}/health {why}, but systemd has {GATEWAY_UNIT} {unit.state}: it "
                           "runs it, or starts it again by itself, so callers may be served in a moment")
        elif why == REFUSED:
            not_served.append(f"its gateway's {url}/health {why}")
        else:
            unknown.append(f"its gateway's {url}/health {why}")
    if unknown:
        return Calls(None, unknown + not_served)
    return Calls(False, not_served)


def give_calls_back(ctx: NodeContext, serving: dict | None, out: ReleaseOutput) -> None:
    """With no switch running: remove a voice drain file left behind (where the running worker watches, and where
    ``serving`` names it: :func:`drain_files`), and start a stopped gateway whose engine answers /health. Never
    raises: it only ever gives calls back."""
    from . import drain

    if serving is None:
        return
    try:
        url = serving["engine"]["url"] + "/health"
    except (KeyError, TypeError):
        return
    for drain_file in drain_files(ctx, serving):
        try:
            if drain.end_if_present(drain_file):
                out.line(f"{ctx.node}: removed {drain_file} left behind: the voice worker takes calls again")
        except OSError as err:
            out.line(f"{ctx.node}: could not remove {drain_file} ({err.strerror or err}): the voice worker stays "
                     "drained")
    try:
        state = ctx.manager.properties([(GATEWAY_UNIT, "Unit", "ActiveState")])[f"{GATEWAY_UNIT}/ActiveState"]
        if state != "active" and http_get(url, HTTP_TIMEOUT_S)[0] == 200:
            ctx.manager.job("start", GATEWAY_UNIT, 60,
                            lambda waited: out.waiting(f"{GATEWAY_UNIT} to start", waited, 60))
            out.line(f"{ctx.node}: started {GATEWAY_UNIT} again (the engine answers /health)")
    except SystemdError as err:
        out.line(f"{ctx.node}: could not check or start {GATEWAY_UNIT}: {err}")
