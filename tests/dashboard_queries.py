"""The Grafana dashboard's queries, parsed with a real PromQL parser: which metrics and labels each panel names.
Shared by the chart's test (the JSON loads as a dashboard) and the tests that scrape real processes (the services',
the operator's): every metric a panel names is one they export."""

import json
from pathlib import Path
from typing import NamedTuple

import promql_parser

from metrics_page import scrape  # noqa: F401  (the dashboard tests read pages with it)

DASHBOARD = Path(__file__).resolve().parents[1] / "charts" / "specsplit" / "dashboards" / "specsplit.json"
# Added to every series by Prometheus (the target's namespace) and the chart's monitors (podTargetLabels), not by
# the processes themselves.
TARGET_LABELS = {"namespace", "app_kubernetes_io_instance", "app_kubernetes_io_component"}
OPERATOR_PREFIX = "specsplit_operator_"
# Grafana's variables, as Grafana substitutes them before the query reaches Prometheus.
_GRAFANA_VARIABLES = {"$__rate_interval": "1m"}


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panel_queries(board: dict | None = None) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of every panel."""
    board = board or dashboard()
    return [(panel["title"], target["expr"]) for panel in board["panels"] for target in panel.get("targets", [])]


def parse(expr: str):
    for variable, value in _GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    return promql_parser.parse(expr)


class Selector(NamedTuple):
    name: str  # the metric
    matchers: set[str]  # label names the selector itself matches on
    grouping: set[str]  # label names any aggregation of the query groups by

    @property
    def labels(self) -> set[str]:
        """Every label the query reads this metric by."""
        return self.matchers | self.grouping


def selectors(expr: str) -> list[Selector]:
    """Every series the query reads."""
    found, grouping = [], set()

    def walk(node) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            found.append((node.name, {m.name for m in node.matchers.matchers}))
        elif isinstance(node, promql_parser.MatrixSelector):
            walk(node.vector_selector)
        elif isinstance(node, promql_parser.AggregateExpr):
            if node.modifier is not None:
                grouping.update(node.modifier.labels)
            walk(node.expr)
        elif isinstance(node, promql_parser.BinaryExpr):
            walk(node.lhs)
            walk(node.rhs)
        elif isinstance(node, promql_parser.Call):
            for argument in node.args:
                walk(argument)
        elif isinstance(node, (promql_parser.ParenExpr, promql_parser.UnaryExpr, promql_parser.SubqueryExpr)):
            walk(node.expr)

    walk(parse(expr))
    return [Selector(name, matchers, grouping) for name, matchers in found]


def named_metrics(board: dict | None = None, operator: bool | None = None) -> dict[str, set[str]]:
    """{metric name: label names queries use with it}; operator True / False: only the operator's / the services'."""
    names: dict[str, set[str]] = {}
    for _, expr in panel_queries(board):
        for selector in selectors(expr):
            if operator is None or selector.name.startswith(OPERATOR_PREFIX) == operator:
                names.setdefault(selector.name, set()).update(selector.labels)
    return names


def exported(samples: dict) -> dict[str, set[str]]:
    """{sample name: label names} from scrape()'s {(name, labels): value}."""
    out: dict[str, set[str]] = {}
    for name, labels in samples:
        out.setdefault(name, set()).update(key for key, _ in labels)
    return out


def missing(named: dict[str, set[str]], scraped: list[dict]) -> list[str]:
    """What the queries name that no scraped process exports: metrics, and labels a metric is read by."""
    exports: dict[str, set[str]] = {}
    for samples in scraped:
        for name, labels in exported(samples).items():
            exports.setdefault(name, set()).update(labels)
    problems = []
    for name, labels in sorted(named.items()):
        if name not in exports:
            problems.append(f"metric {name}")
            continue
        if name.endswith("_bucket"):
            labels = labels - {"le"} | ({"le"} & exports[name])
        unknown = labels - TARGET_LABELS - exports[name]
        if unknown:
            problems.append(f"{name}: labels {sorted(unknown)}")
    return problems
