"""Canary rollouts of a draft model, decided from the coordinators' /v1/canary statistics served over HTTP."""

from __future__ import annotations

import json

import pytest

from kube_harness import Cluster, ReplayServer, RunningOperator, base_spec, eventually

pytestmark = pytest.mark.asyncio

CANARY_MODEL = "/models/qwen2.5-coder-0.5b-instruct-distilled"


def variant(name: str, weight: int, requests: int, drafted: int, accepted: int, speed: float,
            speed_ci: tuple[float, float]) -> dict:
    """One variant as the coordinator's GET /v1/canary reports it (the brief's contract)."""
    rate = accepted / drafted if drafted else 0.0
    return {"name": name, "weight": weight, "requests": requests, "drafted_tokens": drafted,
            "accepted_tokens": accepted, "acceptance_rate": rate, "acceptance_rate_ci95": [rate - 0.02, rate + 0.02],
            "tokens_per_second": speed, "tokens_per_second_ci95": list(speed_ci)}


async def variants_file(cluster: Cluster) -> list[dict]:
    return json.loads((await cluster.get("cm", "coder-coordinator"))["data"]["draft-variants.json"])["variants"]


async def evaluate(operator: RunningOperator, seconds: float = 5) -> object:
    now = operator.clock.advance(seconds)
    [decision] = await eventually(lambda: operator.decisions_at("canary", now))
    return decision


async def canary_status(cluster: Cluster, **expected: object) -> dict:
    async def check() -> dict | None:
        status = ((await cluster.get("sd", "coder")).get("status") or {}).get("canary") or {}
        return status if all(status.get(key) == value for key, value in expected.items()) else None
    return await eventually(check)


async def start_rollout(operator: RunningOperator, cluster: Cluster, replay: ReplayServer, metric: str,
                        coordinators: int = 1) -> list[int]:
    spec = base_spec(canary={"model": CANARY_MODEL, "weight": 10, "promotion": {
        "metric": metric, "confidence": 0.95, "minRequests": 100, "stepPercent": 20, "maxWeight": 50,
        "intervalSeconds": 5}})
    await cluster.create_deployment_resource("coder", spec)
    ports = await replay.start(pods=coordinators)
    for index, port in enumerate(ports):
        await cluster.add_pod("coder", "coordinator", index, port)
    await eventually(lambda: cluster.get("deploy", "coder-draft-canary"))
    # The first evaluation comes as soon as the operator sees the resource; no statistics are served yet.
    [first] = await eventually(lambda: operator.decisions_at("canary", operator.clock.now))
    assert first.code == "WaitingForRequests"
    return ports


async def test_canary_steps_up_then_is_promoted(operator: RunningOperator, cluster: Cluster,
                                                replay: ReplayServer) -> None:
    [port] = await start_rollout(operator, cluster, replay, "acceptanceRate")
    canary = await cluster.get("deploy", "coder-draft-canary")
    assert canary["spec"]["template"]["spec"]["containers"][0]["command"][:4] == \
        ["specsplit", "draft", "--model", CANARY_MODEL]
    assert await cluster.get("svc", "coder-draft-canary") is not None
    assert await variants_file(cluster) == [
        {"name": "stable", "weight": 90, "addresses": ["coder-draft:50051"]},
        {"name": "canary", "weight": 10, "addresses": ["coder-draft-canary:50051"]}]

    replay.canary[port] = {"variants": [variant("stable", 90, 450, 9000, 6300, 40.0, (39.0, 41.0)),
                                        variant("canary", 10, 50, 1000, 700, 40.0, (38.0, 42.0))]}
    decision = await evaluate(operator)
    assert (decision.action, decision.code) == ("hold", "WaitingForRequests")
    await canary_status(cluster, lastDecision="hold", lastDecisionReason="WaitingForRequests", weight=10)

    replay.canary[port] = {"variants": [variant("stable", 90, 900, 18000, 12600, 40.0, (39.0, 41.0)),
                                        variant("canary", 10, 110, 2200, 1550, 40.0, (38.0, 42.0))]}
    decision = await evaluate(operator)
    assert (decision.action, decision.weight) == ("step-up", 30)
    await canary_status(cluster, weight=30, lastDecision="step-up")
    assert [v["weight"] for v in await variants_file(cluster)] == [70, 30]

    # The canary accepts clearly more of what it drafts (0.80 vs 0.70 over thousands of tokens): promote.
    replay.canary[port] = {"variants": [variant("stable", 70, 1500, 30000, 21000, 40.0, (39.0, 41.0)),
                                        variant("canary", 30, 600, 12000, 9600, 44.0, (42.0, 46.0))]}
    decision = await evaluate(operator)
    assert decision.action == "promote"
    status = await canary_status(cluster, phase="Promoted")
    assert status["weight"] == 0 and "canary is better" in status["lastDecisionMessage"]

    async def promoted() -> bool:
        draft = await cluster.get("deploy", "coder-draft")
        return draft["spec"]["template"]["spec"]["containers"][0]["command"][3] == CANARY_MODEL
    await eventually(promoted)
    await eventually(lambda: _absent(cluster, "deploy", "coder-draft-canary"))
    assert await cluster.get("svc", "coder-draft-canary") is None
    assert await variants_file(cluster) == [{"name": "stable", "weight": 100, "addresses": ["coder-draft:50051"]}]
    resource = await cluster.get("sd", "coder")
    assert resource["status"]["draft"]["model"] == CANARY_MODEL
    assert resource["status"]["draft"]["promotion"]["replacedModel"] == "qwen2.5-coder-0.5b-instruct"
    assert resource["spec"]["draft"]["model"] == "qwen2.5-coder-0.5b-instruct"  # the user's spec is not rewritten
    reasons = [event["reason"] for event in await cluster.events()]
    assert {"CanaryHold", "CanaryStepUp", "CanaryPromoted"} <= set(reasons)

    # A later spec change of the draft model by the user wins over the promotion.
    await cluster.patch("sd", "coder", {"spec": {"draft": {"model": "qwen2.5-coder-0.5b-instruct-v3"}}})

    async def users_model() -> bool:
        draft = await cluster.get("deploy", "coder-draft")
        return draft["spec"]["template"]["spec"]["containers"][0]["command"][3] == "qwen2.5-coder-0.5b-instruct-v3"
    await eventually(users_model)


async def test_worse_canary_is_rolled_back(operator: RunningOperator, cluster: Cluster,
                                           replay: ReplayServer) -> None:
    """Two coordinators each report a share; merged, the canary is clearly slower: roll back."""
    ports = await start_rollout(operator, cluster, replay, "tokensPerSecond", coordinators=2)
    for port in ports:
        replay.canary[port] = {"variants": [variant("stable", 90, 400, 8000, 5600, 41.0, (40.0, 42.0)),
                                            variant("canary", 10, 60, 1200, 840, 33.0, (31.0, 35.0))]}
    decision = await evaluate(operator)
    assert decision.action == "rollback" and "tokens/s canary 33.0 vs stable 41.0" in decision.message
    await canary_status(cluster, phase="RolledBack", weight=0, lastDecision="rollback")
    await eventually(lambda: _absent(cluster, "deploy", "coder-draft-canary"))
    assert await variants_file(cluster) == [{"name": "stable", "weight": 100, "addresses": ["coder-draft:50051"]}]
    draft = await cluster.get("deploy", "coder-draft")
    assert draft["spec"]["template"]["spec"]["containers"][0]["command"][3] == "qwen2.5-coder-0.5b-instruct"
    [event] = await eventually(lambda: cluster.events("CanaryRolledBack"))
    assert event["type"] == "Warning"

    # The rollout is over: later evaluations neither query the coordinators nor bring the canary back.
    hits = dict(replay.hits)
    operator.clock.advance(30)
    await eventually(lambda: operator.decisions_at("reconcile", operator.clock.now))
    assert replay.hits == hits
    assert await cluster.get("deploy", "coder-draft-canary") is None


async def _absent(cluster: Cluster, kind: str, name: str) -> bool:
    return await cluster.get(kind, name) is None


async def test_colocated_coordinators_report_from_the_target_pods(operator: RunningOperator, cluster: Cluster,
                                                                  replay: ReplayServer) -> None:
    """Co-located, the coordinators are the target pods: /v1/canary comes from their `coord-metrics` port, while the
    target pool still scales on the target's own metrics port of the same pods."""
    spec = base_spec(coordinator={"colocated": True}, canary={"model": CANARY_MODEL, "weight": 10, "promotion": {
        "metric": "acceptanceRate", "confidence": 0.95, "minRequests": 100, "stepPercent": 20, "maxWeight": 50,
        "intervalSeconds": 5}})
    await cluster.create_deployment_resource("coder", spec)
    [first] = await eventually(lambda: operator.decisions_at("canary", operator.clock.now))
    assert first.code == "WaitingForRequests"  # no pod yet
    await eventually(lambda: operator.decisions_at("target", operator.clock.now))
    assert await cluster.get("deploy", "coder-coordinator") is None

    target_metrics, coordinator_metrics = await replay.start(pods=2)
    replay.metrics[target_metrics] = replay.recording("target_busy")
    replay.canary[coordinator_metrics] = {"variants": [
        variant("stable", 90, 900, 18000, 12600, 40.0, (39.0, 41.0)),
        variant("canary", 10, 110, 2200, 1550, 40.0, (38.0, 42.0))]}
    await cluster.add_pod("coder", "target", 0, target_metrics, other_ports={"coord-metrics": coordinator_metrics})

    now = operator.clock.advance(10)  # both timers are due
    [decision] = await eventually(lambda: operator.decisions_at("canary", now))
    assert (decision.action, decision.weight) == ("step-up", 30)
    [scaling] = await eventually(lambda: operator.decisions_at("target", now))
    assert scaling.replicas == 3 and "verifyQueueDepth=12" in scaling.reason
    await canary_status(cluster, weight=30, lastDecision="step-up")

    async def stepped_up() -> bool:
        return [v["weight"] for v in await variants_file(cluster)] == [70, 30]
    await eventually(stepped_up)
    target = await cluster.get("deploy", "coder-target")
    assert {"name": "config", "mountPath": "/etc/specsplit/config", "readOnly": True} in \
        target["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]  # the file the coordinators read
    assert replay.hits[coordinator_metrics] >= 1 and replay.hits[target_metrics] >= 1
