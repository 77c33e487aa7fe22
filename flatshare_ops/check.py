"""serving-check's checks: is the running engine what the node's active release says?

Each check is a function returning :class:`Finding` objects. The local path
imports only the standard library and pystemd (for systemd's view of the
engine unit): it runs every minute on every node, so no SSH, templates,
pydantic or CLI framework is loaded here.

Sources: Nagios plugin guidelines (exit 0 OK, 1 WARNING, 2 CRITICAL,
3 UNKNOWN); systemd's D-Bus API, org.freedesktop.systemd1(5) (``MainPID``,
``ExecMainStartTimestamp`` in microseconds since the epoch, ``DropInPaths``,
``NeedDaemonReload``); vLLM's ``GET /version`` and ``GET /metrics``.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from .node_files import CURRENT, JOURNAL, LOCK_HOLDER, RELEASES
from .pids import pid_alive

OK, WARNING, CRITICAL, UNKNOWN = "OK", "WARNING", "CRITICAL", "UNKNOWN"
EXIT_CODES = {OK: 0, WARNING: 1, CRITICAL: 2, UNKNOWN: 3}
_SEVERITY = {OK: 0, WARNING: 1, UNKNOWN: 2, CRITICAL: 3}  # CRITICAL outranks UNKNOWN in the summary

#: The serving.json keys a check reads (releases/README.md).
SERVING_KEYS = ("engine", "vllm_release", "module", "units", "services", "layout", "voice")

#: A release lock older than this (seconds) is no longer "a release in progress" but a warning.
STALE_LOCK_S = 3600.0
HTTP_TIMEOUT_S = 2.0


# Plain classes, not dataclasses: importing dataclasses pulls in inspect
# (about 5 ms), and this module runs every minute on every node.


class Finding:
    """One check's result.

    Attributes:
        check: the check's name (``engine_unit``, ``flags``, ``vllm_release``...).
        status: ``OK``, ``WARNING``, ``CRITICAL`` or ``UNKNOWN``.
        summary: one line for people.
        details: one line per difference (``--flag: running X, profile Y``).
    """

    __slots__ = ("check", "status", "summary", "details")

    def __init__(self, check: str, status: str, summary: str, details: list[str] | None = None) -> None:
        self.check, self.status, self.summary, self.details = check, status, summary, list(details or [])

    def to_json(self) -> dict:
        """The finding as a JSON-ready dict."""
        return {"check": self.check, "status": self.status, "summary": self.summary, "details": self.details}

    def __repr__(self) -> str:
        return f"Finding({self.check!r}, {self.status!r}, {self.summary!r}, {self.details!r})"


class Report:
    """All findings of one run, and the values reported as perfdata."""

    __slots__ = ("node", "findings", "perfdata")

    def __init__(self, node: str, findings: list[Finding], perfdata: dict[str, float] | None = None) -> None:
        self.node, self.findings, self.perfdata = node, findings, dict(perfdata or {})

    @property
    def status(self) -> str:
        """The worst status among the findings."""
        return max((f.status for f in self.findings), key=_SEVERITY.__getitem__, default=OK)

    @property
    def exit_code(self) -> int:
        """The Nagios exit code of :attr:`status`."""
        return EXIT_CODES[self.status]

    def to_json(self) -> dict:
        """The report as a JSON-ready dict."""
        return {"schema": 1, "node": self.node, "status": self.status, "exit_code": self.exit_code,
                "findings": [f.to_json() for f in self.findings], "perfdata": self.perfdata}


# --- the engine's argv, compared by meaning --------------------------------


def _parse_dotted_value(text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _merge_into(target: dict, path: list[str], value: object) -> None:
    for part in path[:-1]:
        target = target.setdefault(part, {})
    target[path[-1]] = value


def _flatten(prefix: str, value: object, out: dict[str, object]) -> None:
    if isinstance(value, dict):
        for key, inner in value.items():
            _flatten(f"{prefix}.{key}", inner, out)
    else:
        out[prefix] = value


def normalize_argv(argv: list[str]) -> tuple[str | None, dict[str, object]]:
    """Read a ``vllm serve`` command line into (model, {flag: value}) by meaning.

    ``--flag=value`` and ``--flag value`` are the same; ``--x`` is ``x: True``
    and ``--no-x`` is ``x: False``; flag order does not matter; the JSON form
    ``--additional-config '{"a": {"b": 1}}'`` and the dotted form
    ``--additional-config.a.b 1`` both become ``--additional-config.a.b: 1``
    (vLLM reads dotted values with ``json.loads``; FACTS.md). The interpreter
    and script in front of ``serve`` are ignored.

    Returns:
        (the model, or None if there is no ``serve``; flag name -> value).
    """
    if "serve" not in argv:
        return None, {}
    words = argv[argv.index("serve") + 1 :]
    model = words[0] if words and not words[0].startswith("--") else None
    words = words[1:] if model is not None else words
    flags: dict[str, object] = {}
    additional: dict = {}
    i = 0
    while i < len(words):
        word = words[i]
        name, eq, inline = word.partition("=")
        if eq:
            value: object = inline
            i += 1
        elif i + 1 < len(words) and not words[i + 1].startswith("--"):
            value = words[i + 1]
            i += 2
        else:
            value = None
            i += 1
        if name == "--additional-config" and isinstance(value, str):
            parsed = _parse_dotted_value(value)
            if isinstance(parsed, dict):
                for key, inner in parsed.items():
                    _merge_into(additional, [key], inner)
            continue
        if name.startswith("--additional-config."):
            _merge_into(additional, name.removeprefix("--additional-config.").split("."),
                        _parse_dotted_value(value) if isinstance(value, str) else True)
            continue
        if value is None:
            if name.startswith("--no-"):
                flags["--" + name.removeprefix("--no-")] = False
            else:
                flags[name] = True
        else:
            flags[name] = value
    _flatten("--additional-config", additional, flags) if additional else None
    return model, flags


def _same(a: object, b: object) -> bool:
    if a == b:
        return True
    try:
        return float(a) == float(b)  # "0.9" and "0.90", "24" and "24.0"
    except (TypeError, ValueError):
        return False


def show_flag_value(value: object) -> str:
    """A flag's value for people: ``on``/``off`` for booleans, ``(absent)`` for None, else its text."""
    if value is True:
        return "on"
    if value is False:
        return "off"
    if value is None:
        return "(absent)"
    return json.dumps(value) if not isinstance(value, str) else value


def compare_argv(running: list[str], expected: list[str]) -> list[str]:
    """Differences between a running engine's argv and the release's, one line each.

    Returns:
        Lines like ``--additional-config.make_room.decode_hold_tokens: running 0, profile 48``,
        ``--max-num-seqs: missing (profile 32)``, ``--enforce-eager: extra (running on)``; empty when equal.
    """
    run_model, run_flags = normalize_argv(running)
    exp_model, exp_flags = normalize_argv(expected)
    lines = []
    if run_model != exp_model:
        lines.append(f"model: running {run_model}, profile {exp_model}")
    for name in sorted(set(run_flags) | set(exp_flags)):
        if name not in run_flags:
            lines.append(f"{name}: missing (profile {show_flag_value(exp_flags[name])})")
        elif name not in exp_flags:
            lines.append(f"{name}: extra (running {show_flag_value(run_flags[name])})")
        elif not _same(run_flags[name], exp_flags[name]):
            lines.append(f"{name}: running {show_flag_value(run_flags[name])}, profile {show_flag_value(exp_flags[name])}")
    return lines


# --- probes ----------------------------------------------------------------


def http_get(url: str) -> tuple[int, bytes]:
    """GET ``http://HOST:PORT/PATH`` with HTTP/1.0; returns (status, body), status 0 when nothing answers.

    A plain socket rather than urllib: urllib and http.client import the
    email package (about 25 ms), a third of a check's cost; the engine's
    endpoints need nothing beyond a status line and a body.
    """
    import socket

    rest = url.removeprefix("http://")
    hostport, _, path = rest.partition("/")
    host, _, port = hostport.rpartition(":")
    host = host.strip("[]")
    try:
        with socket.create_connection((host, int(port)), timeout=HTTP_TIMEOUT_S) as conn:
            conn.sendall(f"GET /{path} HTTP/1.0\r\nHost: {hostport}\r\nConnection: close\r\n\r\n".encode())
            chunks = []
            while chunk := conn.recv(65536):
                chunks.append(chunk)
    except (OSError, ValueError):
        return 0, b""
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    try:
        return int(head.split(b" ", 2)[1]), body
    except (IndexError, ValueError):
        return 0, b""


def read_cmdline(pid: int) -> list[str]:
    """A process's argv from ``/proc/PID/cmdline``."""
    raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    return [word.decode(errors="replace") for word in raw.split(b"\0")[:-1]]


def sha256_file(path: Path) -> str:
    """sha256 (hex) of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def installed_vllm(venv: Path) -> str | None:
    """The vLLM release installed in a venv: the ``Version:`` field of its
    ``vllm-*.dist-info/METADATA`` (the core metadata file, PEP 566), read
    without importing vLLM or importlib.metadata (which pulls in the email package).
    """
    for metadata in sorted(Path(venv).glob("lib/python*/site-packages/vllm-*.dist-info/METADATA")):
        with open(metadata, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("Version:"):
                    return line.split(":", 1)[1].strip()
                if not line.strip():
                    break  # the headers end at the first blank line
    return None


def wait_healthy(url: str, timeout_s: float) -> None:
    """Poll ``url`` (a service's own health endpoint) until it answers 200, for at most ``timeout_s`` seconds.

    Raises:
        FlatshareError: no 200 in time (the message says whether anything answered).
    """
    from .errors import FlatshareError

    deadline = time.monotonic() + timeout_s
    status = 0
    while time.monotonic() < deadline:
        status = http_get(url)[0]
        if status == 200:
            return
        time.sleep(0.1)
    heard = f"last answer {status}" if status else "nothing answered"
    raise FlatshareError(f"{url} did not answer 200 within {timeout_s:g} s ({heard})")


def parse_metrics(text: str) -> dict[str, float]:
    """Sum Prometheus samples by metric name (labels dropped)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_part, _, value = line.rpartition(" ")
        name = name_part.split("{", 1)[0]
        try:
            values[name] = values.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return values


# --- the checks --------------------------------------------------------------


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


def check_engine_unit(facts: EngineFacts, unit: str) -> Finding:
    """The engine unit is loaded, active and has a main process."""
    if facts.load_state != "loaded":
        return Finding("engine_unit", CRITICAL, f"{unit} is {facts.load_state}, not loaded")
    if facts.active_state != "active" or not facts.main_pid:
        return Finding("engine_unit", CRITICAL, f"{unit} is {facts.active_state}, not running")
    return Finding("engine_unit", OK, f"{unit} active, main pid {facts.main_pid}")


def check_flags(running: list[str], expected: list[str]) -> Finding:
    """The running engine's flags mean what the release's argv means."""
    differences = compare_argv(running, expected)
    if differences:
        return Finding("flags", CRITICAL, f"{len(differences)} engine flag(s) differ from the profile", differences)
    return Finding("flags", OK, "engine flags match the profile")


def check_vllm_release(version_status: int, version_body: bytes, installed: str | None, expected: str) -> Finding:
    """``GET /version`` and the venv's installed vLLM both equal the profile's release."""
    details = []
    answered = None
    if version_status == 200:
        try:
            answered = json.loads(version_body).get("version")
        except (json.JSONDecodeError, AttributeError):
            answered = None
    if answered != expected:
        details.append(f"GET /version: running {answered if answered else 'no answer'}, profile {expected}")
    if installed != expected:
        details.append(f"engine venv: installed {installed or 'none'}, profile {expected}")
    if details:
        return Finding("vllm_release", CRITICAL, f"vLLM release is not {expected}", details)
    return Finding("vllm_release", OK, f"vLLM {expected} running and installed")


def check_module(path: Path, pin: str, started_at: float) -> Finding:
    """The serve module's sha256 equals the pin, and it has not changed since the engine started."""
    try:
        digest = sha256_file(path)
        modified = path.stat().st_mtime
    except FileNotFoundError:
        return Finding("module", CRITICAL, f"serve module {path} is missing")
    details = []
    if digest != pin:
        details.append(f"{path}: sha256 {digest}, profile pins {pin}")
    if started_at and modified > started_at:
        details.append(
            f"{path} changed at {_stamp(modified)}, after the engine started at {_stamp(started_at)}: "
            "the engine may run another module; restart it"
        )
    if details:
        return Finding("module", CRITICAL, "serve module differs from what the engine should run", details)
    return Finding("module", OK, f"serve module sha256 {pin[:12]}... as pinned")


def _stamp(epoch: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))


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
        if actual != digest:
            details.append(f"{name}: installed file differs from the release (sha256 {actual[:12]}, release {digest[:12]})")
    if details:
        return Finding("units", CRITICAL, f"{len(details)} installed unit(s) differ from the release", details)
    return Finding("units", OK, f"{len(expected)} installed units match the release")


def check_drop_ins(drop_ins: dict[str, list[str]], need_reload: dict[str, bool], node: str) -> Finding:
    """Drop-ins on managed units (E2 benchmark drop-ins are symlinks) and pending daemon-reloads."""
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


def _with_unloaded_links(drop_ins: dict[str, list[str]], unit_dir: Path) -> dict[str, list[str]]:
    """systemd's DropInPaths, plus drop-in symlinks linked in the unit directory since the last
    daemon-reload (systemd lists them only after one; a release's reload would apply them)."""
    merged = {}
    for unit, paths in drop_ins.items():
        on_disk = [str(p) for p in sorted((unit_dir / f"{unit}.d").glob("*.conf")) if p.is_symlink()]
        merged[unit] = sorted(set(paths) | set(on_disk))
    return {unit: paths for unit, paths in merged.items() if paths}


def check_turn_hints(metrics: dict[str, float]) -> Finding:
    """Calls running but no voice turn ever announced: the hints do not reach the engine."""
    running = metrics.get("vllm:num_requests_running", 0.0)
    turns = metrics.get("flatshare:make_room_turns_announced_total")
    if turns is None:
        return Finding("turn_hints", WARNING, "engine metrics have no make-room turn counter")
    if running > 0 and turns == 0:
        return Finding(
            "turn_hints", WARNING,
            f"{running:g} request(s) running but no voice turn announced since the engine started: "
            "turn hints are not reaching make-room (check FLATSHARE_TURN_HINTS on the voice worker)",
        )
    return Finding("turn_hints", OK, f"{turns:g} voice turn(s) announced")


# --- one run -------------------------------------------------------------------


def read_json_object(path: Path) -> dict | None:
    """A JSON object from ``path``; None when missing; raises ValueError when it is anything else."""
    try:
        document = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: unreadable ({err})") from None
    if not isinstance(document, dict):
        raise ValueError(f"{path}: not a JSON object")
    return document


def release_holder(releases: Path) -> dict | None:
    """The live holder of the node's release lock (``lock.json``, its pid alive on this host), or None."""
    try:
        holder = read_json_object(releases / LOCK_HOLDER)
    except ValueError:
        return None
    try:
        alive = holder is not None and holder.get("host") == os.uname().nodename and pid_alive(int(holder.get("pid", 0)))
    except (TypeError, ValueError):
        return None
    return holder if alive else None


def _release_state(releases: Path) -> tuple[Finding | None, Finding | None]:
    """(a finding that ends the run because a release holds the lock, a finding about an unfinished switch)."""
    in_progress = None
    holder = release_holder(releases)
    if holder:
        age = time.time() - float(holder.get("started_at", time.time()))
        who = f"{holder.get('user')}@{holder.get('host')} pid {holder.get('pid')}, release {holder.get('release')}"
        if age > STALE_LOCK_S:
            in_progress = Finding("release", WARNING, f"a release has held the lock for {age:.0f} s ({who})")
        else:
            in_progress = Finding("release", OK, f"release in progress ({who}, {age:.0f} s); checks skipped")
    unfinished = None
    journal = releases / JOURNAL
    if in_progress is None and (journal.exists() or journal.is_symlink()):
        try:
            record = read_json_object(journal) or {}
            if not isinstance(record.get("to"), str):
                raise ValueError("no target release")
            what = f"from {record.get('from')} to {record.get('to')}, started by pid {record.get('pid')}"
        except ValueError:
            unfinished = Finding("release", WARNING, f"unfinished switch (journal unreadable): check the node "
                                 f"('flatshare status'), then move {journal} aside (releases/README.md)")
            return in_progress, unfinished
        unfinished = Finding("release", WARNING, f"unfinished switch ({what}); run 'flatshare release' to finish "
                             "it, or 'flatshare rollback' to abandon it")
    return in_progress, unfinished


def _systemd_facts(serving: dict, runtime_dir: Path | None) -> tuple[EngineFacts, dict, dict, dict[str, str]]:
    from .systemd import ManagerAddress, connect, unit_property

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


def run_checks(state_dir: Path, node: str, runtime_dir: Path | None = None, inside_release: bool = False) -> Report:
    """Check this node's running engine against its active release.

    Args:
        state_dir: the node's state directory (``/var/lib/flatshare``).
        node: the node's name, for messages.
        runtime_dir: a user-scope manager's ``XDG_RUNTIME_DIR`` (default: the environment's).
        inside_release: run by the release holding the lock (its last step): skip the release-state check.

    Returns:
        A :class:`Report`. UNKNOWN findings are the check's own trouble (no
        serving.json, no D-Bus); a drifted engine is WARNING or CRITICAL.
    """
    started = time.monotonic()
    releases = Path(state_dir) / RELEASES
    in_progress, unfinished = (None, None) if inside_release else _release_state(releases)
    if in_progress:
        # release_in_progress lets a rolling release's gate tell "checks skipped" from "serving".
        return Report(node, [in_progress], {"release_in_progress": 1,
                                            "check_seconds": round(time.monotonic() - started, 4)})
    findings = [unfinished] if unfinished else []
    serving_path = releases / CURRENT / "serving.json"
    try:
        serving = read_json_object(serving_path)
        if serving is None:
            return Report(node, [*findings, Finding("release", UNKNOWN, f"{serving_path} not found: no active release on {node}")])
        missing = [k for k in SERVING_KEYS if k not in serving]
        if missing:
            raise ValueError(f"{serving_path}: not a release's serving.json (no {', '.join(missing)})")
    except ValueError as err:
        return Report(node, [*findings, Finding("release", UNKNOWN, f"{err}; reinstall the release (flatshare release)")])

    from .errors import FlatshareError

    try:
        facts, drop_ins, need_reload, service_states = _systemd_facts(serving, runtime_dir)
    except FlatshareError as err:
        return Report(node, [*findings, Finding("systemd", UNKNOWN, str(err))])

    engine = serving["engine"]
    unit_finding = check_engine_unit(facts, engine["unit"])
    findings.append(unit_finding)
    perf: dict[str, float] = {}
    if unit_finding.status == OK:
        try:
            running_argv = read_cmdline(facts.main_pid)
        except OSError:
            running_argv = []
        flags = check_flags(running_argv, engine["argv"])
        findings.append(flags)
        perf["flags_differing"] = len(flags.details)
        health_status, _ = http_get(engine["url"] + "/health")
        if health_status != 200:
            findings.append(Finding("health", CRITICAL, f"GET {engine['url']}/health answered {health_status or 'nothing'}"))
        else:
            findings.append(Finding("health", OK, "engine /health 200"))
        version = http_get(engine["url"] + "/version")
        findings.append(check_vllm_release(*version, installed_vllm(Path(engine["venv"])), serving["vllm_release"]))
        metrics_status, metrics_body = http_get(engine["url"] + "/metrics")
        if metrics_status == 200:
            metrics = parse_metrics(metrics_body.decode(errors="replace"))
            findings.append(check_turn_hints(metrics))
            perf["requests_running"] = metrics.get("vllm:num_requests_running", 0.0)
            perf["turns_announced"] = metrics.get("flatshare:make_room_turns_announced_total", 0.0)
        else:
            findings.append(Finding("turn_hints", WARNING, f"GET /metrics answered {metrics_status or 'nothing'}"))
    findings.append(check_services(service_states, Path(serving["voice"]["drain_file"]), inside_release))
    module = serving["module"]
    findings.append(check_module(Path(module["path"]), module["sha256"], facts.started_at))
    units = check_units(Path(serving["layout"]["unit_dir"]), serving["units"])
    findings.append(units)
    perf["units_differing"] = len(units.details)
    findings.append(check_drop_ins(_with_unloaded_links(drop_ins, Path(serving["layout"]["unit_dir"])),
                                   need_reload, node))
    perf["check_seconds"] = round(time.monotonic() - started, 4)
    return Report(node, findings, perf)


# --- output ----------------------------------------------------------------------


def nagios_text(report: Report) -> str:
    """Nagios plugin output: ``SERVING-CHECK STATUS - summary | perfdata`` then one line per finding."""
    bad = [f for f in report.findings if f.status != OK]
    summary = "; ".join(f.summary for f in bad) if bad else "; ".join(f.summary for f in report.findings[:2])
    perf = " ".join(f"{k}={v:g}" for k, v in report.perfdata.items())
    lines = [f"SERVING-CHECK {report.status} - {report.node}: {summary}" + (f" | {perf}" if perf else "")]
    for finding in report.findings:
        lines.append(f"{finding.status} {finding.check}: {finding.summary}")
        lines.extend(f"    {detail}" for detail in finding.details)
    return "\n".join(lines) + "\n"


def textfile(report: Report, now: float) -> str:
    """node_exporter textfile-collector text: one gauge per check, plus the run's time (no timestamps on samples)."""
    lines = [
        "# HELP flatshare_serving_check_status serving-check result per check (0 OK, 1 WARNING, 2 CRITICAL, 3 UNKNOWN).",
        "# TYPE flatshare_serving_check_status gauge",
    ]
    worst: dict[str, str] = {}
    for finding in report.findings:
        if finding.check not in worst or _SEVERITY[finding.status] > _SEVERITY[worst[finding.check]]:
            worst[finding.check] = finding.status
    for check, status in sorted(worst.items()):
        lines.append(f'flatshare_serving_check_status{{node="{report.node}",check="{check}"}} {EXIT_CODES[status]}')
    lines += [
        "# HELP flatshare_serving_check_last_run_timestamp_seconds When serving-check last ran (Unix seconds).",
        "# TYPE flatshare_serving_check_last_run_timestamp_seconds gauge",
        f'flatshare_serving_check_last_run_timestamp_seconds{{node="{report.node}"}} {now:.3f}',
    ]
    return "\n".join(lines) + "\n"


def write_textfile(directory: Path, report: Report) -> Path:
    """Write ``DIRECTORY/serving_check.prom`` atomically (temporary file in the same directory, rename)."""
    from .atomic import write_atomic

    path = Path(directory) / "serving_check.prom"
    write_atomic(path, textfile(report, time.time()).encode())
    return path
