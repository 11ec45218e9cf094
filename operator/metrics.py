"""The operator's Prometheus metrics: what it decided for each SpeculativeDeployment, read from the status as its
handlers see it (the latest body's, with what this process wrote since: so they say what `kubectl get specdeploy -o
yaml` says, also after an operator restart or a leader handover), when scraped.

    specsplit_operator_desired_replicas{namespace,name,role}  replicas the operator scaled the pool to (target, draft)
    specsplit_operator_ready_replicas{namespace,name,role}    of those, ready when it last looked
    specsplit_operator_canary_weight{namespace,name}          percent of requests the draft canary gets (0: none)

Served on SPECSPLIT_OPERATOR_METRICS_PORT (none when unset; the chart sets 9090) at SPECSPLIT_OPERATOR_METRICS_HOST.
The labels `namespace` and `name` are the SpeculativeDeployment's: scrape with honor_labels (the chart's PodMonitor
does) so that `namespace` is not the operator pod's own.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily

from specsplit.operator import naming
from specsplit.operator.apply import apply_merge_patch


class OperatorCollector:
    def __init__(self, context: Any):
        self.context = context  # an OperatorContext: its states, by uid

    def collect(self):
        desired = GaugeMetricFamily("specsplit_operator_desired_replicas", "Replicas the operator scaled a pool to",
                                    labels=["namespace", "name", "role"])
        ready = GaugeMetricFamily("specsplit_operator_ready_replicas", "Ready replicas of a pool when the operator "
                                  "last looked", labels=["namespace", "name", "role"])
        weight = GaugeMetricFamily("specsplit_operator_canary_weight", "Percent of requests the draft canary gets",
                                   labels=["namespace", "name"])
        for state in list(self.context.states.values()):
            if state.deleted or not state.name:
                continue
            where = (state.namespace, state.name)
            status = apply_merge_patch(state.seen_status, state.written_status)  # as handlers._seen_status
            for role in naming.ROLES:
                recorded = status.get(role) or {}
                if isinstance(recorded.get("desiredReplicas"), int):
                    desired.add_metric([*where, role], recorded["desiredReplicas"])
                if isinstance(recorded.get("readyReplicas"), int):
                    ready.add_metric([*where, role], recorded["readyReplicas"])
            canary = status.get("canary") or {}
            weight.add_metric(list(where), canary["weight"] if isinstance(canary.get("weight"), int) else 0)
        yield from (desired, ready, weight)


def start_operator_metrics(context: Any, host: str, port: int):
    """The metrics server (a thread), or None for port < 0."""
    if port < 0:
        return None
    from specsplit.services.telemetry.metrics_server import start_metrics_server

    registry = CollectorRegistry()
    registry.register(OperatorCollector(context))
    return start_metrics_server("operator", registry, host, port)
