"""The co-located mode's objects, without any API: the coordinator inside every target pod (`specsplit target
--coordinate`, as the real CLI parses it), with its Secrets, variants file, ports and probes, and the public Service
leading there; no coordinator Deployment."""

from __future__ import annotations

from typing import Any

import kubernetes_validate

from specsplit.operator import naming
from specsplit.operator.manifests import RolloutPlan, build_objects
from specsplit.operator.spec import parse_spec

OWNER = {"apiVersion": naming.API_VERSION, "kind": naming.KIND,
         "metadata": {"name": "coder", "namespace": "ml", "uid": "0b1c-uid"}}
PLAN = RolloutPlan(target_replicas=3, draft_replicas=2, draft_model="small", canary_model="small-v2",
                   canary_weight=10)
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")


def built(**coordinator_and_overrides: Any) -> dict[tuple[str, str], dict[str, Any]]:
    overrides = dict(coordinator_and_overrides)
    coordinator = {"colocated": True, **overrides.pop("coordinator", {})}
    spec = parse_spec({"image": "registry.example/specsplit:0.1.0", "numSpeculativeTokens": 6,
                       "target": {"model": "big", "tensorParallelSize": 2}, "draft": {"model": "small"},
                       "canary": {"model": "small-v2"}, "coordinator": coordinator, **overrides})
    objects = build_objects(OWNER, spec, PLAN)
    for obj in objects:
        kubernetes_validate.validate(obj, "1.30.0", strict=True)
    return {(obj["kind"], obj["metadata"]["name"]): obj for obj in objects}


def target(objects: dict[tuple[str, str], dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(pod spec, container) of the target Deployment."""
    pod = objects[("Deployment", "coder-target")]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    return pod, container


def parsed(container: dict[str, Any]) -> Any:
    from specsplit.cli import build_parser

    assert container["command"][:2] == ["specsplit", "target"]
    return build_parser().parse_args(container["command"][1:])  # argparse exits on an unknown flag


def test_no_coordinator_deployment_and_the_target_pods_run_it() -> None:
    objects = built(workerAuth={"secretName": "worker-auth"})
    assert set(objects) == {
        ("ConfigMap", "coder-coordinator"), ("Service", "coder"), ("Service", "coder-target"),
        ("Service", "coder-draft"), ("Service", "coder-draft-canary"), ("Deployment", "coder-target"),
        ("Deployment", "coder-draft"), ("Deployment", "coder-draft-canary")}
    assert objects[("Deployment", "coder-target")]["spec"]["replicas"] == 3  # the public API's replicas too
    pod, container = target(objects)
    args = parsed(container)
    assert args.coordinate and args.model == "big" and args.tensor_parallel_size == 2
    # No round channel (-1): its one coordinator calls it in-process, so a listener would only be exposure.
    assert (args.port, args.round_port, args.metrics_port, args.metrics_host) == (50051, -1, 9090, "0.0.0.0")
    assert (args.coordinator_port, args.coordinator_metrics_port, args.http_port) == (50050, 9091, 8000)
    assert args.num_speculative_tokens == 6
    assert args.draft_variants_file == "/etc/specsplit/config/draft-variants.json" and not args.draft
    assert args.target == ""  # no peer targets: operator/manifests.py says why
    assert args.worker_secret_file == "/etc/specsplit/worker-auth/secret" and not args.allow_unauthenticated
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    assert volumes["config"] == {"name": "config", "configMap": {"name": "coder-coordinator"}}
    assert volumes["worker-auth"]["secret"]["secretName"] == "worker-auth"
    assert "dshm" in volumes  # still a sharded target
    mounts = {mount["mountPath"]: mount["name"] for mount in container["volumeMounts"]}
    assert mounts["/etc/specsplit/config"] == "config" and mounts["/etc/specsplit/worker-auth"] == "worker-auth"
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {
        "grpc": 50051, "metrics": 9090, "coord-grpc": 50050, "http": 8000, "coord-metrics": 9091}
    for probe in PROBES:  # ready once the coordinator serves, not merely the target
        assert container[probe]["grpc"] == {"port": 50050}, probe
    # The model's load (600 s, as a separate target's), then up to 300 s waiting for the drafts, before it serves.
    assert container["startupProbe"]["periodSeconds"] * container["startupProbe"]["failureThreshold"] == 900
    env = {variable["name"]: variable.get("value") for variable in container["env"]}
    assert env["OTEL_SERVICE_NAME"] == "specsplit-target"
    # The drafts run no coordinator; they take rounds on their channel.
    for name in ("coder-draft", "coder-draft-canary"):
        (draft,) = objects[("Deployment", name)]["spec"]["template"]["spec"]["containers"]
        assert "--coordinate" not in draft["command"] and "config" not in {m["name"] for m in draft["volumeMounts"]}
        assert {"name": "round", "containerPort": 50061, "protocol": "TCP"} in draft["ports"]


def test_the_public_service_leads_to_the_coordinator_ports_of_the_target_pods() -> None:
    objects = built(coordinator={"port": 8443})
    service = objects[("Service", "coder")]
    assert service["metadata"]["labels"][naming.LABEL_COMPONENT] == "coordinator"  # still the public entry point
    assert service["spec"]["selector"] == naming.selector("coder", "target")
    assert {p["name"]: (p["port"], p["targetPort"]) for p in service["spec"]["ports"]} == {
        "grpc": (8443, "coord-grpc"), "http": (8000, "http"), "metrics": (9090, "coord-metrics")}
    _, container = target(objects)
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= {p["name"] for p in container["ports"]}
    headless = objects[("Service", "coder-target")]["spec"]
    assert {p["name"]: p["targetPort"] for p in headless["ports"]} == {"grpc": "grpc", "metrics": "metrics"}


def test_the_process_serves_the_public_tls_and_calls_the_drafts_over_the_internal_one() -> None:
    """One certificate for every port of the process, whose clients are public: the public TLS and never a client CA;
    the internal (mutual) TLS is the coordinator's to the drafts."""
    objects = built(coordinator={"tls": {"secretName": "public-tls"}, "auth": {"tokenSecretName": "api-tokens"}},
                    tls={"secretName": "grpc-tls", "serverName": "workers.coder.internal"},
                    workerAuth={"secretName": "worker-auth"})
    pod, container = target(objects)
    args = parsed(container)
    assert (args.tls_cert, args.tls_key, args.tls_client_ca) == (
        "/etc/specsplit/public-tls/tls.crt", "/etc/specsplit/public-tls/tls.key", None)
    assert args.auth_token_file == "/etc/specsplit/auth/tokens"
    assert (args.worker_tls_ca, args.worker_tls_cert, args.worker_tls_key, args.worker_tls_server_name) == (
        "/etc/specsplit/tls/ca.crt", "/etc/specsplit/tls/tls.crt", "/etc/specsplit/tls/tls.key",
        "workers.coder.internal")
    secrets = {volume["name"]: volume["secret"]["secretName"] for volume in pod["volumes"] if "secret" in volume}
    assert secrets == {"tls": "grpc-tls", "worker-auth": "worker-auth", "public-tls": "public-tls",
                       "auth-tokens": "api-tokens"}
    for probe in PROBES:  # the public port serves TLS: a TCP connect
        assert container[probe]["tcpSocket"] == {"port": 50050} and "grpc" not in container[probe], probe
    (draft,) = objects[("Deployment", "coder-draft")]["spec"]["template"]["spec"]["containers"]
    assert draft["command"][draft["command"].index("--tls-client-ca") + 1] == "/etc/specsplit/tls/ca.crt"


def test_without_a_workers_secret_the_target_worker_ports_stay_on_loopback() -> None:
    """No secret and mutual TLS (which a co-located target cannot require): the target's worker ports are not
    opened to the network (no --allow-unauthenticated); the coordinator still reaches the drafts by certificate."""
    _, container = target(built(tls={"secretName": "grpc-tls"}, coordinator={"httpPort": 0}))
    args = parsed(container)
    assert not args.allow_unauthenticated and args.worker_secret_file is None and args.tls_client_ca is None
    assert args.worker_tls_cert == "/etc/specsplit/tls/tls.crt"
    assert args.http_port == -1 and "http" not in {p["name"] for p in container["ports"]}
    for probe in PROBES:  # no public TLS: a gRPC health check
        assert container[probe]["grpc"] == {"port": 50050}, probe
