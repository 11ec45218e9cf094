"""Per-variant statistics through a real in-process coordinator with two draft variants: the split by weight, the
totals against each request's own stats, the Prometheus page and the /v1/canary report."""

import asyncio
import json
import math
import urllib.request

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from specsplit.services.coordinator.coordinator import Coordinator, CoordinatorConfig
from specsplit.services.coordinator.generation import GenerationRequest
from specsplit.services.coordinator.replica_pools import ReplicaPool
from specsplit.services.coordinator.worker_clients import LocalDraftClient, LocalTargetClient
from specsplit.services.draft.proposer import DraftProposer
from specsplit.services.models.loader import load_model
from specsplit.services.runtime.model_runner import ModelRunner
from specsplit.services.sampling_params import SamplingParams
from specsplit.services.target.verifier import TargetVerifier
from specsplit.services.telemetry.canary_stats import CanaryStats, VariantTotals, variant_report
from specsplit.services.telemetry.coordinator_metrics import CoordinatorMetrics
from specsplit.services.telemetry.metrics_server import MetricsServer

REPORT_KEYS = {"name", "weight", "requests", "drafted_tokens", "accepted_tokens", "acceptance_rate",
               "acceptance_rate_ci95", "tokens_per_second", "tokens_per_second_ci95"}


@pytest.fixture(scope="module")
def two_variants(tiny_pair):
    """A coordinator over one target and two draft variants: 'stable' (close draft, weight 3) and 'canary'
    (unrelated draft, weight 1), with its metrics attached."""
    target = load_model(str(tiny_pair["target"]), "float64")

    def draft(path, name):
        return LocalDraftClient(DraftProposer(ModelRunner(load_model(str(path), "float64"), num_blocks=2048)), name)

    coordinator = Coordinator(
        ReplicaPool("target", [LocalTargetClient(TargetVerifier(ModelRunner(target, num_blocks=4096)))]),
        [ReplicaPool("stable", [draft(tiny_pair["close"], "draft-a")], 3.0),
         ReplicaPool("canary", [draft(tiny_pair["unrelated"], "draft-b")], 1.0)],
        target.tokenizer, target.config.eos_token_ids, CoordinatorConfig(num_speculative_tokens=4), seed=5,
    )
    metrics = CoordinatorMetrics(coordinator).attach()
    return coordinator, metrics


def run(coordinator, prompts, **params):
    async def main():
        results = await asyncio.gather(*(
            coordinator.generate(GenerationRequest(list(p), SamplingParams(**params))) for p in prompts
        ))
        await coordinator.wait_idle()
        return results

    return asyncio.run(main())


def samples(registry) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(generate_latest(registry).decode()) for s in f.samples}


def test_split_follows_the_weights(two_variants):
    coordinator, metrics = two_variants
    before = metrics.canary.snapshot()
    n = 400
    results = run(coordinator, [[1 + i % 200, 2, 3] for i in range(n)], max_tokens=1)
    served = {name: sum(r.draft_variant == name for r in results) for name in ("stable", "canary")}
    assert sum(served.values()) == n
    # Each request draws its variant independently with p = weight share: within 4.5 binomial sigmas
    # (a false failure once in ~150,000 runs).
    p = 1.0 / 4.0
    assert abs(served["canary"] - n * p) <= 4.5 * math.sqrt(n * p * (1 - p))
    after = metrics.canary.snapshot()
    for name in served:
        previous = before[name].finished_requests if name in before else 0
        assert after[name].finished_requests - previous == served[name]


def test_totals_equal_the_requests_own_statistics(two_variants):
    coordinator, metrics = two_variants
    before = samples(metrics.registry)
    results = run(coordinator, [[5, 6, 7, 8], [9, 10], [11, 12, 13], [40, 41], [50, 60, 70], [3, 3, 3]],
                  max_tokens=16, ignore_eos=True)
    after = samples(metrics.registry)

    def grew(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    for variant in ("stable", "canary"):
        mine = [r for r in results if r.draft_variant == variant]
        assert grew("specsplit_drafted_tokens_total", method="rejection", variant=variant) == sum(r.stats.draft_tokens for r in mine)
        assert grew("specsplit_accepted_tokens_total", method="rejection", variant=variant) == sum(r.stats.accepted_tokens for r in mine)
        assert grew("specsplit_requests_total", variant=variant, finish_reason="length") == len(mine)
        for i in range(4):
            assert grew("specsplit_drafted_position_total", method="rejection", variant=variant, position=str(i)) == sum(
                r.stats.drafted_per_position[i] for r in mine if len(r.stats.drafted_per_position) > i)
            assert grew("specsplit_accepted_position_total", method="rejection", variant=variant, position=str(i)) == sum(
                r.stats.accepted_per_position[i] for r in mine if len(r.stats.accepted_per_position) > i)
        assert grew("specsplit_time_to_first_token_seconds_count", variant=variant) == len(mine)
        assert grew("specsplit_inter_token_latency_seconds_count", variant=variant) == len(mine)
    totals = metrics.canary.snapshot()
    stable, canary = totals["stable"], totals["canary"]
    assert after[("specsplit_acceptance_rate", (("method", "rejection"), ("variant", "stable")))] == pytest.approx(stable.accepted / stable.drafted)
    efficiency = after[("specsplit_system_efficiency", (("method", "rejection"), ("variant", "stable")))]
    assert efficiency == pytest.approx((stable.accepted + stable.rounds) / (stable.drafted + stable.rounds))
    # The close draft is accepted far more often than the unrelated one: the statistics tell them apart.
    assert stable.acceptance_rate > 0.2 > 0.05 > canary.acceptance_rate
    assert after[("specsplit_stage_latency_seconds_count", (("stage", "verify"),))] > before.get(
        ("specsplit_stage_latency_seconds_count", (("stage", "verify"),)), 0)
    assert after[("specsplit_running_sequences", (("role", "coordinator"),))] == 0


def test_canary_report_over_http_and_as_protobuf(two_variants):
    coordinator, metrics = two_variants
    run(coordinator, [[7, 8, 9], [1, 2], [30, 31, 32], [4, 4]], max_tokens=16, ignore_eos=True)
    server = MetricsServer(metrics.registry, "127.0.0.1", 0, {"/v1/canary": metrics.canary.report})
    try:
        with urllib.request.urlopen(f"{server.url}/v1/canary", timeout=10) as response:
            report = json.loads(response.read())
        with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as response:
            assert b"specsplit_drafted_tokens_total" in response.read()
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(f"{server.url}/nothing", timeout=10)
    finally:
        server.stop()
    assert [v["name"] for v in report["variants"]] == ["stable", "canary"]
    totals = metrics.canary.snapshot()
    for v in report["variants"]:
        assert set(v) == REPORT_KEYS
        assert v["weight"] == {"stable": 3, "canary": 1}[v["name"]]
        t = totals[v["name"]]
        assert (v["requests"], v["drafted_tokens"], v["accepted_tokens"]) == (t.finished_requests, t.drafted, t.accepted)
        low, high = v["acceptance_rate_ci95"]
        assert low <= v["acceptance_rate"] <= high
        assert v["acceptance_rate"] == pytest.approx(t.accepted / t.drafted)
        low, high = v["tokens_per_second_ci95"]
        assert 0 < low <= v["tokens_per_second"] <= high
    pb = metrics.canary.to_pb()
    assert [s.name for s in pb.variants] == ["stable", "canary"]
    for s, v in zip(pb.variants, report["variants"]):
        assert s.acceptance_rate_low == pytest.approx(v["acceptance_rate_ci95"][0])
        assert s.tokens_per_second == pytest.approx(v["tokens_per_second"])
        assert list(s.acceptance_per_position) == pytest.approx(totals[s.name].acceptance_per_position())


def test_a_variant_without_data_reports_nulls_not_made_up_numbers():
    report = variant_report("fresh", 10, VariantTotals())
    assert report == {"name": "fresh", "weight": 10, "requests": 0, "drafted_tokens": 0, "accepted_tokens": 0,
                      "acceptance_rate": None, "acceptance_rate_ci95": None, "tokens_per_second": None,
                      "tokens_per_second_ci95": None}
    stats = CanaryStats(lambda: [])
    stats.add_request("x", "length", 10, 2.0)
    assert stats.report() == {"variants": []}  # only configured variants are listed
    report = variant_report("x", 1, stats.snapshot()["x"])
    assert report["tokens_per_second"] == 5.0 and report["tokens_per_second_ci95"] is None  # one request: no interval
