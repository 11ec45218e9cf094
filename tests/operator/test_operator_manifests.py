"""Manifest builders, without any API: names, ownership, pod commands, probes, security, GPUs, variants file."""

from __future__ import annotations

import json
from typing import Any

import kubernetes_validate
import pytest

from specsplit.operator import naming
from specsplit.operator.manifests import RolloutPlan, build_objects
from specsplit.operator.spec import InvalidSpecError, parse_spec

OWNER = {"apiVersion": naming.API_VERSION, "kind": naming.KIND,
         "metadata": {"name": "coder", "namespace": "ml", "uid": "0b1c-uid", "labels": {"team": "ml-serving"}}}
SPEC = parse_spec({
    "image": "registry.example/specsplit:0.1.0",
    "imagePullPolicy": "IfNotPresent",
    "numSpeculativeTokens": 6,
    "target": {"model": "qwen2.5-coder-7b-instruct", "replicas": {"min": 2, "max": 6}, "tensorParallelSize": 2,
               "resources": {"requests": {"cpu": "8", "memory": "48Gi"}},
               "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
               "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]},
    "draft": {"model": "qwen2.5-coder-0.5b-instruct", "replicas": {"min": 1, "max": 3}},
    "coordinator": {"replicas": 2, "port": 8443, "resources": {"requests": {"cpu": "1"}}},
    "canary": {"model": "draft-v2", "weight": 20},
    "telemetry": {"otlpEndpoint": "http://otel-collector.observability:4317"},
})
PLAN = RolloutPlan(target_replicas=3, draft_replicas=2, draft_model="qwen2.5-coder-0.5b-instruct",
                   canary_model="draft-v2", canary_weight=20)


def objects(plan: RolloutPlan = PLAN) -> dict[tuple[str, str], dict[str, Any]]:
    return {(obj["kind"], obj["metadata"]["name"]): obj for obj in build_objects(OWNER, SPEC, plan)}


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    [only] = deployment["spec"]["template"]["spec"]["containers"]
    return only


def test_every_object_is_named_labelled_and_owned() -> None:
    built = objects()
    assert set(built) == {
        ("ConfigMap", "coder-coordinator"), ("Service", "coder"), ("Service", "coder-target"),
        ("Service", "coder-draft"), ("Service", "coder-draft-canary"), ("Deployment", "coder-coordinator"),
        ("Deployment", "coder-target"), ("Deployment", "coder-draft"), ("Deployment", "coder-draft-canary")}
    for obj in built.values():
        meta = obj["metadata"]
        assert meta["namespace"] == "ml"
        assert meta["ownerReferences"] == [{"apiVersion": naming.API_VERSION, "kind": naming.KIND, "name": "coder",
                                            "uid": "0b1c-uid", "controller": True, "blockOwnerDeletion": True}]
        assert meta["labels"]["app.kubernetes.io/name"] == "specsplit"
        assert meta["labels"]["app.kubernetes.io/instance"] == "coder"
        assert meta["labels"]["team"] == "ml-serving"  # the owner's labels are carried over
    assert built[("Deployment", "coder-draft-canary")]["metadata"]["labels"]["app.kubernetes.io/component"] \
        == "draft-canary"


def test_objects_are_valid_kubernetes() -> None:
    for obj in build_objects(OWNER, SPEC, PLAN):
        kubernetes_validate.validate(obj, "1.30.0", strict=True)


def test_pod_commands_follow_the_cli_contract() -> None:
    built = objects()
    assert container(built[("Deployment", "coder-target")])["command"] == [
        "specsplit", "target", "--model", "qwen2.5-coder-7b-instruct", "--port", "50051", "--round-port", "50061",
        "--metrics-port", "9090", "--metrics-host", "0.0.0.0", "--tensor-parallel-size", "2", "--warm-up-k", "6",
        "--allow-unauthenticated"]
    assert container(built[("Deployment", "coder-draft")])["command"] == [
        "specsplit", "draft", "--model", "qwen2.5-coder-0.5b-instruct", "--port", "50051", "--round-port", "50061",
        "--metrics-port", "9090", "--metrics-host", "0.0.0.0", "--warm-up-k", "6", "--allow-unauthenticated"]
    assert container(built[("Deployment", "coder-draft-canary")])["command"] == [
        "specsplit", "draft", "--model", "draft-v2", "--port", "50051", "--round-port", "50061",
        "--metrics-port", "9090", "--metrics-host", "0.0.0.0", "--warm-up-k", "6", "--allow-unauthenticated"]
    assert container(built[("Deployment", "coder-coordinator")])["command"] == [
        "specsplit", "coordinator", "--target", "coder-target:50051",
        "--draft-variants-file", "/etc/specsplit/config/draft-variants.json",
        "--port", "50051", "--metrics-port", "9090", "--metrics-host", "0.0.0.0", "--http-port", "8000",
        "--num-speculative-tokens", "6", "--spin-wait", "off"]  # a one-core request leaves no core to spin


@pytest.mark.parametrize("colocated, tensor_parallel_size, resources, spins", [
    (False, 1, {}, False),  # no request: nothing set aside
    (False, 1, {"requests": {"cpu": "500m"}}, False),
    (False, 1, {"requests": {"cpu": "1999m"}}, False),
    (False, 1, {"requests": {"cpu": "2"}}, True),
    (False, 1, {"limits": {"cpu": 4}}, True),  # the request defaults to the limit
    (False, 1, {"requests": {"cpu": "1"}, "limits": {"cpu": "4"}}, False),
    (True, 1, {"requests": {"cpu": "2"}}, True),
    (True, 2, {"requests": {"cpu": "2"}}, False),  # the second rank polls a core of its own
    (True, 2, {"requests": {"cpu": "3000m"}}, True),
])
def test_coordinators_spin_only_where_their_pod_requests_the_cores(colocated: bool, tensor_parallel_size: int,
                                                                    resources: dict[str, Any], spins: bool) -> None:
    """`--spin-wait auto` counts the node's CPUs, which a pod's request does not narrow: the operator turns spinning
    off unless the pod requests a core for it and one for the rest (and, co-located, one per tensor-parallel rank
    past the first)."""
    target: dict[str, Any] = {"model": "big", "tensorParallelSize": tensor_parallel_size}
    coordinator: dict[str, Any] = {"colocated": colocated}
    (target if colocated else coordinator)["resources"] = resources
    spec = parse_spec({"image": "registry.example/specsplit:0.1.0", "target": target, "draft": {"model": "small"},
                       "coordinator": coordinator})
    built = {obj["metadata"]["name"]: obj for obj in build_objects(OWNER, spec, PLAN)}
    command = container(built["coder-target" if colocated else "coder-coordinator"])["command"]
    assert ("--spin-wait" not in command) is spins
    if not spins:
        assert command[command.index("--spin-wait"):][:2] == ["--spin-wait", "off"]


def test_replicas_come_from_the_plan_and_the_spec() -> None:
    built = objects()
    assert built[("Deployment", "coder-target")]["spec"]["replicas"] == 3
    assert built[("Deployment", "coder-draft")]["spec"]["replicas"] == 2
    assert built[("Deployment", "coder-draft-canary")]["spec"]["replicas"] == 1
    assert built[("Deployment", "coder-coordinator")]["spec"]["replicas"] == 2


def test_services_expose_the_coordinator_and_resolve_every_worker_pod() -> None:
    built = objects()
    public = built[("Service", "coder")]["spec"]
    assert public["type"] == "ClusterIP"
    assert public["selector"] == naming.selector("coder", "coordinator")
    assert {p["name"]: (p["port"], p["targetPort"]) for p in public["ports"]} == {
        "grpc": (8443, "grpc"), "http": (8000, "http"), "metrics": (9090, "metrics")}
    for component in ("target", "draft", "draft-canary"):
        headless = built[("Service", f"coder-{component}")]["spec"]
        assert headless["clusterIP"] == "None"
        assert headless["selector"] == naming.selector("coder", component)
        assert {p["name"]: p["port"] for p in headless["ports"]} == {"grpc": 50051, "metrics": 9090}
    deployment = built[("Deployment", "coder-target")]
    assert deployment["spec"]["selector"]["matchLabels"] == naming.selector("coder", "target")
    assert naming.selector("coder", "target").items() <= \
        deployment["spec"]["template"]["metadata"]["labels"].items()


def test_variants_file_routes_the_canary_weight() -> None:
    variants = json.loads(objects()[("ConfigMap", "coder-coordinator")]["data"]["draft-variants.json"])
    assert variants == {"variants": [
        {"name": "stable", "weight": 80, "addresses": ["coder-draft:50051"]},
        {"name": "canary", "weight": 20, "addresses": ["coder-draft-canary:50051"]}]}
    no_canary = RolloutPlan(target_replicas=3, draft_replicas=2, draft_model="draft-v2")
    built = objects(no_canary)
    assert ("Deployment", "coder-draft-canary") not in built and ("Service", "coder-draft-canary") not in built
    assert json.loads(built[("ConfigMap", "coder-coordinator")]["data"]["draft-variants.json"]) == {
        "variants": [{"name": "stable", "weight": 100, "addresses": ["coder-draft:50051"]}]}
    assert container(built[("Deployment", "coder-draft")])["command"][3] == "draft-v2"  # a promoted model


def test_coordinator_mounts_the_variants_file() -> None:
    deployment = objects()[("Deployment", "coder-coordinator")]
    pod = deployment["spec"]["template"]["spec"]
    assert {"name": "config", "configMap": {"name": "coder-coordinator"}} in pod["volumes"]
    assert {"name": "config", "mountPath": "/etc/specsplit/config", "readOnly": True} in \
        container(deployment)["volumeMounts"]


@pytest.mark.parametrize("component", ["coordinator", "target", "draft", "draft-canary"])
def test_pods_are_locked_down_probed_and_cache_models(component: str) -> None:
    deployment = objects()[("Deployment", f"coder-{component}")]
    pod = deployment["spec"]["template"]["spec"]
    main = container(deployment)
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is False
    assert main["securityContext"] == {"runAsNonRoot": True, "allowPrivilegeEscalation": False,
                                       "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]},
                                       "seccompProfile": {"type": "RuntimeDefault"}}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert main[probe]["grpc"] == {"port": 50051}
    assert main["startupProbe"]["periodSeconds"] * main["startupProbe"]["failureThreshold"] == 600  # a model's load
    assert {"name": "metrics", "containerPort": 9090, "protocol": "TCP"} in main["ports"]
    # Workers take the round's calls on their round channel too; a coordinator serves none.
    round_channel = {"name": "round", "containerPort": 50061, "protocol": "TCP"}
    assert (round_channel in main["ports"]) is (component != "coordinator")
    mounts = {mount["mountPath"]: mount["name"] for mount in main["volumeMounts"]}
    assert mounts["/tmp"] == "tmp" and mounts["/models"] == "models"
    env = {item["name"]: item.get("value") for item in main["env"]}
    assert env["SPECSPLIT_CACHE"] == "/models"
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector.observability:4317"
    assert env["OTEL_SERVICE_NAME"] == f"specsplit-{component}"
    assert main["image"] == "registry.example/specsplit:0.1.0" and main["imagePullPolicy"] == "IfNotPresent"


def test_gpus_shared_memory_and_placement_follow_each_role() -> None:
    built = objects()
    target = built[("Deployment", "coder-target")]
    target_pod = target["spec"]["template"]["spec"]
    assert container(target)["resources"] == {
        "requests": {"cpu": "8", "memory": "48Gi", "nvidia.com/gpu": "2"}, "limits": {"nvidia.com/gpu": "2"}}
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in target_pod["volumes"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container(target)["volumeMounts"]
    assert target_pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert target_pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]

    draft = built[("Deployment", "coder-draft")]
    assert container(draft)["resources"] == {"requests": {"nvidia.com/gpu": "1"}, "limits": {"nvidia.com/gpu": "1"}}
    assert all(volume["name"] != "dshm" for volume in draft["spec"]["template"]["spec"]["volumes"])
    assert "nodeSelector" not in draft["spec"]["template"]["spec"]
    coordinator = built[("Deployment", "coder-coordinator")]
    assert container(coordinator)["resources"] == {"requests": {"cpu": "1"}}


def test_model_cache_can_be_a_shared_claim() -> None:
    spec = parse_spec({"image": "i", "target": {"model": "t"}, "draft": {"model": "d"},
                       "modelCache": {"claimName": "model-store"}})
    plan = RolloutPlan(target_replicas=1, draft_replicas=1, draft_model="d")
    deployment = next(obj for obj in build_objects(OWNER, spec, plan)
                      if obj["kind"] == "Deployment" and obj["metadata"]["name"] == "coder-target")
    volumes = {volume["name"]: volume for volume in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["models"] == {"name": "models", "persistentVolumeClaim": {"claimName": "model-store"}}


def test_builders_are_pure() -> None:
    assert build_objects(OWNER, SPEC, PLAN) == build_objects(OWNER, SPEC, PLAN)
    assert "ownerReferences" not in OWNER["metadata"]  # the owner is not touched


def _pods(spec_overrides: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Pod specs of every Deployment, a canary included, for a minimal spec with `spec_overrides`; the
    Deployments checked against the Kubernetes 1.30 schemas when the overrides add something to them."""
    spec = parse_spec({"image": "i", "target": {"model": "t"}, "draft": {"model": "d"},
                       "canary": {"model": "c"}, **spec_overrides})
    plan = RolloutPlan(target_replicas=1, draft_replicas=1, draft_model="d", canary_model="c", canary_weight=10)
    deployments = [obj for obj in build_objects(OWNER, spec, plan) if obj["kind"] == "Deployment"]
    for deployment in deployments if spec_overrides else ():
        kubernetes_validate.validate(deployment, "1.30.0", strict=True)
    return {obj["metadata"]["labels"]["app.kubernetes.io/component"]: obj["spec"]["template"]["spec"]
            for obj in deployments}


def test_each_pool_gets_its_own_affinity_and_the_canary_the_drafts() -> None:
    spread = {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 100, "podAffinityTerm": {
            "topologyKey": "topology.kubernetes.io/zone",
            "labelSelector": {"matchLabels": {"app.kubernetes.io/component": "target"}}}}]}}
    nodes = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "nvidia.com/gpu.product", "operator": "In", "values": ["NVIDIA-L4"]}]}]}}}
    pods = _pods({"target": {"model": "t", "affinity": spread}, "draft": {"model": "d", "affinity": nodes}})
    assert pods["target"]["affinity"] == spread
    assert pods["draft"]["affinity"] == pods["draft-canary"]["affinity"] == nodes
    assert "affinity" not in pods["coordinator"]
    assert "affinity" not in _pods({})["target"]


def test_each_pool_gets_its_own_env_and_it_wins_over_the_operators() -> None:
    target_env = [{"name": "NCCL_DEBUG", "value": "INFO"},
                  {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
                  {"name": "OTEL_SERVICE_NAME", "value": "coder-verifier"}]
    draft_env = [{"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]
    pods = _pods({"target": {"model": "t", "env": target_env}, "draft": {"model": "d", "env": draft_env}})

    def env(component: str) -> list[dict[str, Any]]:
        (main,) = pods[component]["containers"]
        return main["env"]

    names = [variable["name"] for variable in env("target")]
    assert len(names) == len(set(names))  # replaced, not repeated
    assert env("target")[-3:] == target_env  # after the operator's own, so they may refer to $(POD_NAME)
    assert {"name": "OTEL_SERVICE_NAME", "value": "specsplit-target"} not in env("target")
    assert {"name": "SPECSPLIT_CACHE", "value": "/models"} in env("target")
    assert env("draft")[-1] == env("draft-canary")[-1] == draft_env[0]
    assert not any(variable["name"] in ("NCCL_DEBUG", "NODE") for variable in env("coordinator"))


def test_image_pull_secrets_reach_every_pod() -> None:
    pods = _pods({"imagePullSecrets": [{"name": "regcred"}, {"name": "mirror"}]})
    assert set(pods) == {"coordinator", "target", "draft", "draft-canary"}
    for component, pod in pods.items():
        assert pod["imagePullSecrets"] == [{"name": "regcred"}, {"name": "mirror"}], component
    assert all("imagePullSecrets" not in pod for pod in _pods({}).values())


def test_pods_run_as_the_images_user() -> None:
    from specsplit.operator.manifests import RUN_AS_USER

    assert RUN_AS_USER == 10001  # the Dockerfile's USER; tests/charts checks the Dockerfile itself
    for pod in _pods({}).values():
        context = pod["securityContext"]
        assert context["runAsUser"] == context["runAsGroup"] == context["fsGroup"] == RUN_AS_USER


def test_a_sharded_draft_runs_one_process_per_gpu_of_its_pod() -> None:
    spec = parse_spec({"image": "registry.example/specsplit:0.1.0",
                       "target": {"model": "llama-3-70b-instruct", "tensorParallelSize": 4},
                       "draft": {"model": "llama-3-8b-instruct", "tensorParallelSize": 2}})
    built = {(obj["kind"], obj["metadata"]["name"]): obj for obj in build_objects(OWNER, spec, PLAN)}
    for name, degree in (("coder-target", "4"), ("coder-draft", "2")):
        deployment = built[("Deployment", name)]
        command = container(deployment)["command"]
        assert command[command.index("--tensor-parallel-size") + 1] == degree
        assert container(deployment)["resources"]["limits"] == {"nvidia.com/gpu": degree}
        assert {"name": "dshm", "mountPath": "/dev/shm"} in container(deployment)["volumeMounts"]


def test_batch_invariance_reaches_every_model_worker() -> None:
    spec = parse_spec({"image": "registry.example/specsplit:0.1.0", "batchInvariant": True,
                       "target": {"model": "big"}, "draft": {"model": "small"}, "canary": {"model": "draft-v2"}})
    built = {(obj["kind"], obj["metadata"]["name"]): obj for obj in build_objects(OWNER, spec, PLAN)}
    for name in ("coder-target", "coder-draft", "coder-draft-canary"):
        assert container(built[("Deployment", name)])["command"][-2:] == ["--batch-invariant",
                                                                           "--allow-unauthenticated"], name
    assert "--batch-invariant" not in container(built[("Deployment", "coder-coordinator")])["command"]
    ngram = parse_spec({"image": "registry.example/specsplit:0.1.0", "batchInvariant": True,
                        "target": {"model": "big"}, "draft": {"proposer": "ngram"}})
    plan = RolloutPlan(target_replicas=1, draft_replicas=1, draft_model=ngram.draft.model, canary_model=None,
                       canary_weight=0)
    ngram_built = {(obj["kind"], obj["metadata"]["name"]): obj for obj in build_objects(OWNER, ngram, plan)}
    assert "--batch-invariant" not in container(ngram_built[("Deployment", "coder-draft")])["command"]


def test_decode_ahead_reaches_the_target_only_where_set() -> None:
    """spec.target.decodeAhead: the target's --decode-ahead where it is not auto (the CLI's default), in a separate
    target pool and a co-located one; never the draft's (it has no such flag). A bad value and a draft's field are
    refused."""
    def commands(decode_ahead: str | None, colocated: bool = False) -> dict[str, list[str]]:
        target = {"model": "big", **({"decodeAhead": decode_ahead} if decode_ahead else {})}
        spec = parse_spec({"image": "registry.example/specsplit:0.1.0", "target": target, "draft": {"model": "small"},
                           **({"coordinator": {"colocated": True}} if colocated else {})})
        built = {(obj["kind"], obj["metadata"]["name"]): obj for obj in build_objects(OWNER, spec, PLAN)}
        return {name: container(built[("Deployment", name)])["command"] for name in ("coder-target", "coder-draft")}

    for colocated in (False, True):
        target = commands("off", colocated)["coder-target"]
        assert target[target.index("--decode-ahead") + 1] == "off"
        assert "--decode-ahead" not in commands("off", colocated)["coder-draft"]
        assert all("--decode-ahead" not in c for c in commands(None, colocated).values())
        assert all("--decode-ahead" not in c for c in commands("auto", colocated).values())
    with pytest.raises(InvalidSpecError, match=r"spec.target.decodeAhead: 'sometimes' is not one of auto, on, off"):
        parse_spec({"image": "i", "target": {"model": "big", "decodeAhead": "sometimes"}, "draft": {"model": "s"}})
    with pytest.raises(InvalidSpecError, match=r"spec.draft.decodeAhead"):
        parse_spec({"image": "i", "target": {"model": "big"}, "draft": {"model": "s", "decodeAhead": "on"}})


def test_the_operator_knows_the_clis_decode_ahead_modes() -> None:
    from specsplit.operator.spec import DECODE_AHEAD_MODES
    from specsplit.services.target.decode_ahead import DECODE_AHEAD_MODES as CLI_MODES

    assert DECODE_AHEAD_MODES == CLI_MODES


def test_model_workers_warm_up_to_the_deployments_k() -> None:
    """On a GPU a worker captures the rounds' graphs up to --warm-up-k before serving (default 4): a deployment
    whose k is larger passes it, so a policy climbing past 4 never waits for a capture; at 4 the flag is left out."""
    def commands(k: int, draft: dict) -> dict[str, list[str]]:
        spec = parse_spec({"image": "registry.example/specsplit:0.1.0", "numSpeculativeTokens": k,
                           "target": {"model": "big"}, "draft": draft, "canary": {"model": "draft-v2"}})
        plan = RolloutPlan(target_replicas=1, draft_replicas=1, draft_model=spec.draft.model,
                           canary_model=spec.canary.model if spec.canary else None, canary_weight=0)
        return {obj["metadata"]["name"]: container(obj)["command"] for obj in build_objects(OWNER, spec, plan)
                if obj["kind"] == "Deployment"}

    eight = commands(8, {"model": "small"})
    for name in ("coder-target", "coder-draft", "coder-draft-canary"):
        assert eight[name][eight[name].index("--warm-up-k") + 1] == "8", name
    assert "--warm-up-k" not in eight["coder-coordinator"]
    assert not any("--warm-up-k" in command for command in commands(4, {"model": "small"}).values())
    assert "--warm-up-k" not in commands(8, {"proposer": "ngram"})["coder-draft"]  # the n-gram proposer has no graphs
