"""The chart's NetworkPolicies, evaluated the way Kubernetes does (ingress only, as the chart sets) on the
labels of the pods the operator actually makes: only the coordinator reaches the pools' gRPC and round channel (the
target pods, where they run it); the coordinator's gRPC is public; metrics answer the operator and, when monitoring
is on, the monitoring namespace."""

import dataclasses

import pytest
from chart_render import NAMESPACE, of_kind, pod_templates, render
from chart_values import VALUE_SETS

GRPC, ROUND, METRICS, KOPF_HEALTH = 50051, 50061, 9090, 8080
COLOCATED_GRPC, HTTP, COLOCATED_METRICS = 50050, 8000, 9091


@dataclasses.dataclass(frozen=True)
class Pod:
    namespace: str
    labels: dict


def _selects(selector: dict, labels: dict) -> bool:
    """A label selector; the chart uses matchLabels and `In` expressions only."""
    expressions = selector.get("matchExpressions", [])
    assert all(e["operator"] == "In" for e in expressions)
    return (all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())
            and all(labels.get(e["key"]) in e["values"] for e in expressions))


def _peer_matches(peer: dict, policy_namespace: str, source: Pod) -> bool:
    assert "ipBlock" not in peer
    if "namespaceSelector" in peer:
        namespace_ok = _selects(peer["namespaceSelector"], {"kubernetes.io/metadata.name": source.namespace})
    else:
        namespace_ok = source.namespace == policy_namespace
    return namespace_ok and _selects(peer.get("podSelector", {}), source.labels)


def allowed(policies: list[dict], source: Pod, destination: Pod, port: int) -> bool:
    isolating = [p for p in policies if p["metadata"]["namespace"] == destination.namespace
                 and "Ingress" in p["spec"]["policyTypes"] and _selects(p["spec"]["podSelector"], destination.labels)]
    if not isolating:
        return True
    for policy in isolating:
        for rule in policy["spec"].get("ingress", []):
            ports = rule.get("ports") or [{"port": port}]
            peers = rule.get("from") or [{"namespaceSelector": {}}]  # absent or empty: every source
            if any(p["port"] == port for p in ports) and any(
                    _peer_matches(peer, policy["metadata"]["namespace"], source) for peer in peers):
                return True
    return False


def _pods(manifests) -> dict[str, Pod]:
    pods = {t["metadata"]["labels"]["app.kubernetes.io/component"]: Pod(NAMESPACE, t["metadata"]["labels"])
            for t in pod_templates(manifests).values()}
    pods["stranger"] = Pod(NAMESPACE, {"app": "something-else"})
    pods["prometheus"] = Pod("monitoring", {"app.kubernetes.io/name": "prometheus"})
    return pods


@pytest.mark.parametrize("port", [GRPC, ROUND])
def test_only_the_coordinator_reaches_the_pools_grpc_and_round_channel(port):
    manifests = render(VALUE_SETS["canary-on"])
    policies, pods = of_kind(manifests, "NetworkPolicy"), _pods(manifests)
    for pool in ("target", "draft", "draft-canary"):
        assert allowed(policies, pods["coordinator"], pods[pool], port), pool
        for source in ("target", "draft", "draft-canary", "operator", "stranger", "prometheus"):
            if source != pool:
                assert not allowed(policies, pods[source], pods[pool], port), f"{source} -> {pool}"
        assert not allowed(policies, pods["coordinator"], pods[pool], port + 1), pool  # nothing beside them


@pytest.mark.parametrize("value_set", ["colocated", "colocated-tls-auth"])
def test_colocated_target_pods_call_the_drafts_and_serve_the_public_api(value_set):
    """Co-located, the coordinators are the target pods: they alone reach the drafts' gRPC and round channel, no pod
    reaches the targets' worker ports, and the targets' public API answers the clients the coordinator would."""
    values = VALUE_SETS[value_set]
    manifests = render(values)
    policies, pods = of_kind(manifests, "NetworkPolicy"), _pods(manifests)
    assert "coordinator" not in pods
    assert not [p for p in policies if p["metadata"]["name"].endswith("-coordinator")]
    client = Pod("apps", {"app": "web"})
    drafts = [pool for pool in ("draft", "draft-canary") if pool in pods]
    for port in (GRPC, ROUND):
        for pool in drafts:
            assert allowed(policies, pods["target"], pods[pool], port), pool
            for source in ("draft", "draft-canary", "operator", "stranger", "prometheus"):
                if source != pool and source in pods:
                    assert not allowed(policies, pods[source], pods[pool], port), f"{source} -> {pool}"
        for source in ("target", "draft", "operator", "stranger", "prometheus"):
            assert not allowed(policies, pods[source], pods["target"], port), f"{source} -> target"
        assert not allowed(policies, client, pods["target"], port)
    narrowed = bool(values.get("networkPolicy", {}).get("clients"))
    for port in (COLOCATED_GRPC, HTTP):
        assert allowed(policies, client, pods["target"], port), port
        assert allowed(policies, pods["stranger"], pods["target"], port) is not narrowed, port
    monitoring = values.get("monitoring", {}).get("podMonitor", {}).get("enabled", False)
    for port in (METRICS, COLOCATED_METRICS):
        assert allowed(policies, pods["operator"], pods["target"], port), port
        assert allowed(policies, pods["prometheus"], pods["target"], port) is monitoring, port
        assert not allowed(policies, pods["stranger"], pods["target"], port), port
    assert not allowed(policies, pods["operator"], pods["draft"], COLOCATED_METRICS)  # only the targets run one


def test_the_coordinator_serves_every_client():
    manifests = render()
    policies, pods = of_kind(manifests, "NetworkPolicy"), _pods(manifests)
    for source in ("stranger", "prometheus", "target"):
        assert allowed(policies, pods[source], pods["coordinator"], GRPC)


def test_clients_can_be_narrowed():
    clients = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "apps"}}}]
    manifests = render({"networkPolicy": {"clients": clients}})
    policies, pods = of_kind(manifests, "NetworkPolicy"), _pods(manifests)
    assert allowed(policies, Pod("apps", {"app": "web"}), pods["coordinator"], GRPC)
    assert not allowed(policies, pods["stranger"], pods["coordinator"], GRPC)


@pytest.mark.parametrize("monitoring", [False, True])
def test_metrics_answer_the_operator_and_monitoring_when_enabled(monitoring):
    manifests = render(VALUE_SETS["monitoring-on"] if monitoring else {})
    policies, pods = of_kind(manifests, "NetworkPolicy"), _pods(manifests)
    for destination in ("coordinator", "target", "draft"):
        assert allowed(policies, pods["operator"], pods[destination], METRICS), destination
        assert not allowed(policies, pods["stranger"], pods[destination], METRICS), destination
        assert allowed(policies, pods["prometheus"], pods[destination], METRICS) is monitoring, destination


@pytest.mark.parametrize("values, monitoring", [({}, False), (VALUE_SETS["monitoring-on"], True),
                                                ({"monitoring": {"serviceMonitor": {"enabled": True}}}, False)])
def test_only_monitoring_calls_into_the_operator_for_its_metrics(values, monitoring):
    """Through the operator's PodMonitor: a ServiceMonitor alone does not scrape it."""
    manifests = render(values)
    policies, pods = of_kind(manifests, "NetworkPolicy"), _pods(manifests)
    for source in ("stranger", "coordinator", "prometheus"):
        assert not allowed(policies, pods[source], pods["operator"], KOPF_HEALTH)
    assert allowed(policies, pods["prometheus"], pods["operator"], METRICS) is monitoring
    for source in ("stranger", "coordinator"):
        assert not allowed(policies, pods[source], pods["operator"], METRICS)


def test_policies_off_leave_traffic_alone():
    manifests = render(VALUE_SETS["network-policy-off"])
    pods = _pods(manifests)
    assert not of_kind(manifests, "NetworkPolicy")
    assert allowed([], pods["stranger"], pods["target"], GRPC)
