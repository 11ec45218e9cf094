"""The coordinator's OpenAI-compatible HTTP API in the chart: the SpeculativeDeployment carries its Service port,
the operator's objects expose it (container port, Service port, the coordinator's --http-port), and the
coordinator's NetworkPolicy admits the same clients on it as on gRPC; httpPort 0 takes all of it away."""

from chart_render import of_kind, operator_objects, render, speculative_deployment
from test_chart_network_policy import Pod, _pods, allowed

HTTP = 8000


def cr_name(objects) -> str:
    """The public Service carries the SpeculativeDeployment's name (the coordinator ConfigMap's, less -coordinator)."""
    config = next(o for o in objects if o["kind"] == "ConfigMap")
    return config["metadata"]["name"].removesuffix("-coordinator")


def _coordinator(objects):
    service = next(o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == cr_name(objects))
    deployment = next(o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-coordinator"))
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return service, container


def test_the_http_port_renders_into_the_service_and_the_pod():
    manifests = render({"coordinator": {"httpPort": 8080}})
    cr = speculative_deployment(manifests)
    assert cr["spec"]["coordinator"]["httpPort"] == 8080
    service, container = _coordinator(operator_objects(cr))
    assert {p["name"]: (p["port"], p["targetPort"]) for p in service["spec"]["ports"]}["http"] == (8080, "http")
    assert {"name": "http", "containerPort": HTTP, "protocol": "TCP"} in container["ports"]
    command = container["command"]
    assert command[command.index("--http-port") + 1] == str(HTTP)


def test_the_http_port_answers_the_clients_grpc_answers():
    manifests = render()
    policies, pods = of_kind(manifests, "NetworkPolicy"), _pods(manifests)
    assert allowed(policies, pods["stranger"], pods["coordinator"], HTTP)
    for pool in ("target", "draft"):
        assert not allowed(policies, pods["stranger"], pods[pool], HTTP), pool
    clients = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "apps"}}}]
    narrowed = render({"networkPolicy": {"clients": clients}})
    policies, pods = of_kind(narrowed, "NetworkPolicy"), _pods(narrowed)
    assert allowed(policies, Pod("apps", {"app": "web"}), pods["coordinator"], HTTP)
    assert not allowed(policies, pods["stranger"], pods["coordinator"], HTTP)


def test_http_port_zero_turns_the_api_off():
    manifests = render({"coordinator": {"httpPort": 0}})
    service, container = _coordinator(operator_objects(speculative_deployment(manifests)))
    assert "http" not in {p["name"] for p in service["spec"]["ports"]}
    assert all(p["name"] != "http" for p in container["ports"])
    command = container["command"]
    assert command[command.index("--http-port") + 1] == "-1"
    policies, pods = of_kind(manifests, "NetworkPolicy"), _pods(manifests)
    assert not allowed(policies, pods["stranger"], pods["coordinator"], HTTP)
