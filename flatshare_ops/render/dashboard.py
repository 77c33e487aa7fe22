"""The fleet's Grafana dashboard (``monitoring/flatshare-dashboard.json``), pure.

One row of each node's state from serving-check's textfile (its verdict, whether it takes calls, its
active release, a switch in progress, its last run), then the engines' metrics: time to first token
and end-to-end latency quantiles (the rules' recordings, render/alert_rules.py), requests running and
waiting, and the share ending in error or abort, with the profiles' thresholds drawn as lines.

Grafana's dashboard JSON model (docs/reference/monitoring.md, "Grafana dashboards"): panels with
``type``, ``gridPos`` (24 columns), ``targets`` (``expr``, ``legendFormat``, ``instant``, ``format``)
and ``fieldConfig``; the Prometheus data source is the ``datasource`` template variable, so the file
imports into any Grafana as it is.
"""

# No `from __future__ import annotations` here: it binds the name annotations, which the function below
# takes; every annotation of this module is evaluated as it stands on Python 3.11.

import json

from ..config.profile import LoadedProfile
from . import alert_rules as r

DASHBOARD_FILE = "monitoring/flatshare-dashboard.json"
UID = "flatshare-fleet"
_DS = {"type": "prometheus", "uid": "${datasource}"}
_STATUS_NAMES = {0: ("OK", "green"), 1: ("WARNING", "yellow"), 2: ("CRITICAL", "red"), 3: ("UNKNOWN", "purple")}


#: Every query's node matcher: the dashboard's ``node`` variable (one node, several, or all).
NODES = 'node=~"$node"'
#: How far back a release annotation looks for the release series to be new (the scrape and the check's own
#: interval fit in it).
ANNOTATION_WINDOW = "2m"


def on_nodes(name: str) -> str:
    """``name`` selected on the dashboard's chosen nodes: ``NAME{node=~"$node"}`` (Grafana fills ``$node``)."""
    return f"{name}{{{NODES}}}"


def annotations() -> list[dict]:
    """The dashboard's annotations (Grafana's JSON model, a Prometheus query each): a release each node switched
    to (its active-release series, new in the last :data:`ANNOTATION_WINDOW`: present now, absent then), and
    a switch that began (serving-check's switch-started series new, or its time changed). On every time panel, so that a rise in
    time to first token can be read against the release that came before it."""
    release = on_nodes(r.ACTIVE_RELEASE)
    return [
        {"name": "Releases", "datasource": _DS, "enable": True, "hide": False, "iconColor": "#5794F2",
         "expr": f"{release} unless {release} offset {ANNOTATION_WINDOW}", "step": "60s",
         "titleFormat": "{{node}}: release {{release}}",
         "textFormat": "{{node}} runs release {{release}} (profile {{profile}}, vLLM {{vllm_release}})",
         "tagKeys": "node,release", "useValueForTime": False},
        {"name": "Switches begun", "datasource": _DS, "enable": True, "hide": False, "iconColor": "#FF9830",
         "expr": f"({on_nodes(r.SWITCH_STARTED)} unless {on_nodes(r.SWITCH_STARTED)} offset {ANNOTATION_WINDOW}) "
                 f"or (changes({on_nodes(r.SWITCH_STARTED)}[{ANNOTATION_WINDOW}]) > 0)", "step": "60s",
         "titleFormat": "{{node}}: a switch began", "textFormat": "{{node}}: releases/switching.json written",
         "tagKeys": "node", "useValueForTime": False},
    ]


def _target(expr: str, legend: str = "{{node}}", instant: bool = False, ref: str = "A") -> dict:
    target: dict[str, object] = {"datasource": _DS, "expr": expr, "legendFormat": legend, "refId": ref}
    if instant:
        target.update({"instant": True, "range": False, "format": "table"})
    return target


def _mapping(values: dict[int, tuple[str, str]]) -> list[dict]:
    return [{"type": "value", "options": {str(v): {"text": text, "color": color, "index": i}
                                          for i, (v, (text, color)) in enumerate(values.items())}}]


def _panel(pid: int, title: str, kind: str, grid: tuple[int, int, int, int], targets: list[dict],
           description: str, defaults: dict | None = None, options: dict | None = None, **extra) -> dict:
    x, y, w, h = grid
    panel = {"id": pid, "title": title, "type": kind, "description": description, "datasource": _DS,
             "gridPos": {"x": x, "y": y, "w": w, "h": h}, "targets": targets,
             "fieldConfig": {"defaults": defaults or {}, "overrides": []}, "options": options or {}}
    panel.update(extra)
    return panel


def _stat(values: dict[int, tuple[str, str]] | None = None, unit: str | None = None, none: str = "no data") -> dict:
    defaults: dict = {"noValue": none}
    if values:
        defaults["mappings"] = _mapping(values)
        defaults["color"] = {"mode": "thresholds"}
        defaults["thresholds"] = {"mode": "absolute", "steps": [{"color": "text", "value": None}]}
    if unit:
        defaults["unit"] = unit
    return defaults


def _lines(unit: str, limits: list[float]) -> dict:
    steps = [{"color": "green", "value": None}] + [{"color": "red", "value": v} for v in limits]
    return {"unit": unit, "custom": {"thresholdsStyle": {"mode": "line"}},
            "thresholds": {"mode": "absolute", "steps": steps}}


def dashboard_document(by_node: dict[str, LoadedProfile]) -> dict:
    """The dashboard as Grafana's JSON model (a dict).

    Args:
        by_node: node name -> its loaded profile (the thresholds drawn on the latency and error panels).
    """
    watches = [r.Watch.of(loaded) for loaded in by_node.values()]
    ttft_limits = sorted({w.ttft_p95_max_s for w in watches})
    share_limits = sorted({w.error_share_max for w in watches})
    stat_options = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                    "colorMode": "background", "graphMode": "none", "textMode": "value_and_name"}
    panels = [
        _panel(1, "serving-check", "stat", (0, 0, 6, 5),
               [_target(f"max by (node) ({on_nodes(r.STATUS)})")],
               "Each node's worst serving-check status (PRODUCTION.md, serving-check's table says what to do).",
               _stat({v: n for v, n in _STATUS_NAMES.items()}), stat_options),
        _panel(2, "Takes calls", "stat", (6, 0, 4, 5), [_target(on_nodes(r.TAKES_CALLS))],
               "Whether a caller would be served: gateway and engine /health 200, services active, no voice drain "
               "(no data: serving-check could not tell).",
               _stat({1: ("yes", "green"), 0: ("no", "red")}), stat_options),
        _panel(3, "Switch in progress", "stat", (10, 0, 4, 5),
               [_target(f"time() - {on_nodes(r.SWITCH_STARTED)}")],
               "Seconds since the node's switch in progress, or left unfinished, started (releases/switching.json).",
               _stat(unit="s", none="none"), stat_options),
        _panel(4, "serving-check last run", "stat", (14, 0, 4, 5),
               [_target(f"time() - {on_nodes(r.LAST_RUN)}")],
               "Seconds since serving-check last wrote its textfile.", _stat(unit="s"), stat_options),
        _panel(5, "Active release", "table", (18, 0, 6, 5),
               [_target(on_nodes(r.ACTIVE_RELEASE), instant=True)],
               "The release each node runs (releases/current), its profile and vLLM release.",
               {}, {"showHeader": True},
               transformations=[{"id": "organize", "options": {
                   "excludeByName": {"Time": True, "Value": True, "__name__": True, "instance": True, "job": True},
                   "indexByName": {"node": 0, "release": 1, "profile": 2, "vllm_release": 3}}}]),
        _panel(6, "Checks not OK", "table", (0, 5, 24, 4),
               [_target(f"{on_nodes(r.STATUS)} > 0", instant=True)],
               "Every check serving-check does not find OK (1 WARNING, 2 CRITICAL, 3 UNKNOWN).",
               {"mappings": _mapping(_STATUS_NAMES)}, {"showHeader": True},
               transformations=[{"id": "organize", "options": {
                   "excludeByName": {"Time": True, "__name__": True, "instance": True, "job": True},
                   "renameByName": {"Value": "status"}}}]),
        _panel(7, "Time to first token", "timeseries", (0, 9, 12, 8),
               [_target(on_nodes(r.TTFT_QUANTILE), "{{node}} p{{quantile}}")],
               f"Quantiles of vllm:time_to_first_token_seconds over {r.WINDOW}; the line is "
               "release.analysis.ttft_p95_max_s (the p95's limit).",
               _lines("s", ttft_limits)),
        _panel(8, "End-to-end latency", "timeseries", (12, 9, 12, 8),
               [_target(on_nodes(r.E2E_QUANTILE), "{{node}} p{{quantile}}")],
               f"Quantiles of vllm:e2e_request_latency_seconds over {r.WINDOW}.", {"unit": "s"}),
        _panel(9, "Requests running and waiting", "timeseries", (0, 17, 12, 8),
               [_target(f"sum by (node) ({on_nodes('vllm:num_requests_running')})", "{{node}} running"),
                _target(f"sum by (node) ({on_nodes('vllm:num_requests_waiting')})", "{{node}} waiting", ref="B")],
               "vllm:num_requests_running and vllm:num_requests_waiting.", {"unit": "short"}),
        _panel(10, "Requests ending in error or abort", "timeseries", (12, 17, 12, 8),
               [_target(on_nodes(r.ERROR_SHARE))],
               f"Share of finished requests over {r.WINDOW} whose finished_reason is error or abort; the line is "
               "release.analysis.error_share_max.",
               _lines("percentunit", share_limits)),
    ]
    return {
        "uid": UID, "title": "Flatshare fleet", "tags": ["flatshare"], "editable": True, "schemaVersion": 39,
        "time": {"from": "now-6h", "to": "now"}, "refresh": "1m", "timezone": "utc",
        "description": "Rendered by flatshare-ops from profiles/fleet.toml and its nodes' profiles "
                       "(make profiles UPDATE=1); do not edit in Grafana.",
        "templating": {"list": [
            {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
             "current": {}, "hide": 0},
            {"name": "node", "label": "Node", "type": "query", "datasource": _DS,
             "query": {"query": f"label_values({r.LAST_RUN}, node)", "refId": "nodes"},
             "definition": f"label_values({r.LAST_RUN}, node)", "multi": True, "includeAll": True,
             "allValue": ".*", "current": {"text": "All", "value": "$__all"}, "refresh": 2, "sort": 1, "hide": 0}]},
        "annotations": {"list": annotations()},
        "panels": panels,
    }


def render_dashboard(by_node: dict[str, LoadedProfile]) -> str:
    """``monitoring/flatshare-dashboard.json``'s text: indented JSON with a final newline."""
    return json.dumps(dashboard_document(by_node), indent=2) + "\n"
