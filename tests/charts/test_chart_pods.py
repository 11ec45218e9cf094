"""Every pod of a release, for every value set: the operator's (rendered by the chart) and the coordinator's
and pools' (built by the operator's own code from the SpeculativeDeployment the chart renders).

Safe by default: non-root, read-only root filesystem, no capabilities, no privilege escalation, seccomp.
GPU-cluster ready: GPUs, placement, /dev/shm for tensor parallelism, the model cache, gRPC health probes.
"""

import kubernetes_validate
import pytest
from chart_render import KUBE_VERSION, of_kind, operator_objects, pod_templates, render, speculative_deployment
from chart_values import GPU, VALUE_SETS

WORKERS = ("coordinator", "target", "draft", "draft-canary")


def _component(template: dict) -> str:
    return template["metadata"]["labels"]["app.kubernetes.io/component"]


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_every_pod_is_locked_down(value_set):
    pods = pod_templates(render(VALUE_SETS[value_set]))
    assert pods
    for name, template in pods.items():
        pod = template["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"].get("runAsUser", 1) != 0, name
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC"), name
        for container in pod["containers"] + pod.get("initContainers", []):
            where = f"{name}/{container['name']}"
            security = container["securityContext"]
            assert security["allowPrivilegeEscalation"] is False, where
            assert security["readOnlyRootFilesystem"] is True, where
            assert security["capabilities"]["drop"] == ["ALL"], where
            assert not security["capabilities"].get("add"), where
            assert not security.get("privileged"), where
            repository, _, tag = container["image"].split("@")[0].rpartition(":")
            assert repository and tag and tag != "latest", where
            # A read-only root needs somewhere to write: /tmp is an emptyDir in every pod.
            assert any(m["mountPath"] == "/tmp" for m in container["volumeMounts"]), where


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_operator_built_deployments_are_valid_for_kubernetes(value_set):
    manifests = render(VALUE_SETS[value_set])
    if not of_kind(manifests, "SpeculativeDeployment"):
        assert value_set == "no-speculative-deployment"
        return
    for obj in operator_objects(speculative_deployment(manifests)):
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


def _colocated(values: dict, component: str) -> bool:
    """A target pod that also runs the coordinator (coordinator.colocated)."""
    return component == "target" and values.get("coordinator", {}).get("colocated", False)


def _serves_tls(values: dict, component: str) -> bool:
    """Whether the probed port serves TLS: the public one's (coordinator.tls) where the coordinator runs."""
    if component == "coordinator" or _colocated(values, component):
        return values.get("coordinator", {}).get("tls", {}).get("enabled", False)
    return values.get("tls", {}).get("enabled", False)


@pytest.mark.parametrize("value_set", [name for name in VALUE_SETS if name != "no-speculative-deployment"])
def test_worker_pods_are_probed_over_grpc_health_or_tcp_under_tls(value_set):
    """Kubernetes' grpc probe speaks plaintext only: a port serving TLS is probed by a TCP connect instead. A pod
    running a coordinator is probed on its public port (it takes clients once that serves)."""
    values = VALUE_SETS[value_set]
    for name, template in pod_templates(render(values)).items():
        component = _component(template)
        if component not in WORKERS:
            continue
        (container,) = template["spec"]["containers"]
        handler = "tcpSocket" if _serves_tls(values, component) else "grpc"
        port = 50050 if _colocated(values, component) else 50051
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe][handler] == {"port": port}, f"{name}: {probe}"
            assert {"grpc", "tcpSocket"} & set(container[probe]) == {handler}, f"{name}: {probe}"
        if component == "coordinator":  # the OpenAI-compatible API beside gRPC
            expected = {"grpc": 50051, "metrics": 9090, "http": 8000}
        elif _colocated(values, component):  # the coordinator's ports; no round channel (called in-process)
            expected = {"grpc": 50051, "metrics": 9090, "coord-grpc": 50050, "http": 8000, "coord-metrics": 9091}
        else:  # every other worker takes rounds on its round channel too
            expected = {"grpc": 50051, "metrics": 9090, "round": 50061}
        assert {p["name"]: p["containerPort"] for p in container["ports"]} == expected, name
        assert ("--round-port" in container["command"]) is (component != "coordinator"), name
        if component != "coordinator":
            assert _args(container)["--round-port"] == ("-1" if _colocated(values, component) else "50061"), name


def _by_component(value_set: str) -> dict[str, dict]:
    return _by_component_of(VALUE_SETS[value_set])


def _by_component_of(values: dict) -> dict[str, dict]:
    return {_component(t): t["spec"] for t in pod_templates(render(values)).values()}


def test_operator_pod_runs_kopf_with_a_liveness_endpoint():
    operator = _by_component("defaults")["operator"]
    (container,) = operator["containers"]
    assert container["command"][:2] == ["kopf", "run"]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert {"name": "health", "containerPort": 8080, "protocol": "TCP"} in container["ports"]


def test_default_pools_get_one_gpu_each_and_tolerate_gpu_taints():
    pods = _by_component("defaults")
    for role in ("target", "draft"):
        resources = pods[role]["containers"][0]["resources"]
        assert resources["limits"][GPU] == resources["requests"][GPU] == "1"
        assert {"key": GPU, "operator": "Exists", "effect": "NoSchedule"} in pods[role]["tolerations"]
    for role in ("coordinator", "operator"):
        resources = pods[role]["containers"][0]["resources"]
        assert GPU not in resources.get("limits", {}) and GPU not in resources.get("requests", {})


def test_cpu_only_pools_ask_for_no_gpu():
    for role, pod in _by_component("cpu-only").items():
        resources = pod["containers"][0]["resources"]
        assert GPU not in resources.get("limits", {}) and GPU not in resources.get("requests", {}), role
        assert "tolerations" not in pod, role


def test_one_gpu_pools_are_placed_by_their_own_node_selectors():
    pods = _by_component("one-gpu-pools")
    assert pods["target"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert pods["draft"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-L4"}
    assert {"key": "pool", "operator": "Equal", "value": "draft", "effect": "NoSchedule"} in pods["draft"]["tolerations"]
    assert pods["target"]["containers"][0]["resources"]["limits"] == {"memory": "32Gi", GPU: "1"}


def test_tensor_parallel_target_gets_its_gpus_and_shared_memory():
    """The README's example: a target sharded over two GPUs of each pod (one process per GPU), beside one-GPU,
    one-process draft pods."""
    pods = _by_component("tp2-big-target-one-gpu-draft")
    target = pods["target"]
    (container,) = target["containers"]
    assert container["resources"]["limits"][GPU] == container["resources"]["requests"][GPU] == "2"
    command = container["command"]
    assert command[:4] == ["specsplit", "target", "--model", "/models/llama-3.3-70b-instruct"]
    assert command[command.index("--tensor-parallel-size") + 1] == "2"
    assert target["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}
    shm = {v["name"]: v for v in target["volumes"]}["dshm"]
    assert shm["emptyDir"]["medium"] == "Memory"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    # Only the sharded pool needs it.
    (draft,) = pods["draft"]["containers"]
    assert draft["resources"]["limits"][GPU] == draft["resources"]["requests"][GPU] == "1"
    assert "--tensor-parallel-size" not in draft["command"]
    assert all(v["name"] != "dshm" for v in pods["draft"]["volumes"])


def test_sharded_draft_and_target_get_their_gpus_and_process_layout():
    pods = _by_component("tp4-target-tp2-draft")
    for role, degree in (("target", "4"), ("draft", "2")):
        (container,) = pods[role]["containers"]
        assert container["resources"]["limits"][GPU] == container["resources"]["requests"][GPU] == degree, role
        command = container["command"]
        assert command[command.index("--tensor-parallel-size") + 1] == degree, role
        assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"], role


def test_canary_pool_runs_the_canary_model_with_the_draft_pools_placement():
    pods = _by_component("canary-on")
    canary, draft = pods["draft-canary"], pods["draft"]
    assert canary["containers"][0]["command"][:4] == ["specsplit", "draft", "--model", "qwen2.5-coder-1.5b-instruct"]
    assert canary["containers"][0]["resources"] == draft["containers"][0]["resources"]
    assert canary["tolerations"] == draft["tolerations"]


def test_model_cache_is_mounted_at_models_from_the_chart_claim_or_a_bounded_emptydir():
    for role in ("target", "draft"):
        default_volumes = {v["name"]: v for v in _by_component("defaults")[role]["volumes"]}
        assert default_volumes["models"]["emptyDir"] == {"sizeLimit": "50Gi"}
        shared_volumes = {v["name"]: v for v in _by_component("shared-model-cache-and-otel")[role]["volumes"]}
        assert shared_volumes["models"]["persistentVolumeClaim"] == {"claimName": "coder-specsplit-models"}
    (claim,) = of_kind(render(VALUE_SETS["shared-model-cache-and-otel"]), "PersistentVolumeClaim")
    assert claim["metadata"]["name"] == "coder-specsplit-models"
    assert claim["spec"]["resources"]["requests"]["storage"] == "200Gi"
    assert claim["spec"]["storageClassName"] == "filestore"


def test_otlp_endpoint_and_pinned_image_reach_every_pod():
    endpoint = VALUE_SETS["shared-model-cache-and-otel"]["otel"]["endpoint"]
    digest = VALUE_SETS["shared-model-cache-and-otel"]["image"]["digest"]
    for role, pod in _by_component("shared-model-cache-and-otel").items():
        (container,) = pod["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == endpoint, role
        assert container["image"] == f"ghcr.io/specsplit/specsplit:0.1.0-cu130@{digest}", role


def test_image_tag_defaults_to_the_chart_app_version():
    images = {pod["containers"][0]["image"] for pod in _by_component("defaults").values()}
    assert images == {"ghcr.io/specsplit/specsplit:0.1.0"}


def _args(container: dict) -> dict[str, str]:
    """A pod command's --flag VALUE pairs."""
    command = container["command"]
    return {flag: value for flag, value in zip(command, command[1:]) if flag.startswith("--")}


def test_tls_tokens_and_pull_secrets_reach_every_pod():
    values = VALUE_SETS["tls-auth-private-registry"]
    pods = _by_component("tls-auth-private-registry")
    assert set(pods) == {"operator", "coordinator", "target", "draft", "draft-canary"}
    for role, pod in pods.items():
        assert pod["imagePullSecrets"] == [{"name": "registry-credentials"}], role
    internal = {"name": "tls", "mountPath": "/etc/specsplit/tls", "readOnly": True}
    for role in ("target", "draft", "draft-canary"):
        (container,) = pods[role]["containers"]
        volumes = {v["name"]: v for v in pods[role]["volumes"]}
        assert volumes["tls"]["secret"]["secretName"] == values["tls"]["secretName"], role
        assert internal in container["volumeMounts"], role
        assert _args(container)["--tls-cert"] == "/etc/specsplit/tls/tls.crt"
        assert _args(container)["--tls-key"] == "/etc/specsplit/tls/tls.key"
        assert _args(container)["--tls-client-ca"] == "/etc/specsplit/tls/ca.crt"  # mutual by default
    coordinator = pods["coordinator"]
    (container,) = coordinator["containers"]
    volumes = {v["name"]: v["secret"]["secretName"] for v in coordinator["volumes"] if "secret" in v}
    assert volumes.pop("worker-auth").endswith("-worker-auth")  # generated by the chart (test_worker_secret_...)
    assert volumes == {"tls": "specsplit-grpc-tls", "public-tls": "specsplit-public-tls",
                       "auth-tokens": "specsplit-api-tokens"}
    assert internal in container["volumeMounts"]
    expected = {
        "--worker-tls-ca": "/etc/specsplit/tls/ca.crt", "--worker-tls-cert": "/etc/specsplit/tls/tls.crt",
        "--worker-tls-key": "/etc/specsplit/tls/tls.key", "--worker-tls-server-name": "specsplit-workers.ml.svc",
        "--tls-cert": "/etc/specsplit/public-tls/tls.crt", "--tls-key": "/etc/specsplit/public-tls/tls.key",
        "--auth-token-file": "/etc/specsplit/auth/tokens"}
    assert {flag: _args(container).get(flag) for flag in expected} == expected
    # Without TLS nothing of it is there (the workers' generated secret is, always).
    for role, pod in _by_component("defaults").items():
        assert not [v for v in pod["volumes"] if "secret" in v and v["name"] != "worker-auth"], role
        assert "imagePullSecrets" not in pod, role
        assert not [arg for arg in pod["containers"][0]["command"]
                    if "tls" in arg or ("auth" in arg and "worker-auth" not in arg)], role


def test_worker_secret_is_generated_and_reaches_the_coordinator_and_every_worker():
    """Workers refuse calls without the shared secret; the chart generates it (random, 48 characters) and the
    operator mounts it in every pod that calls or serves the worker API, and opens metrics to the scrapers."""
    import base64

    rendered = render(VALUE_SETS["defaults"])
    (secret,) = [o for o in of_kind(rendered, "Secret") if o["metadata"]["name"].endswith("-worker-auth")]
    value = base64.b64decode(secret["data"]["secret"])
    assert len(value) == 48 and value.isalnum()
    assert speculative_deployment(rendered)["spec"]["workerAuth"] == {"secretName": secret["metadata"]["name"]}
    for role, pod in _by_component("defaults").items():
        if role == "operator":
            continue
        (container,) = pod["containers"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["worker-auth"]["secret"]["secretName"] == secret["metadata"]["name"], role
        assert _args(container)["--worker-secret-file"] == "/etc/specsplit/worker-auth/secret", role
        assert "--allow-unauthenticated" not in container["command"], role
        assert _args(container)["--metrics-host"] == "0.0.0.0", role


def test_one_way_tls_gives_the_workers_no_client_ca():
    pods = _by_component_of({"tls": {"enabled": True, "secretName": "grpc-tls", "mutual": False}})
    assert "--tls-client-ca" not in pods["target"]["containers"][0]["command"]
    coordinator_args = _args(pods["coordinator"]["containers"][0])
    assert coordinator_args["--worker-tls-ca"] == "/etc/specsplit/tls/ca.crt"
    assert "--worker-tls-cert" not in coordinator_args and "--worker-tls-server-name" not in coordinator_args


def test_each_pool_gets_its_affinity_and_env_and_the_canary_the_drafts():
    values = VALUE_SETS["affinity-and-env"]
    pods = _by_component("affinity-and-env")
    assert pods["target"]["affinity"] == values["target"]["affinity"]
    assert pods["draft"]["affinity"] == pods["draft-canary"]["affinity"] == values["draft"]["affinity"]
    assert "affinity" not in pods["coordinator"]

    def env(role):
        return pods[role]["containers"][0]["env"]

    assert env("target")[-2:] == values["target"]["extraEnv"]
    assert env("draft")[-1] == env("draft-canary")[-1] == {"name": "OTEL_SERVICE_NAME", "value": "coder-proposer"}
    for role in ("draft", "draft-canary"):  # the pool's value replaces the operator's, once
        assert [e for e in env(role) if e["name"] == "OTEL_SERVICE_NAME"] == [env(role)[-1]], role
    assert not [e for e in env("coordinator") if e["name"] in ("NCCL_DEBUG", "HF_TOKEN")]



def test_decode_ahead_reaches_the_target_pool_where_set():
    pods = _by_component_of({"target": {"decodeAhead": "off"}})
    command = pods["target"]["containers"][0]["command"]
    assert command[command.index("--decode-ahead") + 1] == "off"
    assert "--decode-ahead" not in pods["draft"]["containers"][0]["command"]
    assert speculative_deployment(render({"target": {"decodeAhead": "on"}}))["spec"]["target"]["decodeAhead"] == "on"
    assert "decodeAhead" not in speculative_deployment(render({}))["spec"]["target"]  # auto: the CLI's default
    assert all("--decode-ahead" not in p["containers"][0].get("command", [])
               for p in _by_component("defaults").values())


def test_batch_invariance_reaches_every_model_pool_and_only_them():
    values = {"speculativeDeployment": {"batchInvariant": True}, "canary": {"enabled": True, "model": "draft-v2"}}
    assert speculative_deployment(render(values))["spec"]["batchInvariant"] is True
    pods = _by_component_of(values)
    for component in ("target", "draft", "draft-canary"):
        assert "--batch-invariant" in pods[component]["containers"][0]["command"], component
    assert "--batch-invariant" not in pods["coordinator"]["containers"][0].get("command", [])
    assert "batchInvariant" not in speculative_deployment(render({}))["spec"]
    assert all("--batch-invariant" not in p["containers"][0].get("command", [])
               for p in _by_component("defaults").values())


def test_coordinators_spin_only_where_the_chart_requests_the_cores():
    """The coordinator's default request (500m) sets aside no core for spinning while it awaits a round: off. The
    co-located coordinator shares the target's (4 cores): auto."""
    (coordinator,) = _by_component("defaults")["coordinator"]["containers"]
    assert _args(coordinator)["--spin-wait"] == "off"
    (target,) = _by_component("colocated")["target"]["containers"]
    assert "--spin-wait" not in target["command"]
