"""serving-check's outputs as other programs read them (docs/reference/monitoring.md), and the metrics it reads."""

from __future__ import annotations

from flatshare_ops.check.facts import parse_metrics
from flatshare_ops.check.report import CRITICAL, OK, Finding, Report, nagios_text, textfile


def test_textfile_label_values_are_escaped_as_the_prometheus_text_format_says():
    report = Report('cy"an\\node\nx', [Finding("flags", OK, "ok")])
    text = textfile(report, 1700000000.0)
    assert 'node="cy\\"an\\\\node\\nx"' in text
    # No sample line carries a timestamp (node_exporter's textfile collector rejects them).
    samples = [row for row in text.splitlines() if row and not row.startswith("#")]
    assert all(len(row.rsplit("} ", 1)[1].split()) == 1 for row in samples)


def test_perfdata_has_units_seconds_get_s_counts_none():
    report = Report("cyan", [Finding("flags", CRITICAL, "x")], {"check_seconds": 0.05, "flags_differing": 2})
    first = nagios_text(report).splitlines()[0]
    assert first.endswith("| check_seconds=0.05s flags_differing=2")


def test_metrics_samples_with_timestamps_and_labels_holding_spaces_are_read_right():
    text = ("# HELP x help\n# TYPE x gauge\n"
            'x{a="b c",d="}"} 2 1700000000000\n'
            "x 3\n"
            'vllm:num_requests_running{model_name="m"} 4.5 1700000000000\n'
            "not a sample\n")
    assert parse_metrics(text) == {"x": 5.0, "vllm:num_requests_running": 4.5}
