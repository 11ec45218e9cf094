"""The chart and the operator agree: same CRDs, the operator's RBAC and command, a SpeculativeDeployment the
operator accepts field for field, the peering object it waits for, and selectors that match its pods."""

import ast

import pytest
from chart_render import CHART_DIR, REPO, of_kind, operator_objects, render, speculative_deployment
from chart_values import VALUE_SETS

OPERATOR_DIR = REPO / "operator"


def test_chart_crds_are_byte_identical_to_the_operators():
    operator_crds = {path.name: path.read_bytes() for path in (OPERATOR_DIR / "crd").glob("*.yaml")}
    chart_crds = {path.name: path.read_bytes() for path in (CHART_DIR / "crds").glob("*.yaml")}
    assert {"speculativedeployment.yaml", "kopf-peering.yaml"} <= set(operator_crds)
    assert chart_crds.keys() == operator_crds.keys()
    for name, data in operator_crds.items():
        assert chart_crds[name] == data, f"charts/specsplit/crds/{name} differs: copy operator/crd/{name} over it"


def test_cluster_role_is_the_operators_rbac():
    from specsplit.operator.rbac import RULES

    (cluster_role,) = of_kind(render(), "ClusterRole")
    assert cluster_role["rules"] == RULES
    (binding,) = of_kind(render(), "ClusterRoleBinding")
    (account,) = of_kind(render(), "ServiceAccount")
    assert binding["roleRef"]["name"] == cluster_role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"],
                                    "namespace": "ml"}]


def _grants(rules):
    return {(group, resource, verb) for rule in rules for group in rule["apiGroups"]
            for resource in rule["resources"] for verb in rule["verbs"]}


def test_watching_namespaces_narrows_the_rights_to_roles_there():
    from specsplit.operator.rbac import RULES

    manifests = render(VALUE_SETS["watch-namespaces"])
    roles = of_kind(manifests, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["ml", "ml-staging"]
    assert sorted(b["metadata"]["namespace"] for b in of_kind(manifests, "RoleBinding")) == ["ml", "ml-staging"]
    (discovery,) = of_kind(manifests, "ClusterRole")
    cluster_wide = _grants(discovery["rules"])
    # Cluster-wide, only reading: CRDs (kopf discovers its resources) and namespaces (kopf checks they exist).
    assert cluster_wide == {("apiextensions.k8s.io", "customresourcedefinitions", v) for v in ("list", "watch")} | {
        ("", "namespaces", v) for v in ("list", "watch")}
    # Everything else the operator does is granted inside each namespace, peering there being a KopfPeering.
    needed = {g for g in _grants(RULES) if g[1] not in ("customresourcedefinitions", "clusterkopfpeerings")}
    for role in roles:
        assert _grants(role["rules"]) == needed


def _operator_command_in_main():
    """operator/main.py's OPERATOR_COMMAND, read without importing (importing registers the handlers)."""
    tree = ast.parse((OPERATOR_DIR / "main.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets] == ["OPERATOR_COMMAND"]:
            return ast.literal_eval(node.value)
    raise AssertionError("operator/main.py has no OPERATOR_COMMAND")


def test_operator_runs_the_command_the_operator_documents():
    (deployment,) = of_kind(render(), "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["command"] == _operator_command_in_main()
    (narrowed,) = of_kind(render(VALUE_SETS["watch-namespaces"]), "Deployment")
    command = narrowed["spec"]["template"]["spec"]["containers"][0]["command"]
    assert "--all-namespaces" not in command
    assert [a for a in command if a.startswith("--namespace=")] == ["--namespace=ml", "--namespace=ml-staging"]


def test_chart_creates_the_peering_object_the_operator_waits_for():
    from specsplit.operator.settings import PEERING_NAME

    (deployment,) = of_kind(render(), "Deployment")
    env = {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["SPECSPLIT_OPERATOR_PEERING"] == PEERING_NAME
    (cluster_peering,) = of_kind(render(), "ClusterKopfPeering")
    assert cluster_peering["metadata"]["name"] == PEERING_NAME
    peerings = of_kind(render(VALUE_SETS["watch-namespaces"]), "KopfPeering")
    assert [(p["metadata"]["name"], p["metadata"]["namespace"]) for p in peerings] == [
        (PEERING_NAME, "ml"), (PEERING_NAME, "ml-staging")]


def _undeclared_fields(value, schema, path):
    """Fields the API server would prune: not declared by the CRD's structural schema."""
    if isinstance(value, dict) and "properties" in schema:
        for key, item in value.items():
            if key not in schema["properties"]:
                yield f"{path}.{key}"
            else:
                yield from _undeclared_fields(item, schema["properties"][key], f"{path}.{key}")
    elif isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        for key, item in value.items():
            yield from _undeclared_fields(item, schema["additionalProperties"], f"{path}.{key}")
    elif isinstance(value, list) and "items" in schema:
        for index, item in enumerate(value):
            yield from _undeclared_fields(item, schema["items"], f"{path}[{index}]")


@pytest.mark.parametrize("value_set", [name for name in VALUE_SETS if name != "no-speculative-deployment"])
def test_every_field_of_the_speculative_deployment_reaches_the_operator(value_set):
    from chart_render import crd_documents

    (crd,) = crd_documents("speculativedeployment.yaml")
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    cr = speculative_deployment(render(VALUE_SETS[value_set]))
    assert not list(_undeclared_fields(cr["spec"], schema["properties"]["spec"], "spec"))


def test_undeclared_field_check_can_fail():
    from chart_render import crd_documents

    (crd,) = crd_documents("speculativedeployment.yaml")
    spec_schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    found = list(_undeclared_fields({"target": {"model": "m", "podAnnotations": {}, "env": [{"name": "A", "from": 1}]},
                                     "ingress": {}}, spec_schema, "spec"))
    assert found == ["spec.target.podAnnotations", "spec.target.env[0].from", "spec.ingress"]


def test_speculative_deployment_carries_the_values():
    from specsplit.operator.spec import parse_spec

    values = VALUE_SETS["one-gpu-pools"] | VALUE_SETS["canary-on"] | VALUE_SETS["shared-model-cache-and-otel"]
    spec = parse_spec(speculative_deployment(render(values))["spec"])
    assert spec.image.startswith("ghcr.io/specsplit/specsplit:0.1.0-cu130@sha256:")
    assert spec.target.resources.gpus == 1 and spec.target.resources.limits == {"memory": "32Gi"}
    assert (spec.target.replicas.min, spec.target.replicas.max) == (2, 8)
    assert spec.draft.node_selector == {"nvidia.com/gpu.product": "NVIDIA-L4"}
    assert spec.canary.model == "qwen2.5-coder-1.5b-instruct" and spec.canary.weight == 5
    assert spec.canary.promotion.metric == "acceptanceRate" and spec.canary.promotion.max_weight == 40
    assert spec.model_cache_claim == "coder-specsplit-models"
    assert spec.otlp_endpoint == "http://otel-collector.observability:4317"
    assert spec.coordinator.resources.gpus == 0


def test_monitors_scrape_ports_the_operators_objects_have():
    manifests = render(VALUE_SETS["monitoring-on"] | VALUE_SETS["canary-on"])
    built = operator_objects(speculative_deployment(manifests))
    (pod_monitor,) = [m for m in of_kind(manifests, "PodMonitor")
                      if m["metadata"]["labels"].get("app.kubernetes.io/component") != "operator"]
    (service_monitor,) = of_kind(manifests, "ServiceMonitor")

    def selected(selector, labels):
        return all(labels.get(k) == v for k, v in selector["matchLabels"].items()) and all(
            labels.get(e["key"]) in e["values"] for e in selector.get("matchExpressions", []))

    pods = [o["spec"]["template"] for o in built if o["kind"] == "Deployment"]
    scraped_pods = [p for p in pods if selected(pod_monitor["spec"]["selector"], p["metadata"]["labels"])]
    assert len(scraped_pods) == len(pods) == 4  # coordinator, target, draft, draft-canary
    port = pod_monitor["spec"]["podMetricsEndpoints"][0]["port"]
    for pod in scraped_pods:
        assert port in {p["name"] for p in pod["spec"]["containers"][0]["ports"]}

    services = [o for o in built if o["kind"] == "Service"]
    scraped_services = [s for s in services if selected(service_monitor["spec"]["selector"], s["metadata"]["labels"])]
    assert scraped_services == services
    port = service_monitor["spec"]["endpoints"][0]["port"]
    for service in scraped_services:
        assert port in {p["name"] for p in service["spec"]["ports"]}
