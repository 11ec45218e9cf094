"""Parsing recorded Prometheus scrapes, aggregating a pool, and fetching them over HTTP from local servers."""

from __future__ import annotations

import pytest

from specsplit.operator import naming
from specsplit.operator.scraping import PodScraper, aggregate, parse_pod_sample, ready_endpoints

from kube_harness import ReplayServer


def pod(name: str, component: str, phase: str = "Running", ip: str | None = "10.0.0.7", port: int = 9090,
        terminating: bool = False) -> dict:
    meta = {"name": name, "labels": naming.labels("coder", component)}
    if terminating:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "spec": {"containers": [{"ports": [{"name": "grpc", "containerPort": 50051},
                                                                 {"name": "metrics", "containerPort": port}]}]},
            "status": {"phase": phase, **({"podIP": ip} if ip else {})}}


def test_only_running_matching_pods_with_an_ip_are_scraped_on_their_metrics_port() -> None:
    pods = [pod("a", "target", port=9191), pod("b", "target", phase="Pending"), pod("c", "target", ip=None),
            pod("d", "draft"), pod("e", "target", terminating=True)]
    endpoints = ready_endpoints(pods, naming.selector("coder", "target"), "/metrics")
    assert [(e.name, e.url) for e in endpoints] == [("a", "http://10.0.0.7:9191/metrics")]


def test_a_co_located_coordinator_is_read_on_its_own_port_of_the_target_pods() -> None:
    both = pod("a", "target", port=9090)
    both["spec"]["containers"][0]["ports"].append({"name": "coord-metrics", "containerPort": 9091})
    selector = naming.selector("coder", "target")
    assert [e.url for e in ready_endpoints([both], selector, "/metrics")] == ["http://10.0.0.7:9090/metrics"]
    coordinator = ready_endpoints([both], selector, "/v1/canary", "coord-metrics")
    assert [e.url for e in coordinator] == ["http://10.0.0.7:9091/v1/canary"]
    without = ready_endpoints([pod("b", "target")], selector, "/v1/canary", "coord-metrics")
    assert [e.url for e in without] == ["http://10.0.0.7:9091/v1/canary"]  # unnamed: the port the operator sets


def test_a_recorded_scrape_yields_the_roles_gauges_and_stage_histogram() -> None:
    sample = parse_pod_sample("p", ReplayServer.recording("target_busy"), "target")
    assert (sample.kv_blocks_used, sample.kv_blocks_total, sample.queue_depth) == (950, 1000, 12)
    assert sample.stage_latency_count == 250  # the verify stage
    draft = parse_pod_sample("p", ReplayServer.recording("draft_slow"), "draft")
    assert draft.stage_latency_count == 1100 and draft.stage_latency_sum == pytest.approx(40.0)
    other_role = parse_pod_sample("p", ReplayServer.recording("target_busy"), "draft")
    assert other_role.queue_depth is None and other_role.kv_blocks_used is None


def test_aggregate_averages_pods_and_takes_latency_over_the_interval() -> None:
    fast = parse_pod_sample("p0", ReplayServer.recording("draft_fast"), "draft")
    slow = parse_pod_sample("p0", ReplayServer.recording("draft_slow"), "draft")
    first = aggregate([fast], {})
    assert first.stage_latency_seconds is None  # a single scrape has no interval
    second = aggregate([slow], {"p0": fast})
    assert second.stage_latency_seconds == pytest.approx(0.2)  # 100 proposals, 20 s, since the last scrape
    assert second.observed("draft") == {"proposeQueueDepth": 1.0, "proposeLatencySeconds": pytest.approx(0.2)}

    busy = parse_pod_sample("t0", ReplayServer.recording("target_busy"), "target")
    idle = parse_pod_sample("t1", ReplayServer.recording("target_idle"), "target")
    pool = aggregate([busy, idle], {})
    assert pool.pods_reporting == 2
    assert pool.kv_utilization == pytest.approx((0.95 + 0.04) / 2)
    assert pool.queue_depth == pytest.approx(6.0)
    restarted = aggregate([fast], {"p0": slow})  # counters went back: a restarted pod is skipped once
    assert restarted.stage_latency_seconds is None


@pytest.mark.asyncio
async def test_scraper_fetches_over_http_and_skips_pods_that_fail(replay: ReplayServer) -> None:
    [good, bad] = await replay.start(pods=2)
    replay.metrics[good] = replay.recording("target_idle")
    endpoints = ready_endpoints([pod("good", "target", ip="127.0.0.1", port=good),
                                 pod("bad", "target", ip="127.0.0.1", port=bad)],
                                naming.selector("coder", "target"), "/metrics")
    scraper = PodScraper(timeout_seconds=2)
    try:
        texts = await scraper.fetch(endpoints)
    finally:
        await scraper.close()
    assert list(texts) == ["good"]
    assert parse_pod_sample("good", texts["good"], "target").queue_depth == 0
    assert replay.hits == {good: 1, bad: 1}
