"""The speculation policy: which k it picks from acceptance and measured costs, how it explores and refreshes, and
that output stays exact whatever it picks."""

import asyncio

import pytest

from specsplit.services.coordinator.speculation_policy import (Acceptance, SpeculationPolicy, bucket_of,
                                                               expected_tokens)
from specsplit.services.local_engine import LocalEngine
from specsplit.services.sampling_params import SamplingParams
from tiny_models import byte_tokenizer


def measured(policy, batch=1, decode=0.010, verify=0.011, propose_per_k=0.001, max_k=4, times=3):
    """Feed `times` rounds of both ends, as a running deployment would."""
    for _ in range(times):
        policy.record_costs(batch, max_k, max_k * propose_per_k, verify)
        policy.record_costs(batch, 0, 0.0, decode)


def test_expected_tokens_and_buckets():
    assert expected_tokens(0.0, 4) == 1.0 and expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert [bucket_of(b) for b in (1, 2, 3, 8, 9, 64)] == [1, 2, 4, 8, 16, 64]


def test_fixed_always_proposes_the_limit():
    policy = SpeculationPolicy(16, fixed=True)
    assert [policy.choose([0.0], 1, 4) for _ in range(5)] == [4] * 5
    assert policy.choose([0.0], 1, 0) == 0


def test_a_new_bucket_measures_both_ends_first():
    policy = SpeculationPolicy(16)
    picks = []
    for _ in range(6):
        k = policy.choose([0.9], 8, 4)
        picks.append(k)
        policy.record_costs(8, k, 0.004 if k else 0.0, 0.011 if k else 0.010)
    assert picks == [4, 4, 4, 0, 0, 0]
    assert policy.choose([0.9], 8, 4) > 0  # then a good draft speculates


def test_picks_the_k_with_the_most_tokens_per_second():
    policy = SpeculationPolicy(16)
    measured(policy, decode=0.010, verify=0.011, propose_per_k=0.001)  # cheap draft, verification nearly free
    assert policy.choose([0.9], 1, 4) == 4
    # Per the model: at a = 0.5, k = 1 gives 1.5 tokens in 12 ms, k = 2 1.75 in 13.5 ms (interpolated), ...
    rates = {k: expected_tokens(0.5, k) / (0.010 + 0.00025 * k + 0.001 * k) for k in range(1, 5)}
    assert policy.choose([0.5], 1, 4) == max(rates, key=rates.get)
    # An expensive draft: only a very good one is worth it.
    expensive = SpeculationPolicy(16)
    measured(expensive, decode=0.010, verify=0.012, propose_per_k=0.008)
    assert expensive.choose([0.5], 1, 4) == 0
    assert expensive.choose([0.99], 1, 4) > 0


def test_a_useless_draft_is_switched_off_but_probed():
    policy = SpeculationPolicy(16, probe_interval=8)
    measured(policy, batch=2, decode=0.010, verify=0.011, propose_per_k=0.002)
    picks = [policy.choose([0.0, 0.0], 2, 4) for _ in range(200)]
    assert set(picks) == {0, 1}  # only probes of one token
    # After 8 rounds, then twice as long after each probe that changed nothing, up to 8 x 8 rounds apart.
    assert [i for i, k in enumerate(picks) if k] == [7, 23, 55, 119, 183]


def test_a_draft_that_starts_agreeing_resets_the_probe_interval():
    policy = SpeculationPolicy(16, probe_interval=8)
    measured(policy, batch=1, decode=0.010, verify=0.011, propose_per_k=0.002)
    picks = [policy.choose([0.0], 1, 4) for _ in range(100)]
    assert picks.count(1) == 3  # probes at 8, 24, 56 rounds: backing off
    assert policy.choose([0.95], 1, 4) > 0  # the probes found agreement: speculate again
    picks = [policy.choose([0.0], 1, 4) for _ in range(8)]
    assert picks[-1] == 1  # and a later useless spell is probed at the first interval again


def test_stale_ends_are_measured_again():
    policy = SpeculationPolicy(16, refresh_interval=10)
    measured(policy, decode=0.010, verify=0.011, propose_per_k=0.008)
    picks = [policy.choose([0.3], 1, 4) for _ in range(12)]
    assert 4 in picks  # the end not chosen for 10 rounds is measured once more


def test_interference_does_not_decide():
    """Costs are the least of recent measurements: a capture or a prefill in the same step only adds time."""
    policy = SpeculationPolicy(16)
    measured(policy, decode=0.010, verify=0.011, propose_per_k=0.001)
    for _ in range(3):
        policy.record_costs(1, 4, 2.0, 5.0)  # a graph capture, say
        policy.record_costs(1, 0, 0.0, 0.5)
    assert policy.choose([0.9], 1, 4) == 4
    assert policy.choose([0.0], 1, 4) == 0


def test_acceptance_starts_from_the_variant_rate_and_learns():
    policy = SpeculationPolicy(16, initial_rate=0.5)
    own = Acceptance()
    assert policy.rate(own, "a") == pytest.approx(0.5)
    for _ in range(20):
        policy.record_acceptance(own, "a", 4, 0)  # every first proposal rejected: 1 tested, 0 accepted
    assert policy.rate(own, "a") < 0.15
    assert policy.rate(Acceptance(), "a") < 0.1  # the variant's rate moved too: new requests start low
    assert policy.rate(Acceptance(), "b") == pytest.approx(0.5)


def test_adaptive_engine_output_is_exact_and_seeded_requests_stay_reproducible(tiny_pair):
    """Whatever k the policy picks, greedy output is the target's; a seeded sampled request (its k fixed) gives
    the same tokens alone and in a batch of adaptive requests."""
    tok = byte_tokenizer()
    prompts = [tok.encode(p) for p in ("def add(a, b):", "x = [1, 2, 3]", "hello world")]
    alone_engine = LocalEngine(tiny_pair["target"], None, num_speculative_tokens=0, dtype="float64")
    engine = LocalEngine(tiny_pair["target"], tiny_pair["unrelated"], num_speculative_tokens=4, dtype="float64")

    def run(engine, prompts, params):
        async def main():
            results = await asyncio.gather(*(engine.generate(p, sp) for p, sp in zip(prompts, params)))
            await engine.coordinator.wait_idle()
            return [r.token_ids for r in results]
        return asyncio.run(main())

    greedy = [SamplingParams(max_tokens=40, ignore_eos=True) for _ in prompts]
    want = run(alone_engine, prompts, greedy)
    for _ in range(3):  # the policy explores, then settles: output never changes
        assert run(engine, prompts, greedy) == want
    seeded = SamplingParams(temperature=1.0, seed=5, max_tokens=30, ignore_eos=True)
    alone = run(engine, prompts[:1], [seeded])
    assert run(engine, prompts, [seeded] + greedy[1:])[0] == alone[0]
    assert engine.kv_blocks_used() == {"target": 0, "draft": 0}


def test_a_lower_cap_interpolates_rather_than_measuring_its_own():
    """A request's last rounds cap k at the tokens it has left (3, 2, 1): with the top end measured, they are
    decided from the measured costs, not spent measuring k = 3, 2 and 1 with a draft that never agrees."""
    policy = SpeculationPolicy(16)
    measured(policy, decode=0.010, verify=0.011, propose_per_k=0.002)
    assert [policy.choose([0.0], 1, limit) for limit in (3, 2, 1)] == [0, 0, 0]
    assert policy.choose([0.95], 1, 2) == 2  # and a good draft still speculates up to its cap
