"""Value sets the chart is rendered with: the defaults and the shapes users deploy on GPU clusters."""

GPU = "nvidia.com/gpu"
GPU_TOLERATION = {"key": GPU, "operator": "Exists", "effect": "NoSchedule"}


def _pool(cpu: str, memory: str, gpus: int | None) -> dict:
    """A role's resources the way users write them: nvidia.com/gpu in limits (and equal requests).
    Helm merges maps with the defaults (one GPU), so no GPU is said with 0 or with null (Helm drops the key)."""
    requests = {"cpu": cpu, "memory": memory, GPU: gpus}
    limits = {"memory": memory, GPU: gpus}
    return {"requests": requests, "limits": limits}


VALUE_SETS: dict[str, dict] = {
    "defaults": {},
    # A cluster without GPUs: no GPU resources, no GPU taints to tolerate.
    "cpu-only": {
        "target": {"resources": _pool("4", "12Gi", 0), "tolerations": []},
        "draft": {"resources": _pool("2", "6Gi", None), "tolerations": []},
    },
    # One GPU per pod, each pool pinned to its own GPU type.
    "one-gpu-pools": {
        "target": {"resources": _pool("8", "32Gi", 1), "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
                   "replicas": {"min": 2, "max": 8}},
        "draft": {"resources": _pool("4", "16Gi", 1), "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-L4"},
                  "tolerations": [GPU_TOLERATION, {"key": "pool", "operator": "Equal", "value": "draft",
                                                   "effect": "NoSchedule"}]},
    },
    # The target over four GPUs of one pod, the draft over two: one process per GPU in each pod.
    "tp4-target-tp2-draft": {
        "target": {"model": "/models/llama-3-70b-instruct", "tensorParallelSize": 4, "resources": _pool("32", "256Gi", 4)},
        "draft": {"model": "/models/llama-3-8b-instruct", "tensorParallelSize": 2, "resources": _pool("8", "64Gi", 2)},
    },
    # A target too big for one GPU (a 70B in bf16 over two 141 GB GPUs) beside a small draft on one GPU per pod: the
    # README's example.
    "tp2-big-target-one-gpu-draft": {
        "target": {"model": "/models/llama-3.3-70b-instruct", "tensorParallelSize": 2,
                   "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H200"}, "resources": _pool("8", "96Gi", 2)},
        "draft": {"model": "/models/llama-3.2-1b-instruct", "resources": _pool("4", "16Gi", 1)},
    },
    "canary-on": {
        "canary": {"enabled": True, "model": "qwen2.5-coder-1.5b-instruct", "weight": 5,
                   "promotion": {"metric": "acceptanceRate", "maxWeight": 40}},
    },
    "monitoring-on": {
        "monitoring": {"podMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
                       "serviceMonitor": {"enabled": True, "interval": "15s"}},
    },
    "network-policy-off": {"networkPolicy": {"enabled": False}},
    # The operator confined to two namespaces: Roles there instead of a ClusterRole.
    "watch-namespaces": {"operator": {"watchNamespaces": ["ml", "ml-staging"]}},
    "shared-model-cache-and-otel": {
        "modelCache": {"persistent": True, "size": "200Gi", "storageClass": "filestore"},
        "otel": {"endpoint": "http://otel-collector.observability:4317"},
        "image": {"tag": "0.1.0-cu130", "digest": "sha256:" + "ab" * 32},
    },
    "no-speculative-deployment": {"speculativeDeployment": {"enabled": False}},
    # Mutual TLS inside, TLS and bearer tokens on the public port, a private registry; Secrets made beforehand.
    "tls-auth-private-registry": {
        "tls": {"enabled": True, "secretName": "specsplit-grpc-tls", "serverName": "specsplit-workers.ml.svc"},
        "coordinator": {"tls": {"enabled": True, "secretName": "specsplit-public-tls"},
                        "auth": {"enabled": True, "tokenSecretName": "specsplit-api-tokens"}},
        "imagePullSecrets": [{"name": "registry-credentials"}],
        "canary": {"enabled": True, "model": "qwen2.5-coder-1.5b-instruct"},
    },
    # The coordinator inside every target pod, with a canary draft and both monitors (its own metrics port).
    "colocated": {
        "coordinator": {"colocated": True},
        "canary": {"enabled": True, "model": "qwen2.5-coder-1.5b-instruct"},
        "monitoring": {"podMonitor": {"enabled": True}, "serviceMonitor": {"enabled": True}},
    },
    # Co-located with mutual TLS inside, TLS and tokens on the public API, its clients narrowed to one namespace.
    "colocated-tls-auth": {
        "coordinator": {"colocated": True, "tls": {"enabled": True, "secretName": "specsplit-public-tls"},
                        "auth": {"enabled": True, "tokenSecretName": "specsplit-api-tokens"}},
        "tls": {"enabled": True, "secretName": "specsplit-grpc-tls", "serverName": "specsplit-workers.ml.svc"},
        "networkPolicy": {"clients": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "apps"}}}]},
    },
    # Pools spread over zones / pinned by node affinity, with their own environment; the canary follows draft.
    "affinity-and-env": {
        "target": {"affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                       {"weight": 100, "podAffinityTerm": {
                           "topologyKey": "topology.kubernetes.io/zone",
                           "labelSelector": {"matchLabels": {"app.kubernetes.io/component": "target"}}}}]}},
                   "extraEnv": [{"name": "NCCL_DEBUG", "value": "INFO"},
                                {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}]},
        "draft": {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                      "nodeSelectorTerms": [{"matchExpressions": [
                          {"key": "nvidia.com/gpu.product", "operator": "In", "values": ["NVIDIA-L4"]}]}]}}},
                  "extraEnv": [{"name": "OTEL_SERVICE_NAME", "value": "coder-proposer"}]},
        "canary": {"enabled": True, "model": "qwen2.5-coder-1.5b-instruct"},
    },
}
