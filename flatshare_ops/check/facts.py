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

from ..common.files import Damaged, read_json_object
from ..common.node_files import LOCK_HOLDER
from ..common.proc import pid_alive


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


def installed_vllm(venv: Path) -> str | None:
    """The vLLM release installed in a venv: the ``Version:`` field of its
    ``vllm-*.dist-info/METADATA`` (the core metadata file, PEP 566), read
    without importing vLLM or importlib.metadata (which pulls in the email package).
    """
    for metadata in sorted(Path(venv).glob("lib/python*/site-packages/vllm-*.dist-info/METADATA")):
        try:
            with open(metadata, encoding="utf-8", errors="replace") as f:
                for line in f:
                    if line.startswith("Version:"):
                        return line.split(":", 1)[1].strip()
                    if not line.strip():
                        break  # the headers end at the first blank line
        except OSError:
            continue
    return None


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
    comments start with ``#``; a line that is not a sample is skipped.
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
            values[sample[0]] = values.get(sample[0], 0.0) + float(sample[1])
        except ValueError:
            continue
    return values


def lock_holder_record(releases: Path) -> dict:
    """``lock.json``'s holder details (who, which release, since when), or {} when missing or damaged."""
    try:
        return read_json_object(releases / LOCK_HOLDER) or {}
    except Damaged:
        return {}


def release_holder(releases: Path) -> dict | None:
    """The live holder of the node's release lock (``lock.json``, its pid alive on this host), or None."""
    holder = lock_holder_record(releases)
    try:
        alive = bool(holder) and holder.get("host") == os.uname().nodename and pid_alive(int(holder.get("pid", 0)))
    except (TypeError, ValueError):
        return None
    return holder if alive else None


def systemd_facts(serving: dict, runtime_dir: Path | None) -> tuple[EngineFacts, dict, dict, dict[str, str]]:
    """(engine facts, DropInPaths per service, NeedDaemonReload per service, ActiveState per service).

    Raises:
        SystemdError: the manager could not be reached.
    """
    from ..systemd import ManagerAddress, connect, unit_property

    scope = serving["layout"]["scope"]
    if scope == "user" and runtime_dir is None:
        runtime_dir = Path(os.environ.get("XDG_RUNTIME_DIR", f"/run/user/{os.getuid()}"))
    drop_ins: dict[str, list[str]] = {}
    need_reload: dict[str, bool] = {}
    states: dict[str, str] = {}
    with connect(ManagerAddress(scope, runtime_dir)) as bus:
        # Single properties (Properties.Get): GetAll of a service is ~2 ms each.
        for name in serving["services"]:
            drop_ins[name] = [p.decode() for p in unit_property(bus, name, "Unit", "DropInPaths")]
            need_reload[name] = bool(unit_property(bus, name, "Unit", "NeedDaemonReload"))
            states[name] = unit_property(bus, name, "Unit", "ActiveState").decode()
        name = serving["engine"]["unit"]
        facts = EngineFacts(
            load_state=unit_property(bus, name, "Unit", "LoadState").decode(),
            active_state=unit_property(bus, name, "Unit", "ActiveState").decode(),
            main_pid=int(unit_property(bus, name, "Service", "MainPID")),
            started_at=int(unit_property(bus, name, "Service", "ExecMainStartTimestamp")) / 1e6,
        )
    return facts, drop_ins, need_reload, states
