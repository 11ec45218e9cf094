"""Pure builders: (owner, validated spec, rollout plan) -> the Kubernetes objects of one SpeculativeDeployment.

No API calls here: the same inputs always give the same dicts, so the handlers can compare them with what
is in the cluster and the tests can check them without one. Pod commands follow the services' CLI contract.

Two modes (spec.coordinator.colocated): a coordinator Deployment of its own, or the coordinator inside every target
pod (`specsplit target --coordinate`), where the public Service selects the target pods on the coordinator's ports.
A co-located coordinator gets no other target replicas to fail over to: it shares its target's process (when that
dies, so do its requests, and clients retry through the Service), and a peer list read once from the headless
Service at start would hold the pod's own address beside the in-process target, miss pods started later, and for
the first pod name no ready pod at all (its readiness waits on the coordinator, whose start would wait on it).
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Mapping
from typing import Any

import kopf

from specsplit.operator import grpc_security, naming
from specsplit.operator.draft_source import draft_flags, is_ngram
from specsplit.operator.spec import DeploymentSpec, InternalTLS, Resources, RoleSpec

WORKERS_WARM_UP_K = 4  # `specsplit target|draft --warm-up-k`'s default

GPU_RESOURCE = "nvidia.com/gpu"
# A coordinator spins (`--spin-wait auto`) only where its pod requests a core for the spinning loop and one for the
# rest of its work: auto alone counts the node's CPUs, which a pod's request does not narrow.
SPIN_WAIT_MIN_CORES = 2
RUN_AS_USER = 10001  # the image's own user (the Dockerfile's USER), which owns /models in it
# Startup probes every 10 s: 600 s for a model to load; co-located, 300 s more, as long as the coordinator waits for
# the draft pools before it opens its probed port (coordinator/process.py, connect_timeout).
STARTUP_FAILURES = 60
COLOCATED_STARTUP_FAILURES = STARTUP_FAILURES + 30


@dataclasses.dataclass(frozen=True)
class RolloutPlan:
    """What the objects must express now: the operator's own decisions layered over the spec."""
    target_replicas: int
    draft_replicas: int
    draft_model: str  # the spec's model, or a canary model promoted over it
    canary_model: str | None = None  # a canary Deployment exists only while this is set
    canary_weight: int = 0  # percent of requests routed to the canary draft


def build_objects(owner: Mapping[str, Any], spec: DeploymentSpec, plan: RolloutPlan) -> list[dict[str, Any]]:
    """Every object the resource needs, owned by it, in the order they should be created."""
    instance = owner["metadata"]["name"]
    objects = [
        variants_config_map(instance, spec, plan),
        coordinator_service(instance, spec),
        worker_service(instance, naming.TARGET),
        worker_service(instance, naming.DRAFT),
        *([] if spec.coordinator.colocated else [coordinator_deployment(instance, spec)]),
        worker_deployment(instance, spec, naming.TARGET, spec.target, spec.target.model, plan.target_replicas),
        worker_deployment(instance, spec, naming.DRAFT, spec.draft, plan.draft_model, plan.draft_replicas),
    ]
    if plan.canary_model is not None and spec.canary is not None:
        objects += [
            worker_service(instance, naming.DRAFT_CANARY),
            worker_deployment(instance, spec, naming.DRAFT_CANARY, spec.draft, plan.canary_model,
                              spec.canary.replicas),
        ]
    kopf.adopt(objects, owner=dict(owner))
    return objects


def draft_variants(instance: str, plan: RolloutPlan) -> dict[str, Any]:
    """The coordinator's draft-variants file: the stable draft pool and, during a rollout, the canary pool."""
    stable = {"name": naming.STABLE_VARIANT, "weight": 100 - plan.canary_weight,
              "addresses": [f"{naming.component_name(instance, naming.DRAFT)}:{naming.GRPC_PORT}"]}
    variants = [stable]
    if plan.canary_model is not None and plan.canary_weight > 0:
        variants.append({"name": naming.CANARY_VARIANT, "weight": plan.canary_weight,
                         "addresses": [f"{naming.component_name(instance, naming.DRAFT_CANARY)}:{naming.GRPC_PORT}"]})
    return {"variants": variants}


def variants_config_map(instance: str, spec: DeploymentSpec, plan: RolloutPlan) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": naming.config_map_name(instance), "labels": naming.labels(instance, naming.COORDINATOR)},
        "data": {naming.VARIANTS_KEY: json.dumps(draft_variants(instance, plan), indent=2) + "\n"},
    }


def coordinator_service(instance: str, spec: DeploymentSpec) -> dict[str, Any]:
    """The public entry point: clients speak gRPC to `NAME:port`; co-located, it leads to the target pods."""
    colocated = spec.coordinator.colocated
    grpc_port = naming.COLOCATED_GRPC_PORT_NAME if colocated else "grpc"
    metrics_port = naming.COLOCATED_METRICS_PORT_NAME if colocated else "metrics"
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": naming.coordinator_service_name(instance),
                     "labels": naming.labels(instance, naming.COORDINATOR)},
        "spec": {
            "type": "ClusterIP",
            "selector": naming.selector(instance, naming.TARGET if colocated else naming.COORDINATOR),
            "ports": [
                {"name": "grpc", "port": spec.coordinator.port, "targetPort": grpc_port, "protocol": "TCP",
                 "appProtocol": "grpc"},
                *([{"name": "http", "port": spec.coordinator.http_port, "targetPort": "http", "protocol": "TCP",
                    "appProtocol": "http"}] if spec.coordinator.http_port else []),
                {"name": "metrics", "port": naming.METRICS_PORT, "targetPort": metrics_port, "protocol": "TCP"},
            ],
        },
    }


def worker_service(instance: str, component: str) -> dict[str, Any]:
    """Headless, so `NAME-component` resolves to every ready pod and the coordinator sees each replica."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": naming.component_name(instance, component),
                     "labels": naming.labels(instance, component)},
        "spec": {
            "clusterIP": "None",
            "selector": naming.selector(instance, component),
            "ports": [
                {"name": "grpc", "port": naming.GRPC_PORT, "targetPort": "grpc", "protocol": "TCP",
                 "appProtocol": "grpc"},
                {"name": "metrics", "port": naming.METRICS_PORT, "targetPort": "metrics", "protocol": "TCP"},
            ],
        },
    }


def coordinator_command(instance: str, spec: DeploymentSpec) -> list[str]:
    return [
        "specsplit", "coordinator",
        "--target", f"{naming.component_name(instance, naming.TARGET)}:{naming.GRPC_PORT}",
        "--draft-variants-file", f"{naming.CONFIG_DIR}/{naming.VARIANTS_KEY}",
        "--port", str(naming.GRPC_PORT),
        "--metrics-port", str(naming.METRICS_PORT),
        "--metrics-host", "0.0.0.0",  # scraped from other pods; the NetworkPolicy admits only the scrapers
        *_coordinating_flags(spec, spec.coordinator.resources),
        *grpc_security.coordinator_args(spec.coordinator, spec.tls, spec.worker_auth_secret_name),
    ]


def _coordinating_flags(spec: DeploymentSpec, resources: Resources, busy_cores: int = 0) -> list[str]:
    """What a coordinator is told wherever it runs (its own pod, or a target's, of those `resources`, where
    `busy_cores` other cores poll: the tensor-parallel ranks past the first)."""
    spin = [] if _requested_cores(resources) >= SPIN_WAIT_MIN_CORES + busy_cores else ["--spin-wait", "off"]
    coordinator = spec.coordinator
    window = coordinator.arrival_window_ms
    return ["--http-port", str(naming.HTTP_PORT if coordinator.http_port else -1),
            "--num-speculative-tokens", str(spec.num_speculative_tokens), *spin,
            *(["--arrival-window-ms", f"{window:g}"] if window else []),
            *(["--max-num-seqs", str(coordinator.max_num_seqs)] if coordinator.max_num_seqs is not None else []),
            *(["--max-waiting", str(coordinator.max_waiting)] if coordinator.max_waiting is not None else [])]


def _requested_cores(resources: Resources) -> float:
    """The CPU the scheduler sets aside for the pod (its request; the limit where only that is given, as Kubernetes
    defaults it); 0 where none is set, or the quantity is not a plain or milli-core one."""
    quantity = resources.requests.get("cpu", resources.limits.get("cpu", "0"))
    try:
        return float(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)
    except ValueError:
        return 0.0


def worker_command(role: str, model: str, tensor_parallel_size: int, tls: InternalTLS | None = None,
                   worker_auth: str | None = None, batch_invariant: bool = False,
                   max_k: int = WORKERS_WARM_UP_K, decode_ahead: str = "auto") -> list[str]:
    """`model`: for a draft, what its pool runs (draft_source.py): a model, or the n-gram proposer's flags;
    `max_k`: the deployment's bound on proposals per round; `decode_ahead`: a target's --decode-ahead."""
    security = grpc_security.worker_args(tls, worker_auth)
    return _worker_flags(role, model, tensor_parallel_size, batch_invariant, max_k=max_k,
                         decode_ahead=decode_ahead) + security


def colocated_target_command(spec: DeploymentSpec, model: str, tensor_parallel_size: int) -> list[str]:
    """`specsplit target --coordinate`: the target's flags, then its coordinator's, security included.
    No round channel: its one coordinator calls it in-process, and a listener nothing calls is only exposure.
    The process serves one certificate on all its ports, and their clients are the public API's: so the public TLS,
    never a client CA (public clients have no certificate of the internal CA); internal TLS secures the calls to the
    draft pools. The target's own worker ports have no caller outside the pod: its `--worker-secret-file` (one flag
    for both sides) makes them require the workers' secret; without one they listen on loopback only (no
    --allow-unauthenticated)."""
    return [
        *_worker_flags(naming.TARGET, model, tensor_parallel_size, spec.batch_invariant, round_port=-1,
                       max_k=spec.num_speculative_tokens, decode_ahead=spec.target.decode_ahead),
        "--coordinate",
        "--coordinator-port", str(naming.COLOCATED_GRPC_PORT),
        "--coordinator-metrics-port", str(naming.COLOCATED_METRICS_PORT),
        "--draft-variants-file", f"{naming.CONFIG_DIR}/{naming.VARIANTS_KEY}",
        *_coordinating_flags(spec, spec.target.resources, busy_cores=tensor_parallel_size - 1),
        *grpc_security.coordinator_args(spec.coordinator, spec.tls, spec.worker_auth_secret_name),
    ]


def _worker_flags(role: str, model: str, tensor_parallel_size: int, batch_invariant: bool,
                  round_port: int = naming.ROUND_PORT, max_k: int = WORKERS_WARM_UP_K,
                  decode_ahead: str = "auto") -> list[str]:
    """`round_port` -1: none (the CLI's "rounds over gRPC"). `decode_ahead`: a target's, passed where not auto."""
    source = draft_flags(model) if role == naming.DRAFT else ["--model", model]
    command = ["specsplit", role, *source, "--port", str(naming.GRPC_PORT), "--round-port", str(round_port),
               "--metrics-port", str(naming.METRICS_PORT), "--metrics-host", "0.0.0.0"]
    if tensor_parallel_size > 1:  # one process per GPU of the pod; this one serves as rank 0
        command += ["--tensor-parallel-size", str(tensor_parallel_size)]
    if batch_invariant and not is_ngram(model):  # the n-gram proposer runs no kernels
        command.append("--batch-invariant")
    if role == naming.TARGET and decode_ahead != "auto":
        command += ["--decode-ahead", decode_ahead]
    if max_k > WORKERS_WARM_UP_K and not is_ngram(model):
        # On a GPU a worker captures the rounds' graphs up to this k before serving: a policy climbing past the
        # workers' default would otherwise make a round wait for a capture.
        command += ["--warm-up-k", str(max_k)]
    return command


def _variants_file_volume(instance: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    return ([{"name": "config", "configMap": {"name": naming.config_map_name(instance)}}],
            [{"name": "config", "mountPath": naming.CONFIG_DIR, "readOnly": True}])


def coordinator_deployment(instance: str, spec: DeploymentSpec) -> dict[str, Any]:
    volumes, mounts = _variants_file_volume(instance)
    secret_volumes, secret_mounts = grpc_security.coordinator_volumes(spec.coordinator, spec.tls, spec.worker_auth_secret_name)
    return _deployment(instance, spec, naming.COORDINATOR, replicas=spec.coordinator.replicas,
                       command=coordinator_command(instance, spec), resources=spec.coordinator.resources,
                       extra_volumes=volumes + secret_volumes, extra_mounts=mounts + secret_mounts,
                       health_check=_coordinator_probe(spec, naming.GRPC_PORT), extra_ports=_http_port(spec))


def _coordinator_probe(spec: DeploymentSpec, port: int) -> dict[str, Any]:
    """A pod running a coordinator is probed on its public port, which serves the public TLS where set."""
    return grpc_security.health_check(tls_served=spec.coordinator.tls_secret_name is not None, port=port)


def _http_port(spec: DeploymentSpec) -> list[dict[str, Any]]:
    """The coordinator's OpenAI-compatible API, where it has one."""
    return [{"name": "http", "containerPort": naming.HTTP_PORT, "protocol": "TCP"}] if spec.coordinator.http_port else []


def worker_deployment(instance: str, spec: DeploymentSpec, component: str, role: RoleSpec, model: str,
                      replicas: int) -> dict[str, Any]:
    """A target, draft or draft-canary pool; the canary runs the draft command with another model. Co-located, the
    target's pods also run the coordinator: its variants file and Secrets, its ports, probed on its public port (the
    pod takes clients only once the coordinator serves)."""
    command_role = naming.TARGET if component == naming.TARGET else naming.DRAFT
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    if role.tensor_parallel_size > 1:
        # NCCL between the shards of one pod needs more shared memory than the container default (64 MiB).
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    if component == naming.TARGET and spec.coordinator.colocated:
        command = colocated_target_command(spec, model, role.tensor_parallel_size)
        config_volumes, config_mounts = _variants_file_volume(instance)
        volumes, mounts = volumes + config_volumes, mounts + config_mounts
        secret_volumes, secret_mounts = grpc_security.coordinator_volumes(spec.coordinator, spec.tls,
                                                                          spec.worker_auth_secret_name)
        ports = _colocated_coordinator_ports(spec)  # no round channel: see colocated_target_command
        probe = _coordinator_probe(spec, naming.COLOCATED_GRPC_PORT)
        startup_failures = COLOCATED_STARTUP_FAILURES
    else:
        command = worker_command(command_role, model, role.tensor_parallel_size, spec.tls,
                                 spec.worker_auth_secret_name, spec.batch_invariant, spec.num_speculative_tokens,
                                 decode_ahead=role.decode_ahead)
        ports = [{"name": "round", "containerPort": naming.ROUND_PORT, "protocol": "TCP"}]
        secret_volumes, secret_mounts = grpc_security.worker_volumes(spec.tls, spec.worker_auth_secret_name)
        probe = grpc_security.health_check(tls_served=spec.tls is not None)
        startup_failures = STARTUP_FAILURES
    resources = role.resources
    if command_role == naming.DRAFT and is_ngram(model):  # no model: no GPU, whatever the model draft pool takes
        resources = dataclasses.replace(resources, gpus=0)
    return _deployment(instance, spec, component, replicas=replicas, command=command,
                       resources=resources, extra_volumes=volumes + secret_volumes,
                       extra_mounts=mounts + secret_mounts, health_check=probe,
                       node_selector=role.node_selector, tolerations=role.tolerations, affinity=role.affinity,
                       extra_env=role.env, extra_ports=ports, startup_failures=startup_failures)


def _colocated_coordinator_ports(spec: DeploymentSpec) -> list[dict[str, Any]]:
    return [{"name": naming.COLOCATED_GRPC_PORT_NAME, "containerPort": naming.COLOCATED_GRPC_PORT, "protocol": "TCP"},
            *_http_port(spec),
            {"name": naming.COLOCATED_METRICS_PORT_NAME, "containerPort": naming.COLOCATED_METRICS_PORT,
             "protocol": "TCP"}]


def _resource_requirements(resources: Resources) -> dict[str, Any]:
    requests, limits = dict(resources.requests), dict(resources.limits)
    if resources.gpus:
        # Extended resources must be requested and limited alike.
        requests[GPU_RESOURCE] = limits[GPU_RESOURCE] = str(resources.gpus)
    return {key: value for key, value in (("requests", requests), ("limits", limits)) if value}


def _model_cache_volume(spec: DeploymentSpec) -> dict[str, Any]:
    if spec.model_cache_claim:
        return {"name": "models", "persistentVolumeClaim": {"claimName": spec.model_cache_claim}}
    empty_dir = {"sizeLimit": spec.model_cache_size_limit} if spec.model_cache_size_limit else {}
    return {"name": "models", "emptyDir": empty_dir}


def _environment(component: str, spec: DeploymentSpec, extra_env: tuple[Mapping[str, Any], ...]
                 ) -> list[dict[str, Any]]:
    """The operator's variables, then the spec's; a spec variable of the same name replaces the operator's
    (one entry per name: the API server's apply would refuse duplicates)."""
    env = [
        {"name": "SPECSPLIT_CACHE", "value": naming.MODEL_CACHE_DIR},
        {"name": "HOME", "value": "/tmp"},  # libraries that cache under ~ must find a writable home
        {"name": "OTEL_SERVICE_NAME", "value": f"specsplit-{component}"},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "OTEL_RESOURCE_ATTRIBUTES", "value": "k8s.pod.name=$(POD_NAME)"},
    ]
    if spec.otlp_endpoint:
        env.append({"name": "OTEL_EXPORTER_OTLP_ENDPOINT", "value": spec.otlp_endpoint})
    replaced = {variable["name"] for variable in extra_env}
    kept = [variable for variable in env if variable["name"] not in replaced]
    return kept + [copy.deepcopy(dict(variable)) for variable in extra_env]


def _deployment(instance: str, spec: DeploymentSpec, component: str, *, replicas: int, command: list[str],
                resources: Resources, extra_volumes: list[dict[str, Any]], extra_mounts: list[dict[str, Any]],
                health_check: dict[str, Any], node_selector: Mapping[str, str] | None = None,
                tolerations: tuple[Mapping[str, Any], ...] = (), affinity: Mapping[str, Any] | None = None,
                extra_env: tuple[Mapping[str, Any], ...] = (),
                extra_ports: list[dict[str, Any]] | None = None,
                startup_failures: int = STARTUP_FAILURES) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": component,
        "image": spec.image,
        "command": command,
        "ports": [
            {"name": "grpc", "containerPort": naming.GRPC_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": naming.METRICS_PORT, "protocol": "TCP"},
            *(extra_ports or []),
        ],
        "env": _environment(component, spec, extra_env),
        "resources": _resource_requirements(resources),
        # Loading a model can take minutes; the startup probe holds liveness off until the server is up.
        "startupProbe": {**health_check, "periodSeconds": 10, "failureThreshold": startup_failures},
        "readinessProbe": {**health_check, "periodSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {**health_check, "periodSeconds": 10, "failureThreshold": 6},
        "securityContext": {
            "runAsNonRoot": True,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "volumeMounts": [
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "models", "mountPath": naming.MODEL_CACHE_DIR},
            *extra_mounts,
        ],
    }
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy
    pod_spec: dict[str, Any] = {
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS_USER,
            "runAsGroup": RUN_AS_USER,
            "fsGroup": RUN_AS_USER,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "automountServiceAccountToken": False,  # the services never call the Kubernetes API
        "containers": [container],
        "volumes": [{"name": "tmp", "emptyDir": {}}, _model_cache_volume(spec), *extra_volumes],
    }
    if node_selector:
        pod_spec["nodeSelector"] = dict(node_selector)
    if tolerations:
        pod_spec["tolerations"] = [dict(toleration) for toleration in tolerations]
    if affinity:
        pod_spec["affinity"] = copy.deepcopy(dict(affinity))
    if spec.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": name} for name in spec.image_pull_secrets]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": naming.component_name(instance, component), "labels": naming.labels(instance, component)},
        "spec": {
            "replicas": replicas,
            "revisionHistoryLimit": 3,
            "selector": {"matchLabels": naming.selector(instance, component)},
            "template": {
                "metadata": {"labels": naming.labels(instance, component)},
                "spec": pod_spec,
            },
        },
    }
