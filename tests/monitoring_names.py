"""The metric names the rendered rules and dashboard read, and which of them an exposition lacks.

Read from the rendered files themselves (PyYAML for the rules, json for the dashboard) and their
PromQL parsed by promql-parser (a parser of Prometheus' grammar), never from the renderer's
constants: what the files ask of Prometheus is what must exist.

The real-engine tier calls :func:`missing_engine_names` with the real engine's ``GET /metrics`` text.
"""

from __future__ import annotations

import json
from pathlib import Path

import promql_parser
import yaml

from conftest import REPO
from flatshare_ops.check.facts import parse_metrics

RULES = Path("monitoring/flatshare-rules.yml")
DASHBOARD = Path("monitoring/flatshare-dashboard.json")


def promql_names(expr: str) -> set[str]:
    """Every metric name a PromQL expression selects (vector and matrix selectors, at any depth).

    Raises:
        ValueError: promql-parser cannot parse ``expr``.
    """
    names: set[str] = set()

    def walk(node) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            if node.name:
                names.add(node.name)
            return
        if isinstance(node, promql_parser.MatrixSelector):
            walk(node.vector_selector)
            return
        for attribute in ("expr", "lhs", "rhs", "param"):
            child = getattr(node, attribute, None)
            if child is not None and not isinstance(child, (str, int, float)):
                walk(child)
        for argument in getattr(node, "args", None) or []:
            walk(argument)

    walk(promql_parser.parse(expr))
    return names


def rules(root: Path = REPO) -> list[dict]:
    """Every rule of the rendered rules file (recording and alerting), as PyYAML reads it."""
    document = yaml.safe_load((root / RULES).read_text())
    return [rule for group in document["groups"] for rule in group["rules"]]


def dashboard_exprs(root: Path = REPO) -> list[str]:
    """Every query of the rendered dashboard's panels and annotations."""
    document = json.loads((root / DASHBOARD).read_text())
    return [target["expr"] for panel in document["panels"] for target in panel.get("targets", [])] + [
        annotation["expr"] for annotation in document.get("annotations", {}).get("list", [])]


def used_names(root: Path = REPO) -> set[str]:
    """The metric names the rules and the dashboard read that Prometheus must scrape (the rules' own
    recordings left out)."""
    found = rules(root)
    recorded = {rule["record"] for rule in found if "record" in rule}
    names: set[str] = set()
    for expr in [rule["expr"] for rule in found] + dashboard_exprs(root):
        names |= promql_names(expr)
    return names - recorded


def missing_names(exposition: str, names: set[str]) -> list[str]:
    """The names in ``names`` that no sample of a Prometheus text exposition carries, sorted.

    A histogram's samples are ``NAME_bucket``, ``NAME_sum`` and ``NAME_count``: those are the names
    PromQL selects, and the ones compared here.
    """
    present = set(parse_metrics(exposition))
    return sorted(n for n in names if n not in present)


def missing_engine_names(exposition: str, root: Path = REPO) -> list[str]:
    """The ``vllm:`` names the rules and the dashboard read that an engine's ``/metrics`` text lacks."""
    return missing_names(exposition, {n for n in used_names(root) if n.startswith("vllm:")})
