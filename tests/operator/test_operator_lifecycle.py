"""The real operator against a Kubernetes API over HTTP: create, update, delete, idempotence, bad specs,
replica counts edited by someone else, restart."""

from __future__ import annotations

import json

import pytest

from specsplit.operator import naming

from kube_harness import Cluster, RunningOperator, SpecsplitEmulator, base_spec, eventually

pytestmark = pytest.mark.asyncio

CHILDREN = [("deploy", "coder-coordinator"), ("deploy", "coder-target"), ("deploy", "coder-draft"),
            ("svc", "coder"), ("svc", "coder-target"), ("svc", "coder-draft"), ("cm", "coder-coordinator")]


def command(deployment: dict) -> list[str]:
    return deployment["spec"]["template"]["spec"]["containers"][0]["command"]


async def converged(cluster: Cluster, name: str = "coder", generation: int = 1) -> dict:
    """Wait until the operator has handled `generation`: recorded in status, and in kopf's own bookkeeping."""
    async def check() -> dict | None:
        resource = await cluster.get("sd", name)
        status = (resource or {}).get("status") or {}
        handled = json.loads((resource or {}).get("metadata", {}).get("annotations", {}).get(
            "specsplit.dev/last-handled-configuration", "{}"))
        done = status.get("observedGeneration") == generation and status.get("conditions") \
            and handled.get("spec") == resource.get("spec")
        return resource if done else None
    return await eventually(check)


def condition(resource: dict, kind: str) -> dict:
    return next(item for item in resource["status"]["conditions"] if item["type"] == kind)


async def test_create_builds_every_object_owned_and_labelled(operator: RunningOperator, cluster: Cluster) -> None:
    created = await cluster.create_deployment_resource("coder", base_spec())
    resource = await converged(cluster)
    uid = created["metadata"]["uid"]

    for kind, name in CHILDREN:
        child = await cluster.get(kind, name)
        assert child is not None, f"{kind} {name} was not created"
        [owner] = child["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (naming.KIND, "coder", uid, True)
        assert child["metadata"]["labels"][naming.LABEL_INSTANCE] == "coder"
        assert child["metadata"]["labels"][naming.LABEL_NAME] == "specsplit"
    assert await cluster.get("deploy", "coder-draft-canary") is None

    target, draft, coordinator = [await cluster.get("deploy", f"coder-{c}") for c in ("target", "draft", "coordinator")]
    assert command(target) == ["specsplit", "target", "--model", "qwen2.5-coder-1.5b-instruct",
                               "--port", "50051", "--round-port", "50061", "--metrics-port", "9090",
                               "--metrics-host", "0.0.0.0", "--warm-up-k", "5", "--allow-unauthenticated"]
    assert command(draft) == ["specsplit", "draft", "--model", "qwen2.5-coder-0.5b-instruct",
                              "--port", "50051", "--round-port", "50061", "--metrics-port", "9090",
                              "--metrics-host", "0.0.0.0", "--warm-up-k", "5", "--allow-unauthenticated"]
    assert command(coordinator) == ["specsplit", "coordinator", "--target", "coder-target:50051",
                                    "--draft-variants-file", "/etc/specsplit/config/draft-variants.json",
                                    "--port", "50051", "--metrics-port", "9090", "--metrics-host", "0.0.0.0",
                                    "--http-port", "8000",
                                    "--num-speculative-tokens", "5",
                                    "--spin-wait", "off"]  # no CPU request: no core set aside to spin
    assert target["spec"]["replicas"] == 1
    assert target["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    variants = json.loads((await cluster.get("cm", "coder-coordinator"))["data"]["draft-variants.json"])
    assert variants == {"variants": [{"name": "stable", "weight": 100, "addresses": ["coder-draft:50051"]}]}
    assert (await cluster.get("svc", "coder-target"))["spec"]["clusterIP"] == "None"

    assert resource["status"]["target"]["desiredReplicas"] == 1
    assert condition(resource, "InvalidSpec")["status"] == "False"
    assert condition(resource, "Ready")["status"] == "False"  # no pods are ready yet
    assert "specsplit.dev/finalizer" in resource["metadata"]["finalizers"]
    created_events = await eventually(lambda: cluster.events("Created"))
    assert "Deployment coder-target" in created_events[0]["message"]

    # The Deployment controller (absent from the emulator) reports every pool ready: the resource turns Ready.
    for component in ("coordinator", "target", "draft"):
        deployment = await cluster.get("deploy", f"coder-{component}")
        await cluster.patch("deploy", f"coder-{component}", {"status": {
            "replicas": deployment["spec"]["replicas"], "readyReplicas": deployment["spec"]["replicas"],
            "updatedReplicas": deployment["spec"]["replicas"],
            "observedGeneration": deployment["metadata"]["generation"]}}, subresource="status")
    operator.clock.advance(10)  # the next autoscaling pass also refreshes the status

    async def ready() -> bool:
        return condition(await cluster.get("sd", "coder"), "Ready")["status"] == "True"
    await eventually(ready)
    resource = await cluster.get("sd", "coder")
    assert condition(resource, "Progressing")["status"] == "False"
    assert resource["status"]["target"]["readyReplicas"] == 1


async def test_update_patches_only_what_changed(operator: RunningOperator, cluster: Cluster,
                                                emulator: SpecsplitEmulator) -> None:
    await cluster.create_deployment_resource("coder", base_spec())
    await converged(cluster)
    before = len(list(emulator))

    spec = base_spec(numSpeculativeTokens=7)
    spec["target"]["model"] = "/models/qwen2.5-coder-7b-instruct"
    spec["draft"]["replicas"] = {"min": 2, "max": 4}
    await cluster.patch("sd", "coder", {"spec": spec})
    resource = await converged(cluster, generation=2)

    assert command(await cluster.get("deploy", "coder-target"))[3] == "/models/qwen2.5-coder-7b-instruct"
    coordinator = command(await cluster.get("deploy", "coder-coordinator"))
    assert coordinator[coordinator.index("--num-speculative-tokens") + 1] == "7"
    assert (await cluster.get("deploy", "coder-draft"))["spec"]["replicas"] == 2  # raised to the new minimum
    assert resource["status"]["draft"]["desiredReplicas"] == 2
    assert resource["status"]["target"]["model"] == "/models/qwen2.5-coder-7b-instruct"

    patched = {(request.resource.plural, request.name) for request in emulator.writes(before)
               if request.resource.plural in ("deployments", "services", "configmaps")}
    assert patched == {("deployments", "coder-target"), ("deployments", "coder-coordinator"),
                       ("deployments", "coder-draft")}


async def test_second_reconcile_changes_nothing(operator: RunningOperator, cluster: Cluster,
                                                emulator: SpecsplitEmulator) -> None:
    await cluster.create_deployment_resource("coder", base_spec())
    await converged(cluster)
    await eventually(lambda: operator.decisions)  # the first autoscaling pass is done as well
    before = len(list(emulator))

    # Two more passes of the timer (each a full reconcile), then a restarted operator resuming the resource.
    for _ in range(2):
        now = operator.clock.advance(10)
        outcome = await eventually(lambda now=now: operator.decisions_at("reconcile", now))
        assert outcome[0].writes == 0
    await operator.stop()
    operator.decisions.clear()
    await operator.start()
    resumed = await eventually(lambda: [d for d in operator.decisions if d[2] == "reconcile"])
    assert resumed[0][4].writes == 0

    writes = emulator.writes(before, resources=("deployments", "services", "configmaps", naming.PLURAL))
    assert [(w.method, w.url.path, w.data) for w in writes] == [], json.dumps([w.data for w in writes])


async def test_delete_removes_every_object(operator: RunningOperator, cluster: Cluster) -> None:
    spec = base_spec(canary={"model": "draft-v2", "weight": 10})
    await cluster.create_deployment_resource("coder", spec)
    await converged(cluster)
    assert await cluster.get("deploy", "coder-draft-canary") is not None

    await cluster.delete("sd", "coder")

    async def gone() -> bool:
        return await cluster.get("sd", "coder") is None
    await eventually(gone)
    for kind, name in CHILDREN + [("deploy", "coder-draft-canary"), ("svc", "coder-draft-canary")]:
        assert await cluster.get(kind, name) is None, f"{kind} {name} is left behind"


async def test_invalid_spec_is_reported_and_the_operator_carries_on(operator: RunningOperator, cluster: Cluster,
                                                                    emulator: SpecsplitEmulator) -> None:
    bad = base_spec(canary={"model": "draft-v2", "promotion": {"metric": "latency"}})
    bad["target"]["replicas"] = {"min": 5, "max": 2}
    await cluster.create_deployment_resource("broken", bad)
    resource = await converged(cluster, "broken")

    invalid = condition(resource, "InvalidSpec")
    assert invalid["status"] == "True"
    assert "spec.target.replicas: min (5) must not exceed max (2)" in invalid["message"]
    assert "spec.canary.promotion.metric: 'latency' is not one of tokensPerSecond, acceptanceRate" \
        in invalid["message"]
    assert condition(resource, "Ready")["status"] == "False"
    assert await cluster.get("deploy", "broken-target") is None
    warnings = await eventually(lambda: cluster.events("InvalidSpec"))
    assert warnings[0]["type"] == "Warning" and warnings[0]["involvedObject"]["name"] == "broken"

    # No crash loop: the operator keeps serving other resources, and does not retry the bad one.
    await cluster.create_deployment_resource("coder", base_spec())
    await converged(cluster)
    operator.clock.advance(30)
    await eventually(lambda: operator.decisions_at("reconcile", operator.clock.now))
    assert operator.alive()
    assert len(await cluster.events("InvalidSpec")) == 1

    # Fixing the spec deploys it and clears the condition.
    await cluster.patch("sd", "broken", {"spec": {"target": {"replicas": {"min": 1, "max": 2}},
                                                   "canary": {"promotion": {"metric": "acceptanceRate"}}}})
    resource = await converged(cluster, "broken", generation=2)
    assert condition(resource, "InvalidSpec")["status"] == "False"
    assert await cluster.get("deploy", "broken-target") is not None


async def test_replicas_edited_by_someone_else_are_put_back(operator: RunningOperator, cluster: Cluster) -> None:
    await cluster.create_deployment_resource("coder", base_spec())
    await converged(cluster)

    await cluster.patch("deploy", "coder-draft", {"spec": {"replicas": 7}})  # e.g. `kubectl scale`

    async def restored() -> bool:
        return (await cluster.get("deploy", "coder-draft"))["spec"]["replicas"] == 1
    await eventually(restored)
    [event] = await eventually(lambda: cluster.events("ReplicasOverridden"))
    assert event["type"] == "Warning"
    assert event["involvedObject"]["name"] == "coder" and event["involvedObject"]["kind"] == naming.KIND
    assert "coder-draft: replicas set to 7" in event["message"]


async def test_operator_joins_the_peering(operator: RunningOperator, cluster: Cluster,
                                          emulator: SpecsplitEmulator) -> None:
    """Leader election: the operator records itself, with its priority, in the ClusterKopfPeering."""
    async def peers() -> dict:
        response = await emulator.get("/apis/kopf.dev/v1/clusterkopfpeerings/specsplit")
        return (await response.json()).get("status") or {}
    status = await eventually(peers)
    [peer] = status.values()
    assert peer["priority"] == 100


async def test_colocated_mode_runs_the_coordinator_in_the_target_pods_and_switches(
        operator: RunningOperator, cluster: Cluster) -> None:
    """coordinator.colocated: no coordinator Deployment, the public Service on the target pods, the mode and the
    public API's replicas (the target pool's) in status; switching back and forth adds and removes the Deployment."""
    await cluster.create_deployment_resource("coder", base_spec(coordinator={"colocated": True}))
    resource = await converged(cluster)
    assert await cluster.get("deploy", "coder-coordinator") is None
    target = command(await cluster.get("deploy", "coder-target"))
    assert target[:4] == ["specsplit", "target", "--model", "qwen2.5-coder-1.5b-instruct"]
    assert target[target.index("--coordinate"):] == [
        "--coordinate", "--coordinator-port", "50050", "--coordinator-metrics-port", "9091",
        "--draft-variants-file", "/etc/specsplit/config/draft-variants.json", "--http-port", "8000",
        "--num-speculative-tokens", "5"]
    service = (await cluster.get("svc", "coder"))["spec"]
    assert service["selector"] == naming.selector("coder", "target")
    assert {p["name"]: p["targetPort"] for p in service["ports"]} == {
        "grpc": "coord-grpc", "http": "http", "metrics": "coord-metrics"}
    assert resource["status"]["coordinator"] == {"mode": "Colocated", "desiredReplicas": 1, "readyReplicas": 0}

    # A coordinator count does not apply here: refused, and what runs stays as it is.
    await cluster.patch("sd", "coder", {"spec": {"coordinator": {"replicas": 3}}})
    resource = await converged(cluster, generation=2)
    assert "spec.coordinator.replicas: 3 does not apply with colocated: true" in \
        condition(resource, "InvalidSpec")["message"]
    assert await cluster.get("deploy", "coder-coordinator") is None

    await cluster.patch("sd", "coder", {"spec": {"coordinator": {"colocated": False}}})
    resource = await converged(cluster, generation=3)
    coordinator = await cluster.get("deploy", "coder-coordinator")
    assert coordinator["spec"]["replicas"] == 3 and command(coordinator)[:2] == ["specsplit", "coordinator"]
    assert "--coordinate" not in command(await cluster.get("deploy", "coder-target"))
    assert (await cluster.get("svc", "coder"))["spec"]["selector"] == naming.selector("coder", "coordinator")
    assert resource["status"]["coordinator"] == {"mode": "Separate", "desiredReplicas": 3, "readyReplicas": 0}

    await cluster.patch("sd", "coder", {"spec": {"coordinator": {"colocated": True, "replicas": 1}}})
    resource = await converged(cluster, generation=4)
    assert await cluster.get("deploy", "coder-coordinator") is None
    assert resource["status"]["coordinator"]["mode"] == "Colocated"
    removed = await eventually(lambda: cluster.events("Removed"))
    assert "Deployment coder-coordinator" in removed[-1]["message"]
