"""Speculation with the n-gram proposer is lossless: greedy output identical to the target alone, sampled output
distributed as the target's own sampling (chi-square against the exact marginals, as test_sampling_lossless.py).

Its q is one-hot at any temperature: the target accepts a proposal d with probability p(d) and otherwise samples
from p without d, renormalised. These runs are in-process; tests/e2e/test_ngram_proposer_e2e.py runs the same
proposer as its own draft service over gRPC.
"""

import asyncio

import numpy as np
import torch

from specsplit.services.coordinator.coordinator import CoordinatorConfig
from specsplit.services.local_engine import LocalEngine
from specsplit.services.sampling_params import SamplingParams
from test_sampling_lossless import ALPHA, chi_square_pvalue, exact_marginals
from tiny_models import build_model, byte_tokenizer, save_model

PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef add(a, b):",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "abcabcabcabc",
    "x",
]


def test_greedy_output_identical_to_target_alone(tiny_pair):
    tok = byte_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS]
    engine = LocalEngine(tiny_pair["target"], None, num_speculative_tokens=5, dtype="float64", speculation="fixed",
                         proposer="ngram", ngram_max=3, ngram_min=1)

    async def run(k):
        params = SamplingParams(max_tokens=40, ignore_eos=True, num_speculative_tokens=k)
        results = await asyncio.gather(*(engine.coordinator.generate(engine.request(i, params)) for i in ids))
        await engine.coordinator.wait_idle()
        return results

    alone, speculative = asyncio.run(run(0)), asyncio.run(run(5))
    assert [r.token_ids for r in speculative] == [r.token_ids for r in alone]
    drafted = sum(r.stats.draft_tokens for r in speculative)
    accepted = sum(r.stats.accepted_tokens for r in speculative)
    # The random-weight target repeats itself, so lookups find matches, and some of them are wrong.
    assert drafted > 0 and 0 < accepted < drafted
    rounds = sum(r.stats.rounds for r in speculative)
    assert rounds < sum(len(r.token_ids) for r in speculative)  # accepted proposals saved target rounds
    assert engine.kv_blocks_used() == {"target": 0}
    assert len(engine.proposer.sequences) == 0  # every sequence released on the proposer too


def test_sampled_output_distributed_as_the_target(tmp_path):
    target = build_model("qwen2", seed=11, vocab_size=16, scale=0.25).to(torch.float64)
    target_dir = save_model(target, tmp_path / "t", with_tokenizer=False)
    # The target's own greedy continuation of [3, 1, 4, 1, 5]: it repeats n-grams ("5 12 13", "12 13"), so the
    # lookup proposes in most rounds what the target often samples, exercising acceptance and the residual both.
    prompt = [3, 1, 4, 1, 5, 2, 11, 13, 7, 12, 13, 9, 14, 5, 12, 13, 5, 12, 13, 7, 6, 12, 13, 9, 4, 6, 7, 6, 4, 14,
              4, 6, 2, 10, 15, 5, 12]
    setting = dict(temperature=0.9, top_k=10, top_p=0.95)  # every stage of the filter, against a reference
    n, steps = 2000, 4
    config = CoordinatorConfig(max_num_seqs=500, max_waiting=n)
    engine = LocalEngine(target_dir, None, num_speculative_tokens=3, dtype="float64", coordinator_config=config,
                         proposer="ngram", ngram_max=2, ngram_min=1)

    async def main():
        requests = [engine.coordinator.generate(engine.request(
            prompt, SamplingParams(max_tokens=steps, ignore_eos=True, seed=s, num_speculative_tokens=3, **setting)))
            for s in range(n)]
        results = await asyncio.gather(*requests)
        await engine.coordinator.wait_idle()
        return results

    results = asyncio.run(main())
    outputs = np.array([r.token_ids for r in results])
    assert outputs.shape == (n, steps)
    drafted = sum(r.stats.draft_tokens for r in results)
    accepted = sum(r.stats.accepted_tokens for r in results)
    assert drafted > n and 0.1 * drafted < accepted < 0.9 * drafted, (drafted, accepted)
    marginals = exact_marginals(target, prompt, SamplingParams(**setting), steps)
    for position in range(1, steps):  # position 0 comes from the target's prefill; the rest from rounds
        counts = np.bincount(outputs[:, position], minlength=16)
        assert chi_square_pvalue(counts, marginals[position]) > ALPHA, f"position {position}"
    assert engine.kv_blocks_used() == {"target": 0}


def test_rounds_without_a_match_are_not_taken_as_the_cost_of_k(tiny_pair):
    """A round where the proposer sent fewer tokens than asked verified fewer rows: the speculation policy must not
    record its time as what k proposals cost (it would then think speculating is free). Rounds that got all they
    asked for are recorded, one cost each."""
    engine = LocalEngine(tiny_pair["target"], None, num_speculative_tokens=4, dtype="float64", speculation="fixed",
                         proposer="ngram", ngram_max=2, ngram_min=1)
    proposals = []  # (asked, got) per proposal: one per round that proposes, the request being alone
    propose = engine.proposer.propose

    def counted_propose(items):
        results = propose(items)
        proposals.extend((item.k, len(result.token_ids)) for item, result in zip(items, results))
        return results

    recorded = []  # k of every cost the policy took
    record_costs = engine.coordinator.policy.record_costs

    def counted_record_costs(batch, k, *seconds):
        recorded.append(k)
        record_costs(batch, k, *seconds)

    engine.proposer.propose = counted_propose
    engine.coordinator.policy.record_costs = counted_record_costs

    async def main():
        result = await engine.generate(PROMPTS[0], SamplingParams(max_tokens=40, ignore_eos=True))
        await engine.coordinator.wait_idle()
        return result

    result = asyncio.run(main())
    full = [asked for asked, got in proposals if got == asked]
    short = [asked for asked, got in proposals if got < asked]
    assert full and short and result.stats.draft_tokens == sum(got for _, got in proposals)  # both kinds happened
    assert [k for k in recorded if k > 0] == full  # each full round's cost, and nothing from the short ones
