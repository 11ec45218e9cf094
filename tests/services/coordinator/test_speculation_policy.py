"""The speculation policy: which k it picks from acceptance and measured costs, how it explores and refreshes, and
that output stays exact whatever it picks."""

import asyncio

import pytest

from specsplit.services.coordinator.speculation_policy import (BASELINE_AFTER, MAX_PROBE_BACKOFF, Acceptance,
                                                               SpeculationPolicy, bucket_of, expected_tokens)
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


def run_rounds(policy, rates, batch, rounds, cost=lambda k: 0.010 + 0.00025 * k + (0.001 * k + 0.0002 if k else 0.0),
               limit=4):
    """`rounds` rounds of the policy against a cost model (seconds of a round at k), each measured as a clean
    round would be; returns the ks chosen."""
    picks = []
    for _ in range(rounds):
        k = policy.choose(rates, batch, limit)
        picks.append(k)
        total = cost(k)
        propose = cost(k) - cost(0) if k else 0.0
        policy.record_costs(batch, k, propose, total - propose)
    return picks


def test_the_first_bucket_measures_plain_decoding_then_one_proposal_then_the_best():
    policy = SpeculationPolicy(16)
    picks = run_rounds(policy, [0.9], 8, 30)
    assert picks[:3] == [0, 1, 4]  # the baseline, the cheapest proposal, then the best k predicted from them
    assert picks[3:BASELINE_AFTER] == [4] * (BASELINE_AFTER - 3)
    assert picks[BASELINE_AFTER:].count(0) == 1  # the baseline's second measurement, once the bucket has run a while


def test_settles_on_the_k_with_the_most_tokens_per_second():
    def cost(k):  # a draft step costs a tenth of a target step, verification grows with k
        return 0.010 + 0.0008 * k + (0.001 * k + 0.0003 if k else 0.0)

    for rate in (0.5, 0.7, 0.9):
        want = max(range(9), key=lambda k: expected_tokens(rate, k) / cost(k))
        picks = run_rounds(SpeculationPolicy(8), [rate], 1, 120, cost, limit=8)
        assert picks[-40:].count(want) >= 35, (rate, want, picks)
    # An expensive draft: only a very good one is worth it.
    expensive = SpeculationPolicy(16)
    assert run_rounds(expensive, [0.5], 1, 40, lambda k: 0.010 + 0.0005 * k + 0.008 * k)[-20:].count(0) >= 19  # a probe
    assert run_rounds(expensive, [0.99], 1, 40, lambda k: 0.010 + 0.0005 * k + 0.008 * k)[-1] > 0


def test_a_new_bucket_borrows_the_nearest_curve_and_measures_plain_decoding_later():
    policy = SpeculationPolicy(8)
    run_rounds(policy, [0.8], 1, 40)
    picks = run_rounds(policy, [0.8] * 8, 8, 20)
    assert picks[0] > 0 and 0 not in picks[:BASELINE_AFTER]  # speculates from its first round
    assert 0 in picks[BASELINE_AFTER:]  # then measures its own baseline once


def test_a_neighbour_measured_with_interference_is_measured_again():
    """k = 5 measured once while something else ran: it looks slow, and so do 6-8 beyond it; measured again later
    it is found cheap, and the choice climbs past it."""
    policy = SpeculationPolicy(8)
    cost = lambda k: 0.0067 + (0.0011 * k + 0.0004 if k else 0.0)  # noqa: E731 (a GPU at batch 1)
    run_rounds(policy, [0.95], 1, 8, cost, limit=4)
    policy.record_costs(1, 5, 5 * 0.0011 + 0.0004, 0.0067 * 1.25)  # verification 25% slower once
    picks = run_rounds(policy, [0.95], 1, 80, cost, limit=8)
    assert picks[-10:].count(8) >= 8


def test_a_sequence_with_little_evidence_is_tested_before_speculation_stops():
    """Plain decoding wins on a new sequence's estimate, but not on the estimate's upper bound: one proposal a
    round tests it; a sequence with as low an estimate from much evidence decodes plainly."""
    policy = SpeculationPolicy(8)
    run_rounds(policy, [0.5], 1, 20)
    cost_of_one = policy.round_costs(1, 1)
    break_even = cost_of_one[1] / cost_of_one[0] - 1.0  # the rate at which one proposal pays
    low = break_even - 0.05
    policy.variant_counts["x"] = (1.0, low)  # a new variant whose first proposals were as low
    unsure, sure = Acceptance(tested=4.0, accepted=4.0 * low), Acceptance(tested=400.0, accepted=400.0 * low)
    assert policy.rate(unsure, "x") < break_even and policy.rate(sure, "x") < break_even
    assert policy.choose([policy.rate(unsure, "x")], 1, 4, [unsure.evidence]) == 1
    assert policy.choose([policy.rate(sure, "x")], 1, 4, [sure.evidence]) == 0


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


def test_plain_decoding_is_measured_again_when_stale():
    policy = SpeculationPolicy(16, refresh_interval=10)
    picks = run_rounds(policy, [0.9], 1, 40)
    assert 0 in picks[15:]  # the baseline measured again after 10 rounds without it


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


def test_a_switched_off_draft_that_starts_agreeing_speculates_again_within_a_few_probes():
    policy = SpeculationPolicy(8, probe_interval=8)
    cost = lambda k: 0.010 + 0.0005 * k + (0.001 * k + 0.0002 if k else 0.0)  # noqa: E731

    def requests(n, agrees: bool) -> list[int]:
        """n requests of 50 rounds each, one at a time."""
        picks = []
        for _ in range(n):
            own = Acceptance()
            for _ in range(50):
                k, probe = policy.choose_round([policy.rate(own, "d")], 1, 8, [own.evidence])
                picks.append(k)
                if k:
                    policy.record_acceptance(own, "d", k, k if agrees else 0, probe)
                policy.record_costs(1, k, cost(k) - cost(0) if k else 0.0, cost(0) + 0.0005 * k)
        return picks

    requests(8, agrees=False)
    assert policy.variant_rate("d") < 0.05
    assert not policy.worth_drafting("d", 1)
    picks = requests(4, agrees=True)
    first = next(i for i, k in enumerate(picks) if k > 1)
    assert first < 8 * MAX_PROBE_BACKOFF + 30, picks  # the next probe agreed, and a few rounds later
    assert picks[-20:].count(0) == 0 and policy.worth_drafting("d", 1)


def test_a_probe_round_weights_only_the_sequences_it_probes():
    """A fixed-k request proposing beside a probe (its proposals all accepted) counts as in any round; the probed
    sequence's rejection counts as the probe's weight: a switched-off draft stays off."""
    policy = SpeculationPolicy(8, probe_interval=4)
    measured(policy, decode=0.010, verify=0.011, propose_per_k=0.002)
    policy.variant_counts["d"] = (256.0, 2.0)  # a draft that has not agreed for a long while
    probed, fixed = Acceptance(tested=100.0, accepted=1.0), Acceptance()
    rounds = [policy.choose_round([policy.rate(probed, "d"), 0.0], 2, 4, [probed.evidence, 0.0]) for _ in range(12)]
    k, probe = next((k, probe) for k, probe in rounds if probe is not None)
    assert k == 1 and probe.weight == 32.0  # one sequence probed: the whole weight is its
    assert all(probe is None for k, probe in rounds if k == 0)
    policy.record_acceptance(probed, "d", 1, 0, probe)
    policy.record_acceptance(fixed, "d", 4, 4, None)  # the fixed-k request: not probed
    assert policy.variant_rate("d") < 0.03
    assert not policy.worth_drafting("d", 2)
    # Two probed sequences share the weight.
    two = [policy.choose_round([0.01, 0.01, 0.0], 3, 4, [50.0, 50.0, 0.0]) for _ in range(40)]
    assert {probe.weight for _, probe in two if probe is not None} == {16.0}


def test_a_plain_round_measured_with_interference_does_not_make_a_useless_draft_look_worth_it():
    """Plain decoding measured once while something else ran (15x its cost), a proposal round measured cheap: a
    verification of more rows never costs less than one of fewer, so plain decoding is at most that cheap, and
    a draft that never agrees is switched off at once instead of proposing every round."""
    policy = SpeculationPolicy(4)
    policy.record_costs(1, 0, 0.0, 0.030)
    policy.record_costs(1, 1, 0.001, 0.0021)
    useless = Acceptance(tested=50.0, accepted=0.5)  # one proposal in a hundred
    policy.variant_counts["d"] = (50.0, 0.5)
    picks = [policy.choose([policy.rate(useless, "d")], 1, 4) for _ in range(20)]
    assert picks.count(0) >= 19


def test_a_probe_attaches_the_sequence_with_the_most_tokens_left_and_only_one(tiny_pair):
    """No draft worth its KV at this batch size and a probe due: one sequence gets its draft, the one with the most
    tokens to speculate with (a draft prefill for a sequence about to finish would buy nothing)."""
    from specsplit.services.coordinator.generation import GenerationRequest

    engine = LocalEngine(tiny_pair["target"], tiny_pair["unrelated"], num_speculative_tokens=4, dtype="float64")
    coordinator, policy = engine.coordinator, engine.coordinator.policy
    measured(policy, batch=3, decode=0.010, verify=0.011, propose_per_k=0.002)
    for pool in coordinator.drafts:
        policy.variant_counts[pool.name] = (256.0, 1.0)  # a draft that never agrees
    tok = byte_tokenizer()

    async def main():
        sequences = [coordinator.submit(GenerationRequest(tok.encode(f"prompt {i}"), SamplingParams(max_tokens=n)))
                     for i, n in enumerate((3, 40, 12))]  # nothing awaited: the loop has not taken them yet
        assert not policy.worth_drafting(coordinator.drafts[0].name, 3)
        assert coordinator._drafts_to_attach(sequences) == []  # no probe due: nobody
        policy.buckets[bucket_of(3)].rounds_at_zero = 1 << 20
        assert coordinator._drafts_to_attach(sequences) == [sequences[1]]  # due: the one with 40 tokens to go
        await coordinator.wait_idle()
        await engine.close()

    asyncio.run(main())
