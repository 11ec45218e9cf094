"""The benchmark-only synthetic acceptance mode: a coin of bias alpha decides, real samples of p are emitted."""

import asyncio
import logging

import pytest
import torch

from specsplit.services.local_engine import LocalEngine
from specsplit.services.sampling_params import SamplingParams
from specsplit.services.target.synthetic_acceptance import check_alpha, synthetic_accept


def expected_accepted(alpha: float, k: int) -> float:
    """Mean accepted prefix length when each of k proposals passes an independent coin of bias alpha."""
    return sum(alpha**i for i in range(1, k + 1))


@pytest.mark.parametrize("alpha", [0.0, 0.5, 0.7, 0.9, 1.0])
def test_accepted_prefix_follows_the_coin(alpha):
    torch.manual_seed(int(alpha * 10))
    num_seqs, k, vocab = 2000, 4, 50
    # One-hot target rows, each at a random token, so the emitted token tells which row it was sampled from.
    row_token = torch.randint(0, vocab, (num_seqs, k + 1))
    probs = torch.nn.functional.one_hot(row_token, vocab).float()
    drafts = torch.randint(0, vocab, (num_seqs, k))
    seeds = torch.randint(0, 2**62, (num_seqs, 1)).expand(num_seqs, k + 1)
    positions = torch.arange(k + 1).repeat(num_seqs, 1) + 10
    output, num_accepted = synthetic_accept(alpha, probs.log(), probs, drafts, torch.full((num_seqs,), k), seeds,
                                            positions)

    mean = num_accepted.float().mean().item()
    # Standard error of the mean prefix length is under 1.6/sqrt(2000) ~ 0.036: allow 4 of them.
    assert abs(mean - expected_accepted(alpha, k)) < 0.15, (alpha, mean)
    for b in range(0, num_seqs, 97):
        n = int(num_accepted[b])
        assert output[b, :n].tolist() == drafts[b, :n].tolist()
        assert int(output[b, n]) == int(row_token[b, n])  # a sample of p at the row after the prefix
        assert (output[b, n + 1 :] == -1).all()


def test_mixed_proposal_counts_and_no_proposals():
    num_draft = torch.tensor([0, 3, 1, 0, 5])
    vocab, k = 20, 5
    logits = torch.randn(5, k + 1, vocab)
    drafts = torch.randint(0, vocab, (5, k))
    seeds = torch.full((5, k + 1), 7, dtype=torch.int64)
    positions = torch.arange(k + 1).repeat(5, 1)
    output, num_accepted = synthetic_accept(1.0, logits, None, drafts, num_draft, seeds, positions)
    assert num_accepted.tolist() == num_draft.tolist()  # alpha = 1 accepts every real proposal, no padding
    assert output.shape == (5, 6)
    assert output[1, :3].tolist() == drafts[1, :3].tolist() and output[4, :5].tolist() == drafts[4].tolist()
    # Greedy rows (no probs): the emitted token is the argmax of the row after the prefix.
    assert [int(output[b, n]) for b, n in enumerate(num_draft.tolist())] == \
        [int(logits[b, n].argmax()) for b, n in enumerate(num_draft.tolist())]


def test_alpha_must_be_a_probability():
    with pytest.raises(ValueError):
        check_alpha(1.5)


def test_engine_acceptance_rate_is_alpha_and_warns(tiny_pair, caplog):
    alpha, k = 0.7, 4
    with caplog.at_level(logging.WARNING):
        # The unrelated draft is almost never accepted by the real test; the synthetic coin overrides that.
        engine = LocalEngine(tiny_pair["target"], tiny_pair["unrelated"], num_speculative_tokens=k,
                             synthetic_acceptance=alpha)
    assert "SYNTHETIC ACCEPTANCE" in caplog.text

    async def main():
        params = [SamplingParams(max_tokens=40, ignore_eos=True, temperature=1.0, seed=s) for s in range(8)]
        results = await asyncio.gather(*(engine.generate([1 + s, 2, 3], p) for s, p in enumerate(params)))
        await engine.coordinator.wait_idle()
        return results

    results = asyncio.run(main())
    drafted = sum(r.stats.draft_tokens for r in results)
    accepted = sum(r.stats.accepted_tokens for r in results)
    assert all(len(r.token_ids) == 40 for r in results)
    # accepted/drafted = E[prefix]/k for full rounds (0.554 at alpha 0.7, k 4); rounds cut short near max_tokens
    # shift it a little.
    assert abs(accepted / drafted - expected_accepted(alpha, k) / k) < 0.12, accepted / drafted
