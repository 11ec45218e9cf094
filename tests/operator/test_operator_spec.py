"""Spec validation and defaults (pure), and the CRD's schema agreeing with them."""

from __future__ import annotations

import copy
import pathlib
from typing import Any

import celpy
import jsonschema
import kubernetes_validate
import pytest
import yaml

from specsplit.operator import naming
from specsplit.operator.spec import InternalTLS, InvalidSpecError, parse_spec

CRD_PATH = pathlib.Path(__file__).resolve().parents[2] / "operator" / "crd" / "speculativedeployment.yaml"
MINIMAL = {"image": "registry.example/specsplit:0.1.0", "target": {"model": "big"}, "draft": {"model": "small"}}


def errors_of(spec: dict[str, Any], name: str | None = None) -> list[str]:
    with pytest.raises(InvalidSpecError) as caught:
        parse_spec(spec, name)
    return caught.value.errors


def crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_PATH.read_text())


def schema() -> dict[str, Any]:
    return crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def with_schema_defaults(node: dict[str, Any], value: Any) -> Any:
    """Apply the schema's `default`s the way the API server's structural defaulting does."""
    if not isinstance(value, dict) or node.get("type") != "object":
        return value
    result = dict(value)
    for key, child in (node.get("properties") or {}).items():
        if key not in result and "default" in child:
            result[key] = copy.deepcopy(child["default"])
        if key in result:
            result[key] = with_schema_defaults(child, result[key])
    return result


def cel_admits(node: dict[str, Any], value: dict[str, Any], message: str) -> bool:
    """Whether the rule of `node`'s x-kubernetes-validations whose message starts with `message` admits `value`,
    defaulted first and evaluated by a CEL interpreter, as the API server does (kmock's emulator evaluates no CEL)."""
    (rule,) = [rule["rule"] for rule in node["x-kubernetes-validations"] if rule["message"].startswith(message)]
    environment = celpy.Environment()
    program = environment.program(environment.compile(rule))
    return bool(program.evaluate({"self": celpy.json_to_cel(with_schema_defaults(node, value))}))


def parses(spec: dict[str, Any]) -> bool:
    try:
        parse_spec(spec)
    except InvalidSpecError:
        return False
    return True


def test_minimal_spec_gets_the_defaults() -> None:
    spec = parse_spec(MINIMAL)
    assert spec.num_speculative_tokens == 4
    assert (spec.target.replicas.min, spec.target.replicas.max) == (1, 1)
    assert spec.target.metric_targets == {"kvUtilization": 0.8, "verifyQueueDepth": 4.0}
    assert spec.draft.metric_targets == {"proposeQueueDepth": 4.0}
    assert spec.target.resources.gpus == 1 and spec.target.tensor_parallel_size == 1
    assert spec.canary is None and spec.coordinator.port == 50051
    assert spec.autoscaling.scale_down_window_seconds == 300 and spec.autoscaling.max_step == 2


def test_max_defaults_to_min_and_gpus_to_the_shard_count() -> None:
    spec = parse_spec({**MINIMAL, "target": {"model": "big", "replicas": {"min": 3}, "tensorParallelSize": 4}})
    assert (spec.target.replicas.min, spec.target.replicas.max) == (3, 3)
    assert spec.target.resources.gpus == 4


def test_every_problem_is_reported_with_its_field() -> None:
    errors = errors_of({
        "image": "",
        "numSpeculativeTokens": 17,
        "target": {"model": "big", "replicas": {"min": 4, "max": 2}, "tensorParallelSize": 2,
                   "resources": {"gpus": 1}, "autoscaling": {"proposeQueueDepth": 3}},
        "draft": {"model": "small", "tensorParallelSize": 4},
        "canary": {"model": "new", "weight": 60, "promotion": {"metric": "latency", "maxWeight": 50}},
        "autoscaling": {"maxStep": 0},
        "surprise": True,
    })
    expected = [
        "spec.surprise: unknown field",
        "spec.image: must be a non-empty string",
        "spec.numSpeculativeTokens: must be at most 16, got 17",
        "spec.target.replicas: min (4) must not exceed max (2)",
        "spec.target.resources.gpus: 1 GPUs cannot hold 2 shards",
        "spec.target.autoscaling.proposeQueueDepth: unknown field",
        "spec.draft.tensorParallelSize: the draft (4) must not be sharded over more GPUs than the target (2)",
        "spec.canary.promotion.metric: 'latency' is not one of tokensPerSecond, acceptanceRate",
        "spec.canary.weight: 60 exceeds promotion.maxWeight (50)",
        "spec.autoscaling.maxStep: must be at least 1, got 0",
    ]
    for fragment in expected:
        assert any(fragment in error for error in errors), f"missing {fragment!r} in {errors}"
    assert len(errors) == len(expected)


@pytest.mark.parametrize("bad, fragment", [
    ({"target": {"model": "big", "replicas": {"min": "two"}}}, "spec.target.replicas.min: must be an integer"),
    ({"target": {"model": "big", "replicas": {"min": True}}}, "spec.target.replicas.min: must be an integer"),
    ({"target": {"model": "big", "autoscaling": {"kvUtilization": 1.5}}}, "kvUtilization: must be at most 1.0"),
    ({"target": {"model": "big", "autoscaling": {"verifyQueueDepth": 0}}}, "verifyQueueDepth: must be greater than 0"),
    ({"target": {"model": "big", "tensorParallelSize": 2, "resources": {"gpus": 0}}}, "one GPU per shard"),
    ({"target": {"model": "big", "resources": {"limits": {"nvidia.com/gpu": 1}}}}, "not nvidia.com/gpu"),
    ({"target": {}}, "spec.target.model: required"),
    ({"draft": "small"}, "spec.draft: must be an object"),
    ({"canary": {"weight": 10}}, "spec.canary.model: required"),
    ({"imagePullPolicy": "Sometimes"}, "'Sometimes' is not one of Always, IfNotPresent, Never"),
    ({"imagePullSecrets": "regcred"}, "spec.imagePullSecrets: must be a list of objects"),
    ({"imagePullSecrets": [{"name": ""}]}, "spec.imagePullSecrets[0].name: must be a non-empty string"),
    ({"imagePullSecrets": [{"name": "Reg_Cred"}]}, "spec.imagePullSecrets[0].name: 'Reg_Cred' must be a lowercase"),
    ({"tls": {"mutual": False}}, "spec.tls.secretName: required"),
    ({"tls": {"secretName": "grpc-tls", "mutual": "yes"}}, "spec.tls.mutual: must be true or false"),
    ({"tls": {"secretName": "grpc-tls", "serverName": "two words"}}, "spec.tls.serverName: 'two words' must be a DNS"),
    ({"tls": {"secretName": "grpc-tls", "caSecretName": "ca"}}, "spec.tls.caSecretName: unknown field"),
    ({"coordinator": {"auth": {}}}, "spec.coordinator.auth.tokenSecretName: required"),
    ({"coordinator": {"tls": {"secretName": "public-tls", "clientCA": "x"}}}, "spec.coordinator.tls.clientCA: unknown"),
    ({"coordinator": {"tls": {"secretName": "public.tls."}}}, "spec.coordinator.tls.secretName: 'public.tls.' must be"),
    ({"target": {"model": "big", "env": {"A": "1"}}}, "spec.target.env: must be a list of objects"),
    ({"target": {"model": "big", "env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]}},
     "spec.target.env[1].name: 'A' is set twice"),
    ({"target": {"model": "big", "env": [{"name": "1A", "value": "1"}]}},
     "spec.target.env[0].name: '1A' must be an environment variable name"),
    ({"target": {"model": "big", "env": [{"name": "A", "value": 1}]}}, "spec.target.env[0].value: must be a string"),
    ({"draft": {"model": "small", "env": [{"name": "A", "value": "1",
                                            "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]}},
     "spec.draft.env[0]: set value or valueFrom, not both"),
    ({"draft": {"model": "small", "env": [{"name": "A", "valueFrom": {
        "fieldRef": {"fieldPath": "spec.nodeName"}, "secretKeyRef": {"name": "s", "key": "k"}}}]}},
     "spec.draft.env[0].valueFrom: must have exactly one of fieldRef, resourceFieldRef"),
    ({"draft": {"model": "small", "env": [{"name": "A", "valueFrom": {"secretKeyRef": {"name": "s"}}}]}},
     "spec.draft.env[0].valueFrom.secretKeyRef.key: required"),
    ({"draft": {"model": "small", "env": [{"name": "A", "valueFrom": {"vaultRef": {}}}]}},
     "spec.draft.env[0].valueFrom.vaultRef: unknown field"),
    ({"target": {"model": "big", "affinity": {"nodeAfinity": {}}}}, "spec.target.affinity.nodeAfinity: unknown field"),
    ({"target": {"model": "big", "affinity": {"podAntiAffinity": {"requiredDuringScheduling": []}}}},
     "spec.target.affinity.podAntiAffinity.requiredDuringScheduling: unknown field"),
    ({"target": {"model": "big", "affinity": {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": [{"nodeSelectorTerms": []}]}}}},
     "spec.target.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution: must be an object"),
    ({"draft": {"model": "small", "affinity": {"podAffinity": {
        "preferredDuringSchedulingIgnoredDuringExecution": {"weight": 1}}}}},
     "spec.draft.affinity.podAffinity.preferredDuringSchedulingIgnoredDuringExecution: must be a list of objects"),
    ({"coordinator": {"arrivalWindowMs": -1}}, "spec.coordinator.arrivalWindowMs: must be at least 0"),
    ({"coordinator": {"arrivalWindowMs": "2ms"}}, "spec.coordinator.arrivalWindowMs: must be a number"),
    ({"coordinator": {"maxNumSeqs": 0}}, "spec.coordinator.maxNumSeqs: must be at least 1"),
    ({"coordinator": {"maxWaiting": 2.5}}, "spec.coordinator.maxWaiting: must be an integer"),
    ({"batchInvariant": "yes"}, "spec.batchInvariant: must be true or false"),
    ({"batchInvariant": True, "target": {"model": "big", "tensorParallelSize": 2}},
     "spec.batchInvariant: needs target and draft tensorParallelSize 1"),
])
def test_single_problems(bad: dict[str, Any], fragment: str) -> None:
    errors = errors_of({**MINIMAL, **bad})
    assert any(fragment in error for error in errors), errors


def test_transport_security_placement_env_and_pull_secrets_are_off_unless_set() -> None:
    spec = parse_spec(MINIMAL)
    assert spec.tls is None and spec.image_pull_secrets == ()
    assert spec.coordinator.tls_secret_name is None and spec.coordinator.auth_token_secret_name is None
    assert spec.target.affinity == {} and spec.target.env == () and spec.draft.env == ()


def test_transport_security_placement_env_and_pull_secrets_are_read() -> None:
    anti_affinity = {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchLabels": {"role": "target"}}}]}}
    env = [{"name": "NCCL_DEBUG", "value": "INFO"},
           {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]
    raw = {**MINIMAL, "imagePullSecrets": [{"name": "regcred"}, {"name": "mirror-credentials"}],
           "tls": {"secretName": "grpc-tls", "serverName": "specsplit-workers.ml.svc"},
           "coordinator": {"tls": {"secretName": "public-tls"}, "auth": {"tokenSecretName": "api-tokens"}},
           "target": {"model": "big", "affinity": anti_affinity, "env": env}}
    spec = parse_spec(raw)
    assert spec.image_pull_secrets == ("regcred", "mirror-credentials")
    assert spec.tls == InternalTLS(secret_name="grpc-tls", mutual=True, server_name="specsplit-workers.ml.svc")
    assert spec.coordinator.tls_secret_name == "public-tls"
    assert spec.coordinator.auth_token_secret_name == "api-tokens"
    assert spec.target.affinity == anti_affinity and spec.target.env == tuple(env)
    raw["target"]["env"][0]["value"] = "WARN"  # the typed spec holds its own copy
    assert spec.target.env[0]["value"] == "INFO"
    assert parse_spec({**MINIMAL, "tls": {"secretName": "grpc-tls", "mutual": False}}).tls.mutual is False


@pytest.mark.parametrize("name, valid", [("coder", True), ("a" * 50, True), ("a" * 51, False),
                                         ("9coder", False), ("coder.v2", False), ("Coder", False)])
def test_the_name_must_fit_every_owned_service_name(name: str, valid: bool) -> None:
    if valid:
        parse_spec(MINIMAL, name)
    else:
        assert errors_of(MINIMAL, name)[0].startswith("metadata.name: ")


def test_the_crd_is_a_valid_structural_crd() -> None:
    document = crd()
    kubernetes_validate.validate(document, "1.30.0", strict=True)
    assert document["spec"]["names"]["shortNames"] == [naming.SHORT_NAME]
    version = document["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    columns = {column["name"]: column["jsonPath"] for column in version["additionalPrinterColumns"]}
    assert columns["Target"] == ".status.target.desiredReplicas"
    assert columns["Ready"] == '.status.conditions[?(@.type=="Ready")].status'

    free_form = []

    def walk(node: dict[str, Any], path: str) -> None:
        # Structural: every node says its type (or is an int-or-string). Free-form objects only for the
        # scheduling terms of a core/v1 Affinity, a type too large to spell out (the API server checks it
        # in the Deployments the operator writes).
        assert "type" in node or node.get("x-kubernetes-int-or-string"), f"{path} has no type"
        if node.get("x-kubernetes-preserve-unknown-fields"):
            free_form.append(path)
            assert node["type"] == "object" and "properties" not in node, path
        for key, child in (node.get("properties") or {}).items():
            walk(child, f"{path}.{key}")
        if isinstance(node.get("items"), dict):
            walk(node["items"], f"{path}[]")
        if isinstance(node.get("additionalProperties"), dict):
            walk(node["additionalProperties"], f"{path}{{}}")
    walk(schema(), "")
    terms = ("requiredDuringSchedulingIgnoredDuringExecution", "preferredDuringSchedulingIgnoredDuringExecution")
    allowed = {f".spec.{pool}.affinity.{kind}.{term}{'' if (kind, term) == ('nodeAffinity', terms[0]) else '[]'}"
               for pool in ("target", "draft") for kind in ("nodeAffinity", "podAffinity", "podAntiAffinity")
               for term in terms}
    assert set(free_form) == allowed
    spec_properties = schema()["properties"]["spec"]["properties"]
    assert all(child.get("description") for key, child in spec_properties.items() if key != "telemetry")


def test_crd_defaults_match_the_operator_defaults() -> None:
    """Defaulted by the API server or by parse_spec: the same values either way."""
    spec_schema = schema()["properties"]["spec"]
    raw = copy.deepcopy(MINIMAL) | {"canary": {"model": "new"}, "tls": {"secretName": "grpc-tls"},
                                    "coordinator": {"tls": {"secretName": "public-tls"}}}
    assert parse_spec(with_schema_defaults(spec_schema, raw)) == parse_spec(raw)
    assert parse_spec(with_schema_defaults(spec_schema, raw)).tls.mutual is True


def test_crd_schema_accepts_a_full_spec_and_rejects_what_the_operator_rejects() -> None:
    spec_schema = schema()["properties"]["spec"]
    full = {
        "image": "registry.example/specsplit:0.1.0", "imagePullPolicy": "IfNotPresent", "numSpeculativeTokens": 6,
        "target": {"model": "big", "replicas": {"min": 2, "max": 8}, "tensorParallelSize": 2,
                   "resources": {"gpus": 2, "requests": {"cpu": "8", "memory": "64Gi"}, "limits": {"memory": "64Gi"}},
                   "nodeSelector": {"nvidia.com/gpu.product": "H100"},
                   "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
                   "autoscaling": {"kvUtilization": 0.75, "verifyQueueDepth": 6}},
        "draft": {"model": "small", "replicas": {"min": 1, "max": 4},
                  "autoscaling": {"proposeQueueDepth": 8, "proposeLatencySeconds": 0.04}},
        "coordinator": {"replicas": 2, "port": 8443, "arrivalWindowMs": 2.5, "maxNumSeqs": 64, "maxWaiting": 512},
        "canary": {"model": "new", "weight": 5, "replicas": 1,
                   "promotion": {"metric": "acceptanceRate", "confidence": 0.99, "minRequests": 500,
                                 "stepPercent": 5, "maxWeight": 30, "intervalSeconds": 120}},
        "autoscaling": {"stabilizationWindowSeconds": 600, "scaleDownCooldownSeconds": 300, "maxStep": 1,
                        "intervalSeconds": 15},
        "modelCache": {"claimName": "models"}, "telemetry": {"otlpEndpoint": "http://otel-collector:4317"},
        "imagePullSecrets": [{"name": "registry-credentials"}],
        "tls": {"secretName": "grpc-tls", "mutual": False, "serverName": "workers.coder.internal"},
    }
    full["coordinator"] |= {"tls": {"secretName": "public-tls"}, "auth": {"tokenSecretName": "api-tokens"}}
    full["target"] |= {
        "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 100, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                                "labelSelector": {"matchLabels": {"app": "x"}}}}]}},
        "env": [{"name": "NCCL_DEBUG", "value": "INFO"},
                {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}]}
    # OpenAPI v3.0 schemas are JSON Schema draft 4 in this respect (boolean exclusiveMinimum).
    validator = jsonschema.Draft4Validator(spec_schema)
    validator.validate(full)
    parse_spec(full)
    for path, value in [(("numSpeculativeTokens",), 17), (("canary", "promotion", "metric"), "latency"),
                        (("draft", "tensorParallelSize"), 17), (("target", "replicas", "min"), 0),
                        (("tls",), {"mutual": True}), (("tls", "mutual"), "yes"),
                        (("coordinator", "auth"), {}), (("coordinator", "arrivalWindowMs"), -1),
                        (("coordinator", "maxNumSeqs"), 0), (("coordinator", "maxWaiting"), 0),
                        (("imagePullSecrets",), [{}]),
                        (("target", "env", 0), {"value": "no name"}),
                        (("target", "env", 1, "valueFrom"), {}),
                        (("target", "env", 1, "valueFrom", "fieldRef"), {"fieldPath": "metadata.name"}),
                        (("target", "env", 0, "name"), "1NCCL"),
                        (("target", "affinity", "podAntiAffinity", "preferredDuringSchedulingIgnoredDuringExecution"),
                         {"weight": 1})]:
        bad = copy.deepcopy(full)
        node = bad
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        with pytest.raises(jsonschema.ValidationError):
            validator.validate(bad)
        with pytest.raises(InvalidSpecError):
            parse_spec(bad)


def test_draft_sharded_over_fewer_gpus_than_the_target() -> None:
    spec = parse_spec({**MINIMAL, "target": {"model": "big", "tensorParallelSize": 4},
                       "draft": {"model": "small", "tensorParallelSize": 2}})
    assert (spec.target.tensor_parallel_size, spec.target.resources.gpus) == (4, 4)
    assert (spec.draft.tensor_parallel_size, spec.draft.resources.gpus) == (2, 2)


def test_batch_invariance_is_off_unless_set() -> None:
    assert parse_spec(MINIMAL).batch_invariant is False
    assert parse_spec({**MINIMAL, "batchInvariant": True}).batch_invariant is True
    spec_schema = schema()["properties"]["spec"]
    assert spec_schema["properties"]["batchInvariant"]["default"] is False
    jsonschema.Draft4Validator(spec_schema).validate({**MINIMAL, "batchInvariant": True})


@pytest.mark.parametrize("spec, admitted", [
    ({**MINIMAL, "batchInvariant": True}, True),
    ({**MINIMAL, "batchInvariant": False, "target": {"model": "big", "tensorParallelSize": 2}}, True),
    ({**MINIMAL, "target": {"model": "big", "tensorParallelSize": 2}}, True),  # off by default
    ({**MINIMAL, "batchInvariant": True, "target": {"model": "big", "tensorParallelSize": 2}}, False),
    ({**MINIMAL, "batchInvariant": True, "target": {"model": "big", "tensorParallelSize": 2},
      "draft": {"model": "small", "tensorParallelSize": 2}}, False),
])
def test_the_api_server_refuses_batch_invariance_where_the_operator_does(spec: dict[str, Any], admitted: bool) -> None:
    spec_schema = schema()["properties"]["spec"]
    assert cel_admits(spec_schema, spec, "batchInvariant needs") is admitted
    assert parses(spec) is admitted


def test_colocated_coordinator_is_off_unless_set_and_refuses_what_would_not_apply() -> None:
    assert parse_spec(MINIMAL).coordinator.colocated is False
    spec = parse_spec({**MINIMAL, "coordinator": {"colocated": True, "port": 8443, "httpPort": 0}})
    assert spec.coordinator.colocated is True and (spec.coordinator.port, spec.coordinator.http_port) == (8443, 0)
    assert parse_spec({**MINIMAL, "coordinator": {"colocated": True, "replicas": 1}}).coordinator.colocated
    errors = errors_of({**MINIMAL, "coordinator": {"colocated": True, "replicas": 2,
                                                    "resources": {"requests": {"cpu": "1"}}}})
    assert errors == [
        "spec.coordinator.replicas: 2 does not apply with colocated: true; the coordinator runs in every target pod, "
        "so the public API has spec.target.replicas (autoscaled)",
        "spec.coordinator.resources: does not apply with colocated: true; the coordinator shares the target "
        "container's (spec.target.resources)"]
    assert errors_of({**MINIMAL, "coordinator": {"colocated": "yes"}}) == [
        "spec.coordinator.colocated: must be true or false"]
    # The same without co-location is fine.
    parse_spec({**MINIMAL, "coordinator": {"replicas": 2, "resources": {"requests": {"cpu": "1"}}}})
    coordinator_schema = schema()["properties"]["spec"]["properties"]["coordinator"]
    assert coordinator_schema["properties"]["colocated"] == {**coordinator_schema["properties"]["colocated"],
                                                             "type": "boolean", "default": False}
    jsonschema.Draft4Validator(schema()["properties"]["spec"]).validate(
        {**MINIMAL, "coordinator": {"colocated": True}})
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft4Validator(schema()["properties"]["spec"]).validate(
            {**MINIMAL, "coordinator": {"colocated": "yes"}})
    status = schema()["properties"]["status"]["properties"]["coordinator"]["properties"]
    assert status["mode"]["enum"] == ["Separate", "Colocated"]


@pytest.mark.parametrize("coordinator, admitted", [
    ({"colocated": True}, True),  # replicas defaulted to 1 before the rule runs
    ({"colocated": True, "replicas": 1}, True),
    ({"colocated": True, "replicas": 3}, False),
    ({"colocated": True, "resources": {"requests": {"cpu": "1"}}}, False),
    ({"colocated": False, "replicas": 3, "resources": {"requests": {"cpu": "1"}}}, True),
    ({"replicas": 3, "resources": {"requests": {"cpu": "1"}}}, True),
])
def test_the_api_server_refuses_what_a_colocated_coordinator_ignores_as_the_operator_does(
        coordinator: dict[str, Any], admitted: bool) -> None:
    coordinator_schema = schema()["properties"]["spec"]["properties"]["coordinator"]
    assert cel_admits(coordinator_schema, coordinator, "a co-located coordinator") is admitted
    assert parses({**MINIMAL, "coordinator": coordinator}) is admitted
