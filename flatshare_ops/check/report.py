"""serving-check's report in the two forms other programs read (the report itself, as data: common/serving_report.py).

Sources (docs/reference/monitoring.md): the Nagios plugin guidelines (exit
0 OK, 1 WARNING, 2 CRITICAL, 3 UNKNOWN; first line ``SERVICE STATUS - text |
perfdata``, perfdata ``label=value[UOM]`` with ``s`` for seconds and no unit
for counts) and node_exporter's textfile collector (Prometheus text format,
label values escaped, no timestamps; the file written beside and renamed).

Plain classes, not dataclasses: importing dataclasses pulls in inspect
(about 5 ms), and this module runs every minute on every node.
"""

from __future__ import annotations

import time
from pathlib import Path

from ..common.serving_report import (  # noqa: F401 (check/'s modules read them here)
    CRITICAL, EXIT_CODES, OK, SEVERITY, UNKNOWN, WARNING, Finding, NodeState, Report, worst)

#: Units of the perfdata values (Nagios UOM): seconds get ``s``, counts none.
PERF_UNITS = {"check_seconds": "s"}


def nagios_text(report: Report) -> str:
    """Nagios plugin output: ``SERVING-CHECK STATUS - node: summary | perfdata`` then one line per finding."""
    bad = [f for f in report.findings if f.status != OK]
    summary = "; ".join(f.summary for f in bad) if bad else "; ".join(f.summary for f in report.findings[:2])
    perf = " ".join(f"{k}={v:g}{PERF_UNITS.get(k, '')}" for k, v in report.perfdata.items())
    from ..common.text import one_line

    # Every line is one line: a path or a name holding a newline (from an option or a file) is shown
    # escaped, so it can never start a Nagios line of its own.
    lines = [f"SERVING-CHECK {report.status} - {one_line(report.node)}: {one_line(summary)}" + (f" | {perf}" if perf else "")]
    for finding in report.findings:
        lines.append(one_line(f"{finding.status} {finding.check}: {finding.summary}"))
        lines.extend(f"    {one_line(detail)}" for detail in finding.details)
    return "\n".join(lines) + "\n"


def label_value(value: str) -> str:
    """A Prometheus label value, quoted: backslash, double quote and newline escaped
    (the text exposition format; docs/reference/monitoring.md)."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def textfile(report: Report, now: float) -> str:
    """node_exporter textfile-collector text (no timestamps on samples): one gauge per check, the run's time,
    and the node's state where it was established (:class:`NodeState`; PRODUCTION.md, "serving-check")."""
    node = label_value(report.node)
    lines = [
        "# HELP flatshare_serving_check_status serving-check result per check (0 OK, 1 WARNING, 2 CRITICAL, 3 UNKNOWN).",
        "# TYPE flatshare_serving_check_status gauge",
    ]
    by_check: dict[str, str] = {}
    for finding in report.findings:
        by_check[finding.check] = worst((by_check.get(finding.check, OK), finding.status))
    for check, status in sorted(by_check.items()):
        lines.append(f"flatshare_serving_check_status{{node={node},check={label_value(check)}}} {EXIT_CODES[status]}")
    lines += [
        "# HELP flatshare_serving_check_last_run_timestamp_seconds When serving-check last ran (Unix seconds).",
        "# TYPE flatshare_serving_check_last_run_timestamp_seconds gauge",
        f"flatshare_serving_check_last_run_timestamp_seconds{{node={node}}} {now:.3f}",
    ]
    return "\n".join(lines + _state_lines(node, report.state)) + "\n"


def _state_lines(node: str, state: NodeState) -> list[str]:
    """The node's state as gauges; a series whose value is not established is left out (never a guess)."""
    lines = []
    if state.takes_calls is not None:
        lines += [
            "# HELP flatshare_serving_check_takes_calls Whether a caller would be served here (1) or not (0): "
            "gateway and engine /health 200, services active, no voice drain file.",
            "# TYPE flatshare_serving_check_takes_calls gauge",
            f"flatshare_serving_check_takes_calls{{node={node}}} {int(state.takes_calls)}",
        ]
    if state.release is not None:
        labels = f"node={node},release={label_value(state.release)}"
        for name, value in (("profile", state.profile), ("vllm_release", state.vllm_release)):
            if value is not None:
                labels += f",{name}={label_value(value)}"
        lines += [
            "# HELP flatshare_serving_check_active_release_info The node's active release (releases/current), "
            "its profile and vLLM release; always 1.",
            "# TYPE flatshare_serving_check_active_release_info gauge",
            f"flatshare_serving_check_active_release_info{{{labels}}} 1",
        ]
    if state.switch_started_at is not None:
        lines += [
            "# HELP flatshare_serving_check_switch_started_timestamp_seconds When the switch in progress or left "
            "unfinished (releases/switching.json) started (Unix seconds); absent when there is none.",
            "# TYPE flatshare_serving_check_switch_started_timestamp_seconds gauge",
            f"flatshare_serving_check_switch_started_timestamp_seconds{{node={node}}} {state.switch_started_at:.3f}",
        ]
    return lines


def write_textfile(directory: Path, report: Report) -> Path:
    """Write ``DIRECTORY/serving_check.prom`` atomically (a temporary file beside it, renamed).

    Raises:
        OSError: the directory is missing or not writable.
    """
    from ..common import durable

    path = Path(directory) / "serving_check.prom"
    durable.write_atomic(path, textfile(report, time.time()).encode())
    return path
