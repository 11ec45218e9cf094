"""The Grafana dashboard of a SpeculativeDeployment, built from the metrics the services and the operator export.

The chart ships its JSON (charts/specsplit/dashboards/specsplit.json, a ConfigMap for Grafana's dashboard sidecar);
this module is where it is written. After changing a panel:

    python -m specsplit.services.telemetry.grafana_dashboard > charts/specsplit/dashboards/specsplit.json

Queries select one SpeculativeDeployment by the pod labels the chart's PodMonitor / ServiceMonitor copy onto every
series (`app_kubernetes_io_instance`, `app_kubernetes_io_component`) and Prometheus' `namespace`.
"""

import json
import sys

SELECT = 'namespace="$namespace",app_kubernetes_io_instance="$deployment"'
COORDINATOR = SELECT + ',app_kubernetes_io_component="coordinator"'
OPERATOR = 'namespace="$namespace",name="$deployment"'  # the operator's own labels (operator/metrics.py)
RATE = "[$__rate_interval]"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
# Speculation counters are kept apart by acceptance method: "typical" is not lossless and must not blend into
# "rejection"'s rates.
BY_VARIANT = "variant, method"
METHODS = "method: rejection (lossless) or typical (NOT lossless), never summed together."
TPOT = ("What `specsplit bench` calls TPOT (its ITL is the gap between streamed pieces); the metric's name, "
        "inter_token_latency, is older than that distinction.")


def _rate(metric: str, selector: str = SELECT, by: str = "") -> str:
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} (rate({metric}{{{selector}}}{RATE}))"


def _quantile(q: float, histogram: str, selector: str = SELECT, by: str = "") -> str:
    labels = f"le, {by}" if by else "le"
    return f"histogram_quantile({q}, {_rate(histogram + '_bucket', selector, labels)})"


def _percentiles(histogram: str) -> list[tuple[str, str]]:
    return [(_quantile(q, histogram), f"p{round(q * 100)}") for q in (0.5, 0.9, 0.99)]


# (title, unit, [(PromQL, legend)], description) per panel, in rows.
ROWS = [
    ("Speculation", [
        ("Acceptance rate by draft variant", "percentunit", [
            (f"{_rate('specsplit_accepted_tokens_total', by=BY_VARIANT)} / "
             f"{_rate('specsplit_drafted_tokens_total', by=BY_VARIANT)}", "{{variant}} {{method}}"),
        ], "Accepted / proposed draft tokens. A variant is a draft model the coordinator routes a share of requests to "
           f"(stable, canary). {METHODS}"),
        ("Acceptance rate by proposal position", "percentunit", [
            (f"{_rate('specsplit_accepted_position_total', by='position, method')} / "
             f"{_rate('specsplit_drafted_position_total', by='position, method')}", "position {{position}} {{method}}"),
        ], f"How often the i-th proposal of a round is accepted: the fall with i is what limits k. {METHODS}"),
        ("Tokens per speculative round by draft variant", "short", [
            (f"({_rate('specsplit_accepted_tokens_total', by=BY_VARIANT)} + "
             f"{_rate('specsplit_speculative_rounds_total', by=BY_VARIANT)}) / "
             f"{_rate('specsplit_speculative_rounds_total', by=BY_VARIANT)}", "{{variant}} {{method}}"),
        ], "Tokens emitted per speculative round (accepted + 1): what one target verification yields when it verifies "
           "proposals. Rounds the policy ran at k = 0 are not counted here (`specsplit bench`'s tokens_per_round "
           f"counts every round). {METHODS}"),
        ("Chosen k (proposals per round)", "short", [
            (f"{_rate('specsplit_speculation_length_sum')} / {_rate('specsplit_speculation_length_count')}", "mean"),
            (_quantile(0.9, "specsplit_speculation_length"), "p90"),
        ], "k the speculation policy chose per sequence and round; 0 = plain decoding (speculation would not pay)."),
    ]),
    ("Draft canaries side by side", [
        ("Share of requests by draft variant", "percentunit", [
            (f"{_rate('specsplit_requests_total', by='variant')} / scalar({_rate('specsplit_requests_total')})",
             "{{variant}}"),
            (f"specsplit_operator_canary_weight{{{OPERATOR}}} / 100", "canary weight (operator)"),
        ], "Where requests went, against the weight the operator gives the canary."),
        ("Time per output token p50 by draft variant", "s", [
            (_quantile(0.5, "specsplit_inter_token_latency_seconds", by="variant"), "{{variant}}"),
        ], f"Per request, (latency - time to first token) / (tokens - 1): the canary must not be slower. {TPOT}"),
        ("Requests finished by reason", "reqps", [
            (_rate("specsplit_requests_total", by="variant, finish_reason"), "{{variant}} {{finish_reason}}"),
        ], "stop / length: answered; abort: the client left or the server stopped; error: failed."),
    ]),
    ("Latency", [
        ("Time to first token", "s", _percentiles("specsplit_time_to_first_token_seconds"),
         "From admission to the first token, at the coordinator."),
        ("Time per output token", "s", _percentiles("specsplit_inter_token_latency_seconds"),
         f"Per request, (latency - time to first token) / (tokens - 1), at the coordinator. {TPOT}"),
        ("Round, propose and verify at the coordinator (p90)", "s", [
            (_quantile(0.9, "specsplit_round_seconds"), "round"),
            (_quantile(0.9, "specsplit_stage_latency_seconds", COORDINATOR, by="stage"), "{{stage}} call"),
        ], "A sequence's round (between its commits) and the worker calls' round trips as the coordinator sees them."),
        ("Worker steps (p90)", "s", [
            (_quantile(0.9, "specsplit_stage_latency_seconds", SELECT + ',app_kubernetes_io_component!="coordinator"',
                       by="app_kubernetes_io_component, stage"), "{{app_kubernetes_io_component}} {{stage}}"),
            (_quantile(0.9, "specsplit_queue_wait_seconds", by="app_kubernetes_io_component"),
             "{{app_kubernetes_io_component}} queue wait"),
        ], "Inside the workers: the draft's propose, the target's score (forward) and verify (acceptance), prefill; "
           "and how long an item waits for its batched step."),
    ]),
    ("Capacity", [
        ("KV cache in use", "percentunit", [
            (f"sum by (role) (specsplit_kv_blocks_used{{{SELECT}}}) / sum by (role) (specsplit_kv_blocks_total{{{SELECT}}})",
             "{{role}}"),
        ], "KV blocks held over all replicas of each pool."),
        ("Requests running and waiting", "short", [
            (f'sum (specsplit_running_sequences{{{SELECT},role="coordinator"}})', "running"),
            (f'sum (specsplit_queue_depth{{{SELECT},role="coordinator"}})', "waiting"),
            (f'sum by (role) (specsplit_queue_depth{{{SELECT},role!="coordinator"}})', "{{role}} step queue"),
        ], "Requests decoding and admitted but waiting at the coordinators; items queued for a worker's next step."),
        ("Replicas per pool (operator)", "short", [
            (f"specsplit_operator_desired_replicas{{{OPERATOR}}}", "{{role}} desired"),
            (f"specsplit_operator_ready_replicas{{{OPERATOR}}}", "{{role}} ready"),
        ], "The replicas the operator scaled each pool to, and how many were ready when it last looked."),
    ]),
]


def build_dashboard() -> dict:
    panels, panel_id, y = [], 1, 0
    for row_title, row_panels in ROWS:
        panels.append({"id": panel_id, "type": "row", "title": row_title, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        panel_id, y = panel_id + 1, y + 1
        width = 24 // len(row_panels)
        for column, (title, unit, targets, description) in enumerate(row_panels):
            panels.append(_timeseries(panel_id, title, unit, targets, description,
                                      {"h": 8, "w": width, "x": column * width, "y": y}))
            panel_id += 1
        y += 8
    return {
        "uid": "specsplit-overview",
        "title": "specsplit: speculative decoding",
        "description": "One SpeculativeDeployment: speculation, draft canaries, latency and capacity.",
        "tags": ["specsplit", "llm", "speculative-decoding"],
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,
        "refresh": "30s",
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": [
            {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
             "current": {}, "hide": 0, "refresh": 1},
            _label_variable("namespace", "Namespace", "label_values(specsplit_running_sequences, namespace)"),
            _label_variable("deployment", "SpeculativeDeployment", 'label_values(specsplit_running_sequences'
                            '{namespace="$namespace"}, app_kubernetes_io_instance)'),
        ]},
        "annotations": {"list": []},
        "links": [],
        "panels": panels,
    }


def _label_variable(name: str, label: str, query: str) -> dict:
    return {"name": name, "label": label, "type": "query", "datasource": DATASOURCE,
            "query": {"query": query, "refId": f"{name}-values"}, "definition": query, "refresh": 2, "sort": 1,
            "current": {}, "hide": 0, "includeAll": False, "multi": False, "options": []}


def _timeseries(panel_id: int, title: str, unit: str, targets: list, description: str, grid: dict) -> dict:
    return {
        "id": panel_id,
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "gridPos": grid,
        "fieldConfig": {"defaults": {"unit": unit, "min": 0, "custom": {"lineWidth": 1, "fillOpacity": 10,
                                                                          "showPoints": "never"}},
                        "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                    "tooltip": {"mode": "multi", "sort": "desc"}},
        "targets": [{"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": expr, "legendFormat": legend,
                     "range": True, "editorMode": "code"} for i, (expr, legend) in enumerate(targets)],
    }


def dashboard_json() -> str:
    return json.dumps(build_dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    sys.stdout.write(dashboard_json())
