"""TLS and bearer tokens from the spec to the pods: the Secrets each pod mounts, the flags its command gets (as
the real `specsplit` CLI parses them), probes that can pass a TLS port, and a running resource switched over."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest

from specsplit.operator.manifests import RolloutPlan, build_objects
from specsplit.operator.spec import parse_spec

from kube_harness import Cluster, RunningOperator, base_spec, eventually

OWNER = {"apiVersion": "specsplit.dev/v1alpha1", "kind": "SpeculativeDeployment",
         "metadata": {"name": "coder", "namespace": "ml", "uid": "0b1c-uid"}}
WORKERS = ("target", "draft", "draft-canary")
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
INTERNAL = {"name": "tls", "secret": {"secretName": "grpc-tls", "defaultMode": 0o440, "items": [
    {"key": "tls.crt", "path": "tls.crt"}, {"key": "tls.key", "path": "tls.key"}, {"key": "ca.crt", "path": "ca.crt"}]}}
INTERNAL_MOUNT = {"name": "tls", "mountPath": "/etc/specsplit/tls", "readOnly": True}


def pods(**overrides: Any) -> dict[str, dict[str, Any]]:
    """Pod specs by component, a canary included; each Deployment checked against the Kubernetes 1.30 schemas."""
    spec = parse_spec({"image": "registry.example/specsplit:0.1.0", "target": {"model": "big"},
                       "draft": {"model": "small"}, "canary": {"model": "small-v2"}, **overrides})
    plan = RolloutPlan(target_replicas=1, draft_replicas=1, draft_model="small", canary_model="small-v2",
                       canary_weight=10)
    deployments = [obj for obj in build_objects(OWNER, spec, plan) if obj["kind"] == "Deployment"]
    for deployment in deployments:
        kubernetes_validate.validate(deployment, "1.30.0", strict=True)
    return {obj["metadata"]["labels"]["app.kubernetes.io/component"]: obj["spec"]["template"]["spec"]
            for obj in deployments}


def main(pod: dict[str, Any]) -> dict[str, Any]:
    (container,) = pod["containers"]
    return container


def parsed(pod: dict[str, Any]) -> Any:
    """The pod's command as the services' own CLI reads it (argparse exits on an unknown flag)."""
    from specsplit.cli import build_parser

    command = main(pod)["command"]
    assert command[0] == "specsplit"
    return build_parser().parse_args(command[1:])


def probe_handlers(pod: dict[str, Any]) -> set[str]:
    return {next(key for key in main(pod)[probe] if key in ("grpc", "tcpSocket", "httpGet", "exec"))
            for probe in PROBES}


def test_mutual_tls_between_the_coordinator_and_every_worker() -> None:
    built = pods(tls={"secretName": "grpc-tls", "serverName": "workers.coder.internal"})
    for component in WORKERS:
        args = parsed(built[component])
        assert (args.tls_cert, args.tls_key, args.tls_client_ca) == (
            "/etc/specsplit/tls/tls.crt", "/etc/specsplit/tls/tls.key", "/etc/specsplit/tls/ca.crt"), component
    coordinator = parsed(built["coordinator"])
    assert (coordinator.worker_tls_ca, coordinator.worker_tls_cert, coordinator.worker_tls_key) == (
        "/etc/specsplit/tls/ca.crt", "/etc/specsplit/tls/tls.crt", "/etc/specsplit/tls/tls.key")
    assert coordinator.worker_tls_server_name == "workers.coder.internal"
    # The internal Secret is for the workers' side only: the public port stays plaintext, without tokens.
    assert coordinator.tls_cert is None and coordinator.auth_token_file is None
    for component, pod in built.items():
        assert INTERNAL in pod["volumes"], component
        assert INTERNAL_MOUNT in main(pod)["volumeMounts"], component


def test_one_way_tls_leaves_client_certificates_out() -> None:
    built = pods(tls={"secretName": "grpc-tls", "mutual": False})
    for component in WORKERS:
        args = parsed(built[component])
        assert args.tls_cert == "/etc/specsplit/tls/tls.crt" and args.tls_client_ca is None, component
    coordinator = parsed(built["coordinator"])
    assert coordinator.worker_tls_ca == "/etc/specsplit/tls/ca.crt"
    assert coordinator.worker_tls_cert is coordinator.worker_tls_key is None
    assert coordinator.worker_tls_server_name is None  # the CLI's default: the Service's name


def test_grpc_probes_give_way_to_tcp_where_the_port_serves_tls() -> None:
    """Kubernetes' grpc probe cannot do TLS: a TLS port is probed by TCP connect, the same port."""
    plain = pods()
    assert all(probe_handlers(pod) == {"grpc"} for pod in plain.values())
    internal = pods(tls={"secretName": "grpc-tls"})
    for component in WORKERS:
        for probe in PROBES:
            assert main(internal[component])[probe]["tcpSocket"] == {"port": 50051}, (component, probe)
        assert probe_handlers(internal[component]) == {"tcpSocket"}
    assert probe_handlers(internal["coordinator"]) == {"grpc"}  # its own port is still plaintext
    public = pods(coordinator={"tls": {"secretName": "public-tls"}})
    assert probe_handlers(public["coordinator"]) == {"tcpSocket"}
    assert all(probe_handlers(public[component]) == {"grpc"} for component in WORKERS)


def test_public_tls_and_tokens_on_the_coordinator() -> None:
    built = pods(coordinator={"tls": {"secretName": "public-tls"}, "auth": {"tokenSecretName": "api-tokens"}})
    coordinator = built["coordinator"]
    args = parsed(coordinator)
    assert (args.tls_cert, args.tls_key) == ("/etc/specsplit/public-tls/tls.crt", "/etc/specsplit/public-tls/tls.key")
    assert args.tls_client_ca is None and args.worker_tls_ca is None
    assert args.auth_token_file == "/etc/specsplit/auth/tokens"
    volumes = {volume["name"]: volume for volume in coordinator["volumes"]}
    assert volumes["public-tls"]["secret"] == {"secretName": "public-tls", "defaultMode": 0o440, "items": [
        {"key": "tls.crt", "path": "tls.crt"}, {"key": "tls.key", "path": "tls.key"}]}
    assert volumes["auth-tokens"]["secret"] == {"secretName": "api-tokens", "defaultMode": 0o440,
                                                "items": [{"key": "tokens", "path": "tokens"}]}
    mounts = {mount["name"]: mount for mount in main(coordinator)["volumeMounts"]}
    assert mounts["public-tls"] == {"name": "public-tls", "mountPath": "/etc/specsplit/public-tls", "readOnly": True}
    assert mounts["auth-tokens"] == {"name": "auth-tokens", "mountPath": "/etc/specsplit/auth", "readOnly": True}
    for component in WORKERS:  # the workers know nothing of the public side
        assert parsed(built[component]).tls_cert is None
        assert not any("secret" in volume for volume in built[component]["volumes"])


def test_tokens_alone_keep_grpc_probes_because_health_stays_open() -> None:
    from specsplit.services.rpc.security import PUBLIC_OPEN_SERVICES

    assert any("/grpc.health.v1.Health/".startswith(prefix) for prefix in PUBLIC_OPEN_SERVICES)
    assert probe_handlers(pods(coordinator={"auth": {"tokenSecretName": "api-tokens"}})["coordinator"]) == {"grpc"}


def test_secret_mounts_do_not_nest_in_the_variants_config_map() -> None:
    """A volume mounted inside a ConfigMap's volume is disturbed when the ConfigMap is rewritten (at every
    canary step); every mount of the coordinator has a folder of its own."""
    coordinator = pods(tls={"secretName": "grpc-tls"}, coordinator={
        "tls": {"secretName": "public-tls"}, "auth": {"tokenSecretName": "api-tokens"}})["coordinator"]
    paths = [mount["mountPath"] for mount in main(coordinator)["volumeMounts"]]
    for path in paths:
        assert not any(path.startswith(other + "/") for other in paths if other != path), paths
    assert parsed(coordinator).draft_variants_file.startswith("/etc/specsplit/config/")


@pytest.mark.asyncio
async def test_turning_tls_on_and_off_rolls_every_pool_over(operator: RunningOperator, cluster: Cluster) -> None:
    """Through the running operator: the merge patch must swap the probes' handler, not add a second one."""
    await cluster.create_deployment_resource("coder", base_spec())
    components = ("coordinator", "target", "draft")
    await eventually(lambda: all_present(cluster, components))

    await cluster.patch("sd", "coder", {"spec": {"tls": {"secretName": "grpc-tls"}}})

    async def switched(tls_on: bool) -> bool:
        for component in components:
            pod = (await cluster.get("deploy", f"coder-{component}"))["spec"]["template"]["spec"]
            mounted = INTERNAL in pod["volumes"]
            handlers = {key for probe in PROBES for key in main(pod)[probe] if key in ("grpc", "tcpSocket")}
            tcp = component != "coordinator" and tls_on
            if mounted != tls_on or handlers != ({"tcpSocket"} if tcp else {"grpc"}):
                return False
        return True
    await eventually(lambda: switched(True))
    target = (await cluster.get("deploy", "coder-target"))["spec"]["template"]["spec"]
    assert "--tls-client-ca" in main(target)["command"]

    await cluster.patch("sd", "coder", {"spec": {"tls": None}})
    await eventually(lambda: switched(False))
    target = (await cluster.get("deploy", "coder-target"))["spec"]["template"]["spec"]
    assert not any(arg.startswith("--tls") for arg in main(target)["command"])


async def all_present(cluster: Cluster, components: tuple[str, ...]) -> bool:
    return all([await cluster.get("deploy", f"coder-{component}") for component in components])
