"""What serving-check reads from the node: systemd's view of the units, the engine venv, /metrics, the release lock.

Sources: systemd's D-Bus API, org.freedesktop.systemd1(5) (``MainPID``,
``ExecMainStartTimestamp`` in microseconds since the epoch, ``DropInPaths``,
``NeedDaemonReload``; docs/reference/systemd.md); the vLLM engine venv's
dist-info metadata and the Prometheus text format of ``GET /metrics``
(docs/reference/vllm.md, docs/reference/monitoring.md).
"""

from __future__ import annotations

import os
from pathlib import Path

from ..common.locks import read_holder
from ..common.node_files import LOCK_HOLDER
from ..common.units import VOICE_UNIT


class EngineFacts:
    """What systemd says about the engine unit (gathered once per run).

    Attributes:
        load_state, active_state: the unit's ``LoadState`` and ``ActiveState``.
        main_pid: ``MainPID`` (0 when not running).
        started_at: ``ExecMainStartTimestamp``, in seconds since the epoch.
    """

    __slots__ = ("load_state", "active_state", "main_pid", "started_at")

    def __init__(self, load_state: str, active_state: str, main_pid: int, started_at: float) -> None:
        self.load_state, self.active_state, self.main_pid, self.started_at = (
            load_state, active_state, main_pid, started_at)


def _split_sample(line: str) -> tuple[str, str] | None:
    """(metric name, value) of one Prometheus sample line ``name{labels} value [timestamp]``."""
    brace = line.find("{")
    space = line.find(" ")
    if brace != -1 and (space == -1 or brace < space):
        name, i, quoted = line[:brace], brace + 1, False
        while i < len(line):  # the closing brace, skipping quoted label values (which may hold } and spaces)
            c = line[i]
            if quoted and c == "\\":
                i += 2
                continue
            if c == '"':
                quoted = not quoted
            elif c == "}" and not quoted:
                break
            i += 1
        rest = line[i + 1 :]
    else:
        name, _, rest = line.partition(" ")
    fields = rest.split()
    return (name, fields[0]) if name and fields else None


def parse_metrics(text: str) -> dict[str, float]:
    """Sum Prometheus samples by metric name (labels dropped; an optional timestamp ignored).

    The text exposition format (docs/reference/monitoring.md): ``name{labels} value [timestamp]``,
    comments start with ``#``; a line that is not a sample is skipped, and so is a NaN or infinite value
    (a sum over one is no count; the JSON report never carries one).
    """
    values: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        sample = _split_sample(line)
        if sample is None:
            continue
        try:
            value = float(sample[1])
        except ValueError:
            continue
        if value == value and value not in (float("inf"), float("-inf")):  # NaN and +Inf sum to nothing true
            values[sample[0]] = values.get(sample[0], 0.0) + value
    return values


#: The serve module's lines on the engine's output start with this (docs/reference/vllm.md, "The serve
#: module's lines"): ``flatshare make-room: event=turn engine_pid=P pid=Q turns_announced=N``.
MODULE_LINE_TAG = "flatshare make-room:"


def turns_announced(lines: list[str], main_pid: int) -> float | None:
    """The voice turns the serve module counted since the engine (``main_pid``, the unit's MainPID)
    started, read from the engine's output, newest line first.

    The module prints ``event=start`` when its scheduler starts and ``event=turn ... turns_announced=N``
    at each turn hint, each with ``engine_pid`` (the API server: the engine core is its child). Lines of
    an earlier engine process (another pid) are skipped.

    Returns:
        N from the newest turn line of this engine, 0 when its newest line is its start, None when the
        lines hold neither (the module does not print them, or they fell out of the lines read).
    """
    for line in reversed(lines):
        at = line.find(MODULE_LINE_TAG)
        if at < 0:
            continue
        fields = dict(word.partition("=")[::2] for word in line[at + len(MODULE_LINE_TAG):].split() if "=" in word)
        if str(main_pid) not in (fields.get("engine_pid"), fields.get("pid")):
            continue
        if fields.get("event") == "start":
            return 0.0
        if fields.get("event") == "turn":
            try:
                return float(int(fields.get("turns_announced", "")))
            except ValueError:
                continue
    return None


def lock_holder_record(releases: Path) -> tuple[dict, str | None]:
    """``lock.json``'s holder details (who, which release, since when) and its damage, if any."""
    return read_holder(releases / LOCK_HOLDER)


class SystemdFacts:
    """What systemd says about the release's units, gathered in one bounded exchange.

    Attributes:
        engine: the engine unit's :class:`EngineFacts`.
        states: service -> ``ActiveState``.
        drop_ins: unit -> every drop-in path systemd applies (``DropInPaths``) or will read at the
            next daemon-reload (found on disk where systemd looks, common.drop_ins).
        need_reload: unit -> ``NeedDaemonReload``.
        voice_pid: the voice unit's ``MainPID`` (0: not running, or not one of the release's services).
    """

    __slots__ = ("engine", "states", "drop_ins", "need_reload", "voice_pid")

    def __init__(self, engine: EngineFacts, states: dict, drop_ins: dict, need_reload: dict,
                 voice_pid: int = 0) -> None:
        self.engine, self.states, self.drop_ins, self.need_reload = engine, states, drop_ins, need_reload
        self.voice_pid = voice_pid


def systemd_facts(serving: dict, runtime_dir: Path | None, timeout_s: float) -> SystemdFacts:
    """Ask the node's manager about the release's units (one forked, bounded exchange).

    Raises:
        SystemdError: the manager could not be reached or did not answer within ``timeout_s``
            (the message names the bound).
    """
    from ..common import systemd
    from ..common.drop_ins import on_disk

    scope = serving["layout"]["scope"]
    if scope == "user" and runtime_dir is None:
        runtime_dir = Path(os.environ.get("XDG_RUNTIME_DIR", f"/run/user/{os.getuid()}"))
    engine = serving["engine"]["unit"]
    units = sorted(serving.get("units") or serving["services"])
    queries = [(u, "Unit", p) for u in units for p in ("DropInPaths", "NeedDaemonReload")]
    queries += [(u, "Unit", "ActiveState") for u in serving["services"]]
    queries += [(engine, "Unit", "LoadState"), (engine, "Unit", "ActiveState"), (engine, "Service", "MainPID"),
                (engine, "Service", "ExecMainStartTimestamp"), ("", "Manager", "UnitPath")]
    if VOICE_UNIT in serving["services"]:
        queries.append((VOICE_UNIT, "Service", "MainPID"))
    found = systemd.properties(systemd.ManagerAddress(scope, runtime_dir), queries, timeout_s)
    search = list(found["/UnitPath"]) + [serving["layout"]["unit_dir"]]
    drop_ins = {u: sorted(set(found[f"{u}/DropInPaths"]) | {str(p) for p in on_disk(u, search)}) for u in units}
    return SystemdFacts(
        EngineFacts(found[f"{engine}/LoadState"], found[f"{engine}/ActiveState"], int(found[f"{engine}/MainPID"]),
                    int(found[f"{engine}/ExecMainStartTimestamp"]) / 1e6),
        {u: found[f"{u}/ActiveState"] for u in serving["services"]},
        {u: paths for u, paths in drop_ins.items() if paths},
        {u: bool(found[f"{u}/NeedDaemonReload"]) for u in units},
        int(found.get(f"{VOICE_UNIT}/MainPID", 0)),
    )


def unit_environment(unit_text: str, variable: str) -> str | None:
    """``variable``'s value in a unit's ``Environment=`` assignments (the last one wins, as in
    systemd.exec(5)), or None when the unit assigns none or cannot be read as systemd would."""
    from ..common.unit_file import UnitSyntaxError, meaning

    try:
        assignments = meaning(unit_text).get(("Service", "Environment"), ())
    except UnitSyntaxError:
        return None
    value = None
    for words in assignments:
        for word in words:
            name, equals, rest = word.partition("=")
            if equals and name == variable:
                value = rest
    return value


def active_release(releases: Path) -> str | None:
    """The active release's id: the name ``releases/current`` points at (releases/README.md), or None
    when it is not a link to a release beside it (no release, or damage the ``release`` check names:
    common/current_link.py, the node's own rule)."""
    from ..common.current_link import CurrentLinkError, read_current

    try:
        return read_current(releases)
    except (CurrentLinkError, OSError):
        return None


def switch_started_at(releases: Path) -> float | None:
    """When the switch in ``releases/switching.json`` started (Unix seconds), or None when there is none.

    A switch in progress and one a killed run left are the same file (releases/README.md,
    "switching.json"). Its ``started_at`` when the journal reads as a JSON object with a finite number
    there; otherwise (damaged) the file's last change, which the switch started no later than.
    """
    from ..common.clock import is_time
    from ..common.files import Damaged, read_json_object
    from ..common.node_files import JOURNAL

    journal = releases / JOURNAL
    try:
        record = read_json_object(journal)
    except Damaged:
        record = {}
    if record is None:
        return None
    started = record.get("started_at")
    if is_time(started):
        return float(started)  # the JSON reader refuses NaN and Infinity (common.files); is_time 1e300
    try:
        return os.lstat(journal).st_mtime
    except OSError:
        return None
