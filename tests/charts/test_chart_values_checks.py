"""Bad values are refused before anything reaches a cluster, each with a message that names the value and says
what is wrong: values.schema.json for what a schema can say, template checks (`fail`) for the rest."""

import helm_python
import pytest
from chart_render import RELEASE, of_kind, pod_templates, render, speculative_deployment
from chart_values import GPU

SCHEMA_REJECTIONS = {
    "latest tag": ({"image": {"tag": "latest"}},
                   "at '/image/tag': 'latest' does not match pattern"),
    "branch tag": ({"image": {"tag": "main"}},
                   "at '/image/tag': 'main' does not match pattern"),
    "negative replicas": ({"target": {"replicas": {"min": -1, "max": 2}}},
                          "at '/target/replicas/min': minimum: got -1, want 1"),
    "zero coordinators": ({"coordinator": {"replicas": 0}},
                          "at '/coordinator/replicas': minimum: got 0, want 1"),
    "unknown top-level key": ({"targets": {"model": "x"}},
                              "at '': additional properties 'targets' not allowed"),
    "unknown role key": ({"draft": {"gpus": 1}},
                         "at '/draft': additional properties 'gpus' not allowed"),
    "draft over too many GPUs": ({"draft": {"tensorParallelSize": 17}},
                                 "at '/draft/tensorParallelSize': maximum: got 17, want 16"),
    "k too large": ({"speculativeDeployment": {"numSpeculativeTokens": 17}},
                    "at '/speculativeDeployment/numSpeculativeTokens': maximum: got 17, want 16"),
    "bad pull policy": ({"image": {"pullPolicy": "Sometimes"}},
                        "at '/image/pullPolicy': value must be one of 'Always', 'IfNotPresent', 'Never'"),
    "bad GPU quantity": ({"target": {"resources": {"limits": {GPU: "two"}}}},
                         "at '/target/resources/limits/nvidia.com~1gpu': 'two' does not match pattern"),
    "kv utilization over 1": ({"target": {"autoscaling": {"kvUtilization": 1.5}}},
                              "at '/target/autoscaling/kvUtilization': maximum: got 1.5, want 1"),
    "bad OTLP endpoint": ({"otel": {"endpoint": "otel-collector:4317"}},
                          "at '/otel/endpoint': 'otel-collector:4317' does not match pattern"),
    "env without a name": ({"draft": {"extraEnv": [{"value": "1"}]}},
                           "at '/draft/extraEnv/0': missing property 'name'"),
    "env from two sources": ({"draft": {"extraEnv": [{"name": "A", "valueFrom": {
        "fieldRef": {"fieldPath": "spec.nodeName"}, "secretKeyRef": {"name": "s", "key": "k"}}}]}},
        "at '/draft/extraEnv/0/valueFrom': maxProperties: got 2, want 1"),
    "misspelt affinity term": ({"target": {"affinity": {"podAntiAffinity": {"requiredDuringScheduling": []}}}},
                               "at '/target/affinity/podAntiAffinity': additional properties "
                               "'requiredDuringScheduling' not allowed"),
    "TLS secret name not a name": ({"tls": {"enabled": True, "secretName": "Grpc_TLS"}},
                                   "at '/tls/secretName': 'Grpc_TLS' does not match pattern"),
    "pull secret without a name": ({"imagePullSecrets": [{}]}, "at '/imagePullSecrets/0': missing property 'name'"),
    "co-located not a boolean": ({"coordinator": {"colocated": "yes"}},
                                 "at '/coordinator/colocated': got string, want boolean"),
}

TEMPLATE_REJECTIONS = {
    "min above max": ({"target": {"replicas": {"min": 5, "max": 2}}},
                      "target.replicas.min (5) must not exceed target.replicas.max (2)"),
    "co-located with more coordinators": ({"coordinator": {"colocated": True, "replicas": 3}},
                                          "coordinator.replicas (3) does not apply with coordinator.colocated: the "
                                          "coordinator runs in every target pod, so the public API has target.replicas"),
    "fewer GPUs than shards": ({"target": {"tensorParallelSize": 4}},
                               "target.tensorParallelSize (4) needs one GPU per shard: set nvidia.com/gpu to at "
                               "least 4 in target.resources.limits"),
    "draft sharded wider than the target": ({"draft": {"tensorParallelSize": 2,
                                                       "resources": {"requests": {GPU: 2}, "limits": {GPU: 2}}}},
                                            "draft.tensorParallelSize (2) must not exceed target.tensorParallelSize (1)"),
    "GPU requests differ from limits": ({"draft": {"resources": {"requests": {GPU: 2}}}},
                                        "draft.resources: nvidia.com/gpu requests (2) must equal limits (1)"),
    "GPU requested but not limited": ({"draft": {"resources": {"limits": {GPU: None}}}},
                                      "draft.resources: nvidia.com/gpu must be set in limits"),
    "canary without a model": ({"canary": {"enabled": True}},
                               "canary.model is required when canary.enabled is true"),
    "canary same as draft": ({"canary": {"enabled": True, "model": "qwen2.5-coder-0.5b-instruct"}},
                             "canary.model (qwen2.5-coder-0.5b-instruct) is the same as draft.model"),
    "canary weight above its maximum": ({"canary": {"enabled": True, "model": "m", "weight": 60}},
                                        "canary.weight (60) must not exceed canary.promotion.maxWeight (50)"),
    # Switched on without the Secret to use: refused rather than running without TLS or tokens.
    "TLS without its Secret": ({"tls": {"enabled": True}},
                               "enabled without the Secret to use, set: tls.secretName"),
    "public TLS and tokens without their Secrets": (
        {"coordinator": {"tls": {"enabled": True}, "auth": {"enabled": True}}},
        "enabled without the Secret to use, set: coordinator.tls.secretName (a Secret with tls.crt and tls.key); "
        "coordinator.auth.tokenSecretName (a Secret with the key tokens)"),
    "env with a value and a source": (
        {"target": {"extraEnv": [{"name": "NCCL_DEBUG", "value": "INFO"},
                                 {"name": "NODE", "value": "x",
                                  "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]}},
        "target.extraEnv[1] (NODE): set value or valueFrom, not both"),
    "operator not watching the release namespace": (
        {"operator": {"watchNamespaces": ["other"]}},
        "operator.watchNamespaces (other) leaves out the release namespace ml, where the chart creates its "
        "SpeculativeDeployment"),
    "batch invariance with a sharded target": (
        {"speculativeDeployment": {"batchInvariant": True},
         "target": {"tensorParallelSize": 2, "resources": {"requests": {GPU: 2}, "limits": {GPU: 2}}}},
        "speculativeDeployment.batchInvariant needs target.tensorParallelSize and draft.tensorParallelSize 1"),
    "no service account": ({"operator": {"serviceAccount": {"create": False}}},
                           "operator.serviceAccount.name is required when operator.serviceAccount.create is false"),
}


@pytest.mark.parametrize("case", SCHEMA_REJECTIONS)
def test_schema_rejects_bad_values_with_a_clear_message(case):
    values, message = SCHEMA_REJECTIONS[case]
    with pytest.raises(helm_python.HelmValuesError) as raised:
        render(values)
    assert "values don't meet the specifications of the schema" in str(raised.value)
    assert message in str(raised.value)


@pytest.mark.parametrize("case", TEMPLATE_REJECTIONS)
def test_templates_reject_inconsistent_values_with_a_clear_message(case):
    values, message = TEMPLATE_REJECTIONS[case]
    with pytest.raises(helm_python.HelmRenderError) as raised:
        render(values)
    assert message in str(raised.value)


def _pod(manifests, deployment: str) -> dict:
    return pod_templates(manifests)[f"{RELEASE}-specsplit-{deployment}"]["spec"]


def _flag(manifests, deployment: str, flag: str) -> str | None:
    command = _pod(manifests, deployment)["containers"][0]["command"]
    return command[command.index(flag) + 1] if flag in command else None


def _secrets(manifests, deployment: str) -> set[str]:
    return {v["secret"]["secretName"] for v in _pod(manifests, deployment).get("volumes", []) if "secret" in v}


def _target_sharded_over_four_gpus(m) -> bool:
    limits = _pod(m, "target")["containers"][0]["resources"]["limits"]
    return limits[GPU] == "4" and _flag(m, "target", "--tensor-parallel-size") == "4"


def _canary_at_weight_50(m) -> bool:
    canary = speculative_deployment(m)["spec"].get("canary", {})
    return canary.get("weight") == 50 and f"{RELEASE}-specsplit-draft-canary" in pod_templates(m)


def _every_pod_runs_the_release_tag(m) -> bool:
    images = {c["image"] for pod in pod_templates(m).values() for c in pod["spec"]["containers"]}
    return images == {"ghcr.io/specsplit/specsplit:v0.1.0"}


def _operator_runs_as_the_existing_account(m) -> bool:
    return _pod(m, "operator").get("serviceAccountName") == "existing" and not of_kind(m, "ServiceAccount")


def _workers_and_coordinator_mount_grpc_tls(m) -> bool:
    return all("grpc-tls" in _secrets(m, role) for role in ("coordinator", "target", "draft"))


def _coordinator_serves_tls_and_checks_tokens(m) -> bool:
    return ({"public-tls", "api-tokens"} <= _secrets(m, "coordinator")
            and _flag(m, "coordinator", "--tls-cert") is not None
            and _flag(m, "coordinator", "--auth-token-file") is not None)


def _target_has_the_node_env(m) -> bool:
    return {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}} in _pod(m, "target")["containers"][0]["env"]


def _coordinator_in_the_target_pods(m) -> bool:
    deployments = pod_templates(m)
    return (f"{RELEASE}-specsplit-coordinator" not in deployments
            and "--coordinate" in _pod(m, "target")["containers"][0]["command"])


def _workers_batch_invariant(m) -> bool:
    return (speculative_deployment(m)["spec"].get("batchInvariant") is True
            and all("--batch-invariant" in _pod(m, role)["containers"][0]["command"] for role in ("target", "draft")))


# The refused values made consistent, each with what the rendered release must then do.
CONSISTENT = {
    "replicas within bounds": ({"target": {"replicas": {"min": 2, "max": 5}}},
                               lambda m: speculative_deployment(m)["spec"]["target"]["replicas"] == {"min": 2, "max": 5}),
    "one GPU per shard": ({"target": {"tensorParallelSize": 4, "resources": {"requests": {GPU: 4}, "limits": {GPU: 4}}}},
                          _target_sharded_over_four_gpus),
    "canary at its maximum weight": ({"canary": {"enabled": True, "model": "qwen2.5-coder-1.5b-instruct", "weight": 50}},
                                     _canary_at_weight_50),
    "a release tag": ({"image": {"tag": "v0.1.0"}}, _every_pod_runs_the_release_tag),
    "an existing service account": ({"operator": {"serviceAccount": {"create": False, "name": "existing"}}},
                                    _operator_runs_as_the_existing_account),
    "TLS with its Secret": ({"tls": {"enabled": True, "secretName": "grpc-tls"}}, _workers_and_coordinator_mount_grpc_tls),
    "public TLS and tokens with their Secrets": (
        {"coordinator": {"tls": {"enabled": True, "secretName": "public-tls"},
                         "auth": {"enabled": True, "tokenSecretName": "api-tokens"}}},
        _coordinator_serves_tls_and_checks_tokens),
    "env from one source": (
        {"target": {"extraEnv": [{"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]}},
        _target_has_the_node_env),
    "co-located with the default coordinator replicas": ({"coordinator": {"colocated": True}},
                                                         _coordinator_in_the_target_pods),
    "batch invariance with unsharded workers": ({"speculativeDeployment": {"batchInvariant": True}},
                                                _workers_batch_invariant),
}


@pytest.mark.parametrize("case", CONSISTENT)
def test_the_same_values_pass_when_consistent(case):
    """Each refusal above is about the one value it names: fixed, the chart renders, and does what it says."""
    values, applied = CONSISTENT[case]
    assert applied(render(values))
    assert not applied(render())  # the defaults do not already do it
