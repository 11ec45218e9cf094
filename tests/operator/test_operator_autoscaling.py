"""Each pool scales on its own metrics, scraped over HTTP from servers replaying recorded Prometheus scrapes;
the operator's clock is injected, so windows and cooldowns pass without sleeping."""

from __future__ import annotations

import pytest

from kube_harness import Cluster, ReplayServer, RunningOperator, base_spec, eventually

pytestmark = pytest.mark.asyncio


async def evaluate(operator: RunningOperator, role: str, seconds: float) -> object:
    """Let `seconds` pass on the operator's clock and return the decision of the pass that follows."""
    now = operator.clock.advance(seconds)
    [decision] = await eventually(lambda: operator.decisions_at(role, now))
    return decision


async def first_pass(operator: RunningOperator) -> None:
    """The first pass runs as soon as the operator sees the resource, before any pod exists: wait it out."""
    await eventually(lambda: operator.decisions_at("draft", operator.clock.now))


async def replicas(cluster: Cluster, component: str) -> int:
    return (await cluster.get("deploy", f"coder-{component}"))["spec"]["replicas"]


async def settle(cluster: Cluster, component: str, expected: int) -> None:
    async def check() -> bool:
        return await replicas(cluster, component) == expected
    await eventually(check)


async def test_target_pool_follows_load_within_bounds_windows_and_cooldown(
        operator: RunningOperator, cluster: Cluster, replay: ReplayServer) -> None:
    # target: 1..5 replicas; scale-down window 60 s, cooldown 30 s, at most 2 replicas per decision.
    await cluster.create_deployment_resource("coder", base_spec())
    await first_pass(operator)
    ports = await replay.start(pods=5)
    busy, idle = replay.recording("target_busy"), replay.recording("target_idle")

    replay.metrics[ports[0]] = busy
    await cluster.add_pod("coder", "target", 0, ports[0])
    decision = await evaluate(operator, "target", 10)  # queue depth 12 per pod vs target 4: wants 3x
    assert decision.replicas == 3 and "verifyQueueDepth=12" in decision.reason
    await settle(cluster, "target", 3)

    for index in (1, 2):  # the new pods come up, just as busy
        replay.metrics[ports[index]] = busy
        await cluster.add_pod("coder", "target", index, ports[index])
    decision = await evaluate(operator, "target", 10)  # wants 9: capped by max (5), reached in one step of 2
    assert decision.replicas == 5
    await settle(cluster, "target", 5)
    scaled_at = operator.clock.now
    for index in (3, 4):
        await cluster.add_pod("coder", "target", index, ports[index])
    for port in ports:
        replay.metrics[port] = idle

    decision = await evaluate(operator, "target", 10)  # idle now, but 5 was wanted within the window
    assert decision.replicas == 5 and "stabilisation window" in decision.reason
    decision = await evaluate(operator, "target", scaled_at + 61 - operator.clock.now)
    assert decision.replicas == 3  # the window has passed; down by the bounded step
    await settle(cluster, "target", 3)
    decision = await evaluate(operator, "target", 10)
    assert decision.replicas == 3 and "cooldown" in decision.reason
    decision = await evaluate(operator, "target", 30)
    assert decision.replicas == 1, decision.reason  # never below min
    await settle(cluster, "target", 1)

    async def recorded() -> dict | None:
        status = (await cluster.get("sd", "coder"))["status"]["target"]
        return status if status["desiredReplicas"] == 1 else None
    status = await eventually(recorded)
    assert "3 -> 1" in status["lastScaleReason"]
    scaled = [event["message"] for event in await cluster.events("Scaled")]
    assert any(message.startswith("target: ") and "1 -> 3" in message for message in scaled)
    assert await replicas(cluster, "draft") == 1  # the draft pool had no load and was left alone


async def test_draft_pool_scales_on_propose_latency_alone(
        operator: RunningOperator, cluster: Cluster, replay: ReplayServer) -> None:
    spec = base_spec()
    spec["draft"]["autoscaling"] = {"proposeQueueDepth": 4, "proposeLatencySeconds": 0.05}
    await cluster.create_deployment_resource("coder", spec)
    await first_pass(operator)
    [draft_port, target_port] = await replay.start(pods=2)
    replay.metrics[draft_port] = replay.recording("draft_fast")
    replay.metrics[target_port] = replay.recording("target_steady")
    await cluster.add_pod("coder", "draft", 0, draft_port)
    await cluster.add_pod("coder", "target", 0, target_port)

    decision = await evaluate(operator, "draft", 10)  # one scrape: no interval to average latency over yet
    assert decision.replicas == 1
    replay.metrics[draft_port] = replay.recording("draft_slow")  # 100 proposals at 0.2 s since the last scrape
    decision = await evaluate(operator, "draft", 10)
    assert decision.replicas == 3 and "proposeLatencySeconds=0.2" in decision.reason
    await settle(cluster, "draft", 3)
    [target_decision] = operator.decisions_at("target", operator.clock.now)
    assert target_decision.replicas == 1 and "is right" in target_decision.reason  # at its targets: no change
    assert await replicas(cluster, "target") == 1


async def test_unreachable_pods_do_not_scale_a_pool_down(
        operator: RunningOperator, cluster: Cluster, replay: ReplayServer) -> None:
    spec = base_spec()
    spec["target"]["replicas"] = {"min": 2, "max": 5}
    await cluster.create_deployment_resource("coder", spec)
    await first_pass(operator)
    [port, silent] = await replay.start(pods=2)
    replay.metrics[port] = replay.recording("target_busy")
    await cluster.add_pod("coder", "target", 0, port)
    await cluster.add_pod("coder", "target", 1, silent)  # answers 404: no metrics from it
    decision = await evaluate(operator, "target", 10)
    assert decision.replicas == 4  # one busy pod of two: load for 6, bounded to a step of 2

    replay.metrics[port] = replay.recording("target_idle")
    decision = await evaluate(operator, "target", 1000)
    assert decision.replicas == 4 and "only 1 of 4 pods reported" in decision.reason
    assert replay.hits[silent] >= 2  # it was asked each time
