"""Every manifest the chart renders, for every value set, is valid for Kubernetes 1.30.

Built-in kinds go through kubernetes-validate (strict: unknown fields fail). It has no schemas for custom
kinds, so those are checked here instead: SpeculativeDeployment and the kopf peerings against the CRDs the
chart installs, PodMonitor/ServiceMonitor structurally (the Prometheus Operator's CRDs are not available
offline; the check below spells out the fields the chart uses).
"""

import re

import jsonschema
import kubernetes_validate
import pytest
from chart_render import KUBE_VERSION, NAMESPACE, Manifest, crd_documents, render
from chart_values import VALUE_SETS

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DURATION = re.compile(r"^[0-9]+(ms|s|m|h)$")
PROMETHEUS_LABEL = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


def _crd_schemas() -> dict[tuple[str, str], tuple[dict, str]]:
    """(apiVersion, kind) -> (openAPIV3Schema, scope) of every CRD in the chart's crds/."""
    schemas = {}
    for filename in ("speculativedeployment.yaml", "kopf-peering.yaml"):
        for crd in crd_documents(filename):
            for version in crd["spec"]["versions"]:
                key = (f"{crd['spec']['group']}/{version['name']}", crd["spec"]["names"]["kind"])
                schemas[key] = (version["schema"]["openAPIV3Schema"], crd["spec"]["scope"])
    return schemas


CRD_SCHEMAS = _crd_schemas()


def validate_against_crd(body: dict) -> None:
    schema, scope = CRD_SCHEMAS[(body["apiVersion"], body["kind"])]
    # A CRD schema is OpenAPI 3.0, whose keywords (boolean exclusiveMinimum) are JSON Schema draft 4's.
    jsonschema.Draft4Validator(schema).validate(body)
    assert ("namespace" in body["metadata"]) == (scope == "Namespaced"), f"{body['kind']} scope is {scope}"


def validate_prometheus_monitor(body: dict) -> None:
    """The fields of monitoring.coreos.com/v1 PodMonitor / ServiceMonitor the chart sets, and nothing else."""
    assert body["apiVersion"] == "monitoring.coreos.com/v1"
    assert DNS_LABEL.match(body["metadata"]["name"]) and body["metadata"]["namespace"] == NAMESPACE
    spec = body["spec"]
    endpoints_key = "podMetricsEndpoints" if body["kind"] == "PodMonitor" else "endpoints"
    assert {"selector", "namespaceSelector", endpoints_key} <= set(spec) <= \
        {"selector", "namespaceSelector", endpoints_key, "podTargetLabels"}
    assert all(isinstance(label, str) for label in spec.get("podTargetLabels", []))
    assert set(spec["selector"]) <= {"matchLabels", "matchExpressions"}
    assert all(isinstance(v, str) for v in spec["selector"]["matchLabels"].values())
    for expression in spec["selector"].get("matchExpressions", []):
        assert set(expression) == {"key", "operator", "values"} and expression["operator"] == "In"
    assert spec["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    for endpoint in spec[endpoints_key]:
        assert {"port", "path", "interval"} <= set(endpoint) <= {"port", "path", "interval", "honorLabels", "relabelings"}
        assert isinstance(endpoint.get("honorLabels", False), bool)
        for relabeling in endpoint.get("relabelings", []):  # RelabelConfig, as the chart writes it
            assert {"targetLabel"} <= set(relabeling) <= {"targetLabel", "sourceLabels", "replacement"}
            assert PROMETHEUS_LABEL.match(relabeling["targetLabel"])
            assert all(PROMETHEUS_LABEL.match(label) for label in relabeling.get("sourceLabels", []))
            assert isinstance(relabeling.get("replacement", ""), str)
        assert isinstance(endpoint["port"], str) and endpoint["path"].startswith("/")
        assert DURATION.match(endpoint["interval"])


def validate_manifest(manifest: Manifest) -> None:
    body = manifest.body
    if (body["apiVersion"], body["kind"]) in CRD_SCHEMAS:
        validate_against_crd(body)
    elif body["kind"] in ("PodMonitor", "ServiceMonitor"):
        validate_prometheus_monitor(body)
    else:
        # Raises SchemaNotFoundError for a kind it does not know: no silent pass for a typo'd apiVersion.
        kubernetes_validate.validate(body, KUBE_VERSION, strict=True)


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_every_rendered_manifest_is_valid_for_kubernetes(value_set):
    manifests = render(VALUE_SETS[value_set])
    assert manifests
    for manifest in manifests:
        try:
            validate_manifest(manifest)
        except (kubernetes_validate.ValidationError, jsonschema.ValidationError) as error:
            path = ".".join(str(p) for p in error.path)
            pytest.fail(f"{manifest.template}: {manifest.kind}/{manifest.name}: {path}: {error.message}")


def test_validation_catches_a_broken_manifest():
    """The checks above can fail: a wrong field type in a Deployment and in the SpeculativeDeployment."""
    manifests = {m.kind: m for m in render()}
    deployment = manifests["Deployment"].body
    deployment["spec"]["replicas"] = "one"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBE_VERSION, strict=True)
    cr = manifests["SpeculativeDeployment"].body
    cr["spec"]["target"]["autoscaling"]["kvUtilization"] = 1.5
    with pytest.raises(jsonschema.ValidationError):
        validate_against_crd(cr)


def test_the_chart_crds_are_valid_crds():
    for filename in ("speculativedeployment.yaml", "kopf-peering.yaml"):
        for crd in crd_documents(filename):
            kubernetes_validate.validate(crd, KUBE_VERSION, strict=True)


def test_optional_objects_appear_only_when_enabled():
    kinds = lambda values: sorted(m.kind for m in render(values))  # noqa: E731
    default = kinds({})
    assert "PodMonitor" not in default and "ServiceMonitor" not in default
    assert "PersistentVolumeClaim" not in default
    assert default.count("NetworkPolicy") == 4  # operator, coordinator, target, draft
    monitoring = kinds(VALUE_SETS["monitoring-on"])
    assert monitoring.count("PodMonitor") == 2 and monitoring.count("ServiceMonitor") == 1  # + the operator's
    # The operator's PodMonitor comes with the PodMonitors only (their labels; their CRD may be all there is).
    service_monitor_only = kinds({"monitoring": {"serviceMonitor": {"enabled": True}}})
    assert "PodMonitor" not in service_monitor_only and service_monitor_only.count("ServiceMonitor") == 1
    assert "NetworkPolicy" not in kinds(VALUE_SETS["network-policy-off"])
    assert kinds(VALUE_SETS["canary-on"]).count("NetworkPolicy") == 5  # + draft-canary
    assert kinds(VALUE_SETS["colocated"]).count("NetworkPolicy") == 4  # no coordinator pods: no policy of theirs
    assert "PersistentVolumeClaim" in kinds(VALUE_SETS["shared-model-cache-and-otel"])
    without_cr = kinds(VALUE_SETS["no-speculative-deployment"])
    assert "SpeculativeDeployment" not in without_cr and "Deployment" in without_cr
