"""Typical acceptance (NOT lossless) through the in-process engine: greedy output still the target's, seeded output
repeatable, per-request opt-in only where the deployment allows it, mixed batches, statistics and metrics labelled."""

import asyncio
import logging

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from specsplit.services.errors import InvalidArgument
from specsplit.services.local_engine import LocalEngine
from specsplit.services.sampling_params import SamplingParams
from specsplit.services.target.acceptance_method import AcceptancePolicy
from specsplit.services.telemetry.coordinator_metrics import CoordinatorMetrics
from tiny_models import byte_tokenizer

PROMPTS = ["def add(a, b):", "x", "The quick brown fox jumps over", "1, 2, 3, 5, 8, 13,", "Once upon a time"]
TYPICAL = AcceptancePolicy(method="typical")


def run(engine, prompts, params):
    """All prompts at once (one batch per round), each with its own SamplingParams."""
    async def main():
        tok = byte_tokenizer()
        results = await asyncio.gather(*(engine.coordinator.generate(engine.request(tok.encode(p), q))
                                         for p, q in zip(prompts, params)))
        await engine.coordinator.wait_idle()
        return results

    return asyncio.run(main())


def same(params: SamplingParams, n: int) -> list[SamplingParams]:
    return [SamplingParams(**vars(params)) for _ in range(n)]


@pytest.fixture(scope="module")
def target_only(tiny_pair):
    return LocalEngine(tiny_pair["target"], None, num_speculative_tokens=0, dtype="float64")


@pytest.mark.parametrize("draft_kind", ["close", "unrelated"])
def test_greedy_output_is_the_target_alones(tiny_pair, target_only, draft_kind, caplog):
    with caplog.at_level(logging.WARNING):
        engine = LocalEngine(tiny_pair["target"], tiny_pair[draft_kind], num_speculative_tokens=4, dtype="float64",
                             acceptance=TYPICAL)
    assert "TYPICAL ACCEPTANCE" in caplog.text and "NOT" in caplog.text
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    expected = [r.token_ids for r in run(target_only, PROMPTS, same(greedy, len(PROMPTS)))]
    results = run(engine, PROMPTS, same(greedy, len(PROMPTS)))
    assert [r.token_ids for r in results] == expected
    assert all(r.acceptance_method == "typical" for r in results)
    assert sum(r.stats.draft_tokens for r in results) > 0


def test_seeded_output_repeats_whatever_the_batch(tiny_pair):
    engine = LocalEngine(tiny_pair["target"], tiny_pair["close"], num_speculative_tokens=4, dtype="float64",
                         acceptance=TYPICAL)
    sampled = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=24, ignore_eos=True) for i in range(len(PROMPTS))]
    together = run(engine, PROMPTS, sampled)
    alone = [run(engine, [p], [q])[0] for p, q in zip(PROMPTS[:2], sampled[:2])]
    again = run(engine, PROMPTS, [SamplingParams(**vars(q)) for q in sampled])
    assert [r.token_ids for r in again] == [r.token_ids for r in together]
    assert [r.token_ids for r in alone] == [r.token_ids for r in together[:2]]
    assert len({tuple(r.token_ids) for r in together}) == len(PROMPTS)


def test_typical_accepts_more_than_rejection_at_high_temperature(tiny_pair):
    """What it is for: at temperature 1 the perturbed draft's samples often miss the rejection test, while typical
    acceptance keeps any proposal the target finds likely enough."""
    def acceptance(policy):
        engine = LocalEngine(tiny_pair["target"], tiny_pair["close"], num_speculative_tokens=4, dtype="float64",
                             acceptance=policy)
        params = [SamplingParams(temperature=1.0, seed=i, max_tokens=32, ignore_eos=True) for i in range(len(PROMPTS))]
        results = run(engine, PROMPTS, params)
        return sum(r.stats.accepted_tokens for r in results) / sum(r.stats.draft_tokens for r in results)

    rejection, typical = acceptance(AcceptancePolicy()), acceptance(TYPICAL)
    assert typical > rejection, (typical, rejection)


def test_requests_opt_in_only_where_the_deployment_allows(tiny_pair):
    lossless = LocalEngine(tiny_pair["target"], tiny_pair["close"], num_speculative_tokens=4, dtype="float64")
    with pytest.raises(InvalidArgument, match="typical acceptance .NOT lossless. is not enabled"):
        run(lossless, PROMPTS[:1], [SamplingParams(acceptance_method="typical")])
    with pytest.raises(InvalidArgument, match="apply to typical acceptance"):
        run(lossless, PROMPTS[:1], [SamplingParams(posterior_threshold=0.2)])
    with pytest.raises(InvalidArgument, match="posterior_threshold must be in"):
        SamplingParams(acceptance_method="typical", posterior_threshold=1.0).validate()
    with pytest.raises(InvalidArgument, match="acceptance method must be one of"):
        SamplingParams(acceptance_method="greedy").validate()
    assert lossless.kv_blocks_used() == {"target": 0, "draft": 0}  # refused at prefill: nothing held anywhere
    # A typical deployment still serves lossless requests that ask for it.
    typical = LocalEngine(tiny_pair["target"], tiny_pair["close"], num_speculative_tokens=4, dtype="float64",
                          acceptance=TYPICAL)
    result = run(typical, PROMPTS[:1], [SamplingParams(acceptance_method="rejection", max_tokens=8)])[0]
    assert result.acceptance_method == "rejection"


def test_mixed_batch_gives_each_request_its_own_method(tiny_pair):
    """With per-request opt-in, typical and lossless requests share verify batches; each gets exactly what it would
    alone (the lossless one its rejection-sampling output, the typical one with its own threshold its typical one)."""
    engine = LocalEngine(tiny_pair["target"], tiny_pair["close"], num_speculative_tokens=4, dtype="float64",
                         acceptance=AcceptancePolicy(allow_typical_per_request=True))
    base = dict(temperature=1.0, max_tokens=24, ignore_eos=True)
    params = [SamplingParams(seed=i, **base) if i % 2 else
              SamplingParams(seed=i, acceptance_method="typical", posterior_threshold=0.05 + 0.02 * i, **base)
              for i in range(len(PROMPTS))]
    together = run(engine, PROMPTS, params)
    alone = [run(engine, [p], [SamplingParams(**vars(q))])[0] for p, q in zip(PROMPTS, params)]
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert [r.acceptance_method for r in together] == ["typical" if i % 2 == 0 else "rejection" for i in range(len(PROMPTS))]


def test_metrics_tell_the_methods_apart(tiny_pair):
    engine = LocalEngine(tiny_pair["target"], tiny_pair["close"], num_speculative_tokens=4, dtype="float64",
                         acceptance=AcceptancePolicy(allow_typical_per_request=True))
    metrics = CoordinatorMetrics(engine.coordinator).attach()
    base = dict(temperature=0.8, max_tokens=16, ignore_eos=True)
    params = [SamplingParams(seed=i, acceptance_method="typical" if i < 2 else None, **base) for i in range(4)]
    results = run(engine, PROMPTS[:4], params)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(generate_latest(metrics.registry).decode()) for s in f.samples}
    for method, mine in (("typical", results[:2]), ("rejection", results[2:])):
        labels = (("method", method), ("variant", "default"))
        assert samples[("specsplit_drafted_tokens_total", labels)] == sum(r.stats.draft_tokens for r in mine)
        assert samples[("specsplit_accepted_tokens_total", labels)] == sum(r.stats.accepted_tokens for r in mine)
