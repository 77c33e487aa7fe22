"""The fleet's Prometheus rules (``monitoring/flatshare-rules.yml``): recording rules and alerts, pure.

Rendered from the inventory (its nodes, ``min_serving``, ``monitoring.runbook_url``) and each node's
profile (serving-check's ``check.interval_s``, the switch's budgets, ``release.analysis``'s
``ttft_p95_max_s`` and ``error_share_max``: the canary analysis' thresholds, one value in one place).
A value the nodes' profiles do not share gets one rule per value, each selecting its nodes.

What the rules read (docs/reference/monitoring.md): serving-check's textfile
(``flatshare_serving_check_*``, with a ``node`` label it writes itself), node_exporter's
``node_textfile_scrape_error``, and vLLM's ``/metrics`` (``vllm:*``), scraped with a ``node`` target
label (PRODUCTION.md, "Monitoring"). Names, labels, ``severity``, ``summary``/``description`` and
``runbook_url`` follow the monitoring mixins' conventions; each alert's runbook is its own section of
PRODUCTION.md, headed by the alert's name.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config.inventory import Inventory
from ..config.profile import LoadedProfile
from .yaml_text import yaml_text

#: Every alert's name starts so (the mixins' one prefix).
PREFIX = "Flatshare"
#: The rate window of the latency and error recordings, and how long an engine alert must hold (chosen).
WINDOW = "5m"
ENGINE_FOR = "5m"
#: Quantiles recorded for the dashboard and the alerts (p95 is the analysis' and the alert's).
QUANTILES = ("0.5", "0.95", "0.99")
ALERT_QUANTILE = "0.95"
#: vLLM's finished_reason values counted as requests ending in error or abort (docs/reference/monitoring.md, "vLLM's metrics").
ERROR_REASONS = ("error", "abort")

# Recorded series (Prometheus' level:metric:operations naming).
TTFT_QUANTILE = "node_quantile:vllm_time_to_first_token_seconds:histogram_quantile5m"
E2E_QUANTILE = "node_quantile:vllm_e2e_request_latency_seconds:histogram_quantile5m"
ERROR_SHARE = "node:vllm_request_error_share:ratio_rate5m"

# serving-check's series (check/report.py) and the others the rules read.
STATUS = "flatshare_serving_check_status"
LAST_RUN = "flatshare_serving_check_last_run_timestamp_seconds"
TAKES_CALLS = "flatshare_serving_check_takes_calls"
ACTIVE_RELEASE = "flatshare_serving_check_active_release_info"
SWITCH_STARTED = "flatshare_serving_check_switch_started_timestamp_seconds"
TEXTFILE_ERROR = "node_textfile_scrape_error"
TEXTFILE_MTIME = "node_textfile_mtime_seconds"
#: The file serving-check writes in node_exporter's textfile directory (check/report.py ``write_textfile``), as
#: node_exporter's ``file`` label names it (the whole path, or the name alone in older node_exporters).
TEXTFILE_NAME = "serving_check.prom"

#: serving-check has not run when its last run is older than this many intervals.
STALE_RUNS = 3

RULES_FILE = "monitoring/flatshare-rules.yml"
HEADER = ("# Rendered by flatshare-ops from profiles/fleet.toml and its nodes' profiles: do not edit.\n"
          "# Change them and run `make profiles UPDATE=1`; PRODUCTION.md, \"Monitoring\", says how to install it.\n")


def seconds(value: float) -> str:
    """A Prometheus duration for a whole number of seconds: ``120`` -> ``2m``, ``90`` -> ``90s``."""
    whole = int(round(value))
    return f"{whole // 60}m" if whole % 60 == 0 and whole else f"{whole}s"


def number(value: float) -> str:
    """A threshold as PromQL and people read it: ``0.5``, ``0.01``, ``1280``."""
    return f"{value:g}"


@dataclass(frozen=True)
class Watch:
    """What one node's profile says its alerts compare with.

    Attributes:
        interval_s: serving-check's interval (``check.interval_s``).
        ttft_p95_max_s, error_share_max: ``release.analysis``'s thresholds.
        switch_budget_s: the longest a switch may take: the engine's start budget plus its stop timeout
            plus the voice and gateway drain timeouts.
    """

    interval_s: int
    ttft_p95_max_s: float
    error_share_max: float
    switch_budget_s: float

    @classmethod
    def of(cls, loaded: LoadedProfile) -> "Watch":
        """The watch of a loaded profile."""
        p = loaded.profile
        return cls(p.check.interval_s, p.release.analysis.ttft_p95_max_s, p.release.analysis.error_share_max,
                   p.engine.start_timeout_s + p.engine.stop_timeout_s + p.voice.drain_timeout_s
                   + p.gateway.drain_timeout_s)


def runbook_anchor(alert: str) -> str:
    """The anchor GitHub gives a heading that is the alert's name alone (lowercase; it has no spaces)."""
    return alert.lower()


def _groups(watches: dict[str, Watch], *fields: str) -> list[tuple[Watch, str]]:
    """Nodes grouped by the watch fields a rule uses: (a watch, the selector of its nodes) per group;
    the selector is empty when every node shares the values."""
    by_value: dict[tuple, list[str]] = {}
    for node, watch in watches.items():
        by_value.setdefault(tuple(getattr(watch, f) for f in fields), []).append(node)
    if len(by_value) == 1:
        return [(next(iter(watches.values())), "")]
    return [(watches[nodes[0]], f'node=~"{"|".join(nodes)}"') for nodes in by_value.values()]


def _sel(*matchers: str) -> str:
    inner = ",".join(m for m in matchers if m)
    return f"{{{inner}}}" if inner else ""


class _Alerts:
    """Builds the alert rules, each with the conventions' labels and annotations."""

    def __init__(self, runbook_url: str | None) -> None:
        self.base = runbook_url or "PRODUCTION.md"
        self.rules: list[dict] = []

    def add(self, name: str, expr: str, for_: str, severity: str, summary: str, description: str) -> None:
        self.rules.append({
            "alert": PREFIX + name,
            "expr": expr,
            "for": for_,
            "labels": {"severity": severity},
            "annotations": {"summary": summary, "description": description,
                            "runbook_url": f"{self.base}#{runbook_anchor(PREFIX + name)}"},
        })


def _recordings() -> list[dict]:
    rules = []
    for record, histogram in ((TTFT_QUANTILE, "vllm:time_to_first_token_seconds"),
                              (E2E_QUANTILE, "vllm:e2e_request_latency_seconds")):
        for q in QUANTILES:
            rules.append({"record": record,
                          "expr": f"histogram_quantile({q}, sum by (node, le) (rate({histogram}_bucket[{WINDOW}])))",
                          "labels": {"quantile": q}})
    reasons = "|".join(ERROR_REASONS)
    rules.append({"record": ERROR_SHARE,
                  "expr": f'sum by (node) (rate(vllm:request_success_total{{finished_reason=~"{reasons}"}}[{WINDOW}]))\n'
                          f"/\nsum by (node) (rate(vllm:request_success_total[{WINDOW}]))"})
    return rules


def _serving_check_alerts(a: _Alerts, watches: dict[str, Watch]) -> None:
    for watch, sel in _groups(watches, "interval_s"):
        held = 2 * watch.interval_s
        for name, status, severity in (("ServingCheckCritical", 2, "critical"), ("ServingCheckUnknown", 3, "warning")):
            word = "CRITICAL" if status == 2 else "UNKNOWN"
            a.add(name, f"{STATUS}{_sel(sel)} == {status}", seconds(held), severity,
                  f"serving-check on {{{{ $labels.node }}}}: {{{{ $labels.check }}}} is {word}",
                  f"serving-check on {{{{ $labels.node }}}} has found its {{{{ $labels.check }}}} check {word} "
                  f"(status {{{{ $value }}}}) for more than {held} s, two of its runs; "
                  f"'flatshare check --node {{{{ $labels.node }}}}' says what it found.")
        stale = STALE_RUNS * watch.interval_s
        a.add("ServingCheckNotRun", f"time() - {LAST_RUN}{_sel(sel)} > {stale}", seconds(watch.interval_s), "warning",
              "serving-check has not run on {{ $labels.node }} for {{ $value | printf \"%.0f\" }} s",
              f"serving-check's last run on {{{{ $labels.node }}}} was {{{{ $value | printf \"%.0f\" }}}} s ago, "
              f"more than {STALE_RUNS} of its {watch.interval_s} s intervals: its timer or cron job does not run "
              f"it, or it cannot write its textfile.")
    for interval_s in sorted({w.interval_s for w in watches.values()}):
        nodes = [n for n, w in watches.items() if w.interval_s == interval_s]
        held = STALE_RUNS * interval_s
        a.add("ServingCheckAbsent", " or ".join(f'absent({LAST_RUN}{{node="{n}"}})' for n in nodes),
              seconds(held), "warning",
              "No serving-check textfile from {{ $labels.node }}",
              f"Prometheus has had no {LAST_RUN} from the inventory's node {{{{ $labels.node }}}} for {held} s: "
              f"its textfile is missing, node_exporter does not read its directory, or serving-check names the "
              f"node otherwise.")
    # node_exporter's own reading of the same: the file's modification time (its series carry no node label).
    longest = max(w.interval_s for w in watches.values())
    stale = STALE_RUNS * longest
    a.add("ServingCheckTextfileStale",
          f'time() - {TEXTFILE_MTIME}{{file=~"(.*/)?{TEXTFILE_NAME.replace(".", "[.]")}"}} > {stale}',
          seconds(longest), "warning",
          "serving-check's textfile on {{ $labels.instance }} is {{ $value | printf \"%.0f\" }} s old",
          f"node_exporter on {{{{ $labels.instance }}}} serves {{{{ $labels.file }}}}, last written "
          f"{{{{ $value | printf \"%.0f\" }}}} s ago, more than {STALE_RUNS} of serving-check's {longest} s "
          f"intervals: serving-check no longer replaces it (its timer does not run it, or it cannot write there).")
    held = 2 * longest
    a.add("TextfileCollectorError", f"{TEXTFILE_ERROR} == 1", seconds(held), "warning",
          "node_exporter on {{ $labels.instance }} cannot read a textfile",
          f"{TEXTFILE_ERROR} has been {{{{ $value }}}} on {{{{ $labels.instance }}}} for {held} s: "
          "node_exporter's textfile collector failed to read a file, serving-check's among them perhaps.")


def _fleet_alerts(a: _Alerts, watches: dict[str, Watch], min_serving: int) -> None:
    for watch, sel in _groups(watches, "switch_budget_s", "interval_s"):
        budget = number(watch.switch_budget_s)
        a.add("SwitchUnfinished", f"time() - {SWITCH_STARTED}{_sel(sel)} > {budget}", seconds(watch.interval_s),
              "warning",
              "A switch on {{ $labels.node }} started {{ $value | printf \"%.0f\" }} s ago and has not finished",
              f"The switch in releases/switching.json on {{{{ $labels.node }}}} started "
              f"{{{{ $value | printf \"%.0f\" }}}} s ago, longer than its engine start budget plus its stop and "
              f"drain timeouts ({budget} s): it is stuck, or a killed run left it.")
    if min_serving > 0:
        fresh = STALE_RUNS * max(w.interval_s for w in watches.values())
        held = 2 * max(w.interval_s for w in watches.values())
        nodes = ", ".join(watches)
        a.add("TooFewNodesTakeCalls",
              f"(\n  count({TAKES_CALLS} == 1 and on (node) time() - {LAST_RUN} <= {fresh})\n  or vector(0)\n)"
              f"\n< {min_serving}", seconds(held), "critical",
              f"{{{{ $value }}}} node(s) take calls, fewer than min_serving ({min_serving})",
              f"{{{{ $value }}}} of the fleet's nodes ({nodes}) have taken calls, as serving-check saw them in the "
              f"last {fresh} s, for {held} s; the fleet needs at least {min_serving} (min_serving in profiles/fleet.toml).")


def _engine_alerts(a: _Alerts, watches: dict[str, Watch]) -> None:
    for watch, sel in _groups(watches, "ttft_p95_max_s"):
        limit = number(watch.ttft_p95_max_s)
        quantile = f'quantile="{ALERT_QUANTILE}"'
        a.add("TimeToFirstTokenHigh", f"{TTFT_QUANTILE}{_sel(quantile, sel)} > {limit}",
              ENGINE_FOR, "warning",
              f"Time to first token p95 on {{{{ $labels.node }}}} is {{{{ $value | printf \"%.3f\" }}}} s, above {limit} s",
              f"The p95 of vllm:time_to_first_token_seconds over {WINDOW} on {{{{ $labels.node }}}} has been above "
              f"{limit} s (release.analysis.ttft_p95_max_s, the canary analysis' threshold) for {ENGINE_FOR}: "
              f"{{{{ $value | printf \"%.3f\" }}}} s. It counts every request on the engine: vLLM's histogram does "
              f"not tell voice calls from agents' requests.")
    for watch, sel in _groups(watches, "error_share_max"):
        limit = number(watch.error_share_max)
        a.add("RequestErrorShareHigh", f"{ERROR_SHARE}{_sel(sel)} > {limit}", ENGINE_FOR, "warning",
              "{{ $value | humanizePercentage }} of requests on {{ $labels.node }} end in error or abort",
              f"{{{{ $value | humanizePercentage }}}} of the requests that finished on {{{{ $labels.node }}}} over "
              f"{WINDOW} ended in error or abort (vllm:request_success_total's finished_reason), above "
              f"{limit} (release.analysis.error_share_max, the canary analysis' threshold), for {ENGINE_FOR}.")


def rules_document(inventory: Inventory, by_node: dict[str, LoadedProfile]) -> dict:
    """The rules as data: ``{"groups": [{"name", "rules": [...]}]}`` (Prometheus' rule file shape).

    Args:
        inventory: the fleet's inventory.
        by_node: node name -> its loaded profile (every inventory node).
    """
    watches = {node: Watch.of(loaded) for node, loaded in by_node.items()}
    alerts = _Alerts(inventory.monitoring.runbook_url)
    _serving_check_alerts(alerts, watches)
    _fleet_alerts(alerts, watches, inventory.serving_floor)
    _engine_alerts(alerts, watches)
    return {"groups": [{"name": "flatshare-recordings", "rules": _recordings()},
                       {"name": "flatshare-alerts", "rules": alerts.rules}]}


def render_rules(inventory: Inventory, by_node: dict[str, LoadedProfile]) -> str:
    """``monitoring/flatshare-rules.yml``'s text (see :func:`rules_document`)."""
    return yaml_text(rules_document(inventory, by_node), HEADER)
