"""coordinator.colocated: the chart's SpeculativeDeployment asks for the coordinator inside every target pod, and
what the operator builds from it runs that: no coordinator Deployment, `specsplit target --coordinate` with the
coordinator's flags (as the real CLI parses them), its Secrets and ports, the public Service and the monitors on the
target pods' coordinator ports."""

from chart_render import of_kind, operator_objects, render, speculative_deployment
from chart_values import VALUE_SETS


def _built(value_set: str) -> dict[tuple[str, str], dict]:
    cr = speculative_deployment(render(VALUE_SETS[value_set]))
    return {(obj["kind"], obj["metadata"]["labels"]["app.kubernetes.io/component"]
             if obj["kind"] == "Deployment" else obj["metadata"]["name"]): obj for obj in operator_objects(cr)}


def _target(built: dict) -> dict:
    (container,) = built[("Deployment", "target")]["spec"]["template"]["spec"]["containers"]
    return container


def _parsed(container: dict):
    from specsplit.cli import build_parser

    assert container["command"][:2] == ["specsplit", "target"]
    return build_parser().parse_args(container["command"][1:])  # exits on an unknown flag


def test_the_speculative_deployment_asks_for_it_without_replicas_or_resources():
    coordinator = speculative_deployment(render(VALUE_SETS["colocated"]))["spec"]["coordinator"]
    assert coordinator["colocated"] is True
    assert "replicas" not in coordinator and "resources" not in coordinator  # they would not apply
    default = speculative_deployment(render())["spec"]["coordinator"]
    assert "colocated" not in default and default["replicas"] == 1


def test_target_pods_run_the_coordinator_with_its_flags_and_variants_file():
    built = _built("colocated")
    assert ("Deployment", "coordinator") not in built
    container = _target(built)
    args = _parsed(container)
    assert args.coordinate and args.model == "qwen2.5-coder-1.5b-instruct"
    assert (args.port, args.round_port, args.metrics_port) == (50051, -1, 9090)  # no round channel: called in-process
    assert (args.coordinator_port, args.coordinator_metrics_port, args.http_port) == (50050, 9091, 8000)
    assert args.draft_variants_file == "/etc/specsplit/config/draft-variants.json"
    assert args.num_speculative_tokens == 4 and args.metrics_host == "0.0.0.0"
    assert args.target == "" and args.draft == ""  # no peer targets (operator/manifests.py says why); drafts: the file
    assert args.worker_secret_file == "/etc/specsplit/worker-auth/secret" and not args.allow_unauthenticated
    assert {"name": "config", "mountPath": "/etc/specsplit/config", "readOnly": True} in container["volumeMounts"]
    volumes = {v["name"]: v for v in built[("Deployment", "target")]["spec"]["template"]["spec"]["volumes"]}
    assert ("ConfigMap", "coder-specsplit-coordinator") in built
    assert volumes["config"]["configMap"]["name"] == "coder-specsplit-coordinator"
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {
        "grpc": 50051, "metrics": 9090, "coord-grpc": 50050, "http": 8000, "coord-metrics": 9091}
    # The drafts are called by it, on their round channel too; they run no coordinator.
    (draft,) = built[("Deployment", "draft")]["spec"]["template"]["spec"]["containers"]
    assert "--coordinate" not in draft["command"] and draft["command"][draft["command"].index("--round-port") + 1] \
        == "50061"


def test_public_tls_tokens_and_internal_tls_reach_the_target_pods():
    values = VALUE_SETS["colocated-tls-auth"]
    built = _built("colocated-tls-auth")
    container = _target(built)
    args = _parsed(container)
    # One certificate for the process's ports, whose clients are public: the public one, and no client CA.
    assert (args.tls_cert, args.tls_key) == ("/etc/specsplit/public-tls/tls.crt", "/etc/specsplit/public-tls/tls.key")
    assert args.tls_client_ca is None
    assert args.auth_token_file == "/etc/specsplit/auth/tokens"
    # Internal (mutual) TLS: to the drafts.
    assert (args.worker_tls_ca, args.worker_tls_cert, args.worker_tls_key) == (
        "/etc/specsplit/tls/ca.crt", "/etc/specsplit/tls/tls.crt", "/etc/specsplit/tls/tls.key")
    assert args.worker_tls_server_name == values["tls"]["serverName"]
    secrets = {v["name"]: v["secret"]["secretName"]
               for v in built[("Deployment", "target")]["spec"]["template"]["spec"]["volumes"] if "secret" in v}
    assert secrets.pop("worker-auth").endswith("-worker-auth")
    assert secrets == {"tls": "specsplit-grpc-tls", "public-tls": "specsplit-public-tls",
                       "auth-tokens": "specsplit-api-tokens"}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):  # the public port serves TLS
        assert container[probe]["tcpSocket"] == {"port": 50050} and "grpc" not in container[probe], probe


def test_the_public_service_leads_to_the_target_pods_coordinator_ports():
    built = _built("colocated")
    service = built[("Service", "coder-specsplit")]
    target_pod = built[("Deployment", "target")]["spec"]["template"]
    assert service["spec"]["selector"].items() <= target_pod["metadata"]["labels"].items()
    assert {p["name"]: (p["port"], p["targetPort"]) for p in service["spec"]["ports"]} == {
        "grpc": (50051, "coord-grpc"), "http": (8000, "http"), "metrics": (9090, "coord-metrics")}
    container_ports = {p["name"] for p in target_pod["spec"]["containers"][0]["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= container_ports


def test_monitors_scrape_the_coordinator_metrics_as_the_coordinators():
    """The Grafana dashboard selects the coordinator's series by component="coordinator": the co-located ones say
    so too, from the PodMonitor's endpoint of the coordinator's port and from the public Service's label."""
    manifests = render(VALUE_SETS["colocated"])
    built = _built("colocated")
    target_ports = {p["name"] for p in built[("Deployment", "target")]["spec"]["template"]["spec"]["containers"][0][
        "ports"]}
    (pod_monitor,) = [m for m in of_kind(manifests, "PodMonitor")
                      if m["metadata"]["labels"].get("app.kubernetes.io/component") != "operator"]
    endpoints = {e["port"]: e for e in pod_monitor["spec"]["podMetricsEndpoints"]}
    assert set(endpoints) == {"metrics", "coord-metrics"} and set(endpoints) <= target_ports
    assert endpoints["coord-metrics"]["relabelings"] == [
        {"targetLabel": "app_kubernetes_io_component", "replacement": "coordinator"}]
    assert "relabelings" not in endpoints["metrics"]
    (service_monitor,) = of_kind(manifests, "ServiceMonitor")
    (endpoint,) = service_monitor["spec"]["endpoints"]
    assert endpoint["relabelings"] == [{"sourceLabels": ["__meta_kubernetes_service_label_app_kubernetes_io_component"],
                                        "targetLabel": "app_kubernetes_io_component"}]
    assert built[("Service", "coder-specsplit")]["metadata"]["labels"]["app.kubernetes.io/component"] == "coordinator"
    # Without co-location, neither monitor relabels.
    separate = render(VALUE_SETS["monitoring-on"])
    assert all("relabelings" not in e for m in of_kind(separate, "PodMonitor") for e in m["spec"]["podMetricsEndpoints"])
    assert all("relabelings" not in e for m in of_kind(separate, "ServiceMonitor") for e in m["spec"]["endpoints"])
