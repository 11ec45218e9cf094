"""Sampled speculative decoding is distributed exactly as the target's own sampling (chi-square tests).

Each test fails by chance with probability ALPHA when the implementation is right (its seeds are fixed, so a
given run is reproducible); a wrong acceptance rule or residual shifts the distribution far beyond that. The exact
marginals come from transformers' temperature / top-k / top-p warpers (sampling_reference.py), not the engine's own
filter, so a bug in that filter shows here too (test_logits_processing.py tests the filter itself).
"""

import asyncio
import random

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specsplit.kernels.rejection_sampling import rejection_sample_torch
from specsplit.services.coordinator.coordinator import CoordinatorConfig
from specsplit.services.local_engine import LocalEngine
from specsplit.services.sampling_params import SamplingParams
from sampling_reference import warped_probs
from tiny_models import build_model, perturbed_copy, save_model

ALPHA = 1e-3


def chi_square_pvalue(counts: np.ndarray, expected_probs: np.ndarray) -> float:
    """Pool cells with expected count < 5 into one, then run the chi-square goodness-of-fit test."""
    total = counts.sum()
    expected = expected_probs * total
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    assert obs[exp == 0].sum() == 0, "a token with zero probability was sampled"
    return chisquare(obs[exp > 0], exp[exp > 0] * obs.sum() / exp[exp > 0].sum()).pvalue


def seeded_runs(engine, prompt, n: int, max_tokens: int, setting: dict, seeded: bool = True) -> list:
    """`n` requests of `prompt` at once, seeds 0..n-1 (or none: the coordinator draws them), each `max_tokens` long;
    waits until the engine is idle."""

    async def main():
        reqs = [
            engine.coordinator.generate(engine.request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                                              seed=s if seeded else None, **setting)))
            for s in range(n)
        ]
        results = await asyncio.gather(*reqs)
        await engine.coordinator.wait_idle()
        return results

    return asyncio.run(main())


@pytest.mark.parametrize("support", [2, 4, 8])
def test_rejection_sampler_emits_target_distribution(support):
    gen = torch.Generator().manual_seed(support)
    vocab, k, n = 8, 2, 40000
    p = torch.softmax(torch.randn(k + 1, vocab, generator=gen) * 1.5, -1)
    q_full = torch.softmax(torch.randn(k, vocab, generator=gen) * 1.5, -1)
    q_ids = q_full.topk(support, -1).indices
    q_probs = q_full.gather(1, q_ids)
    q_probs = q_probs / q_probs.sum(-1, keepdim=True)
    # Draft tokens really drawn from the sparse q.
    pick = torch.multinomial(q_probs, n, replacement=True, generator=gen).T  # [n, k]
    drafts = q_ids.gather(1, pick.T).T.reshape(-1)
    out, accepted = rejection_sample_torch(
        target_probs=p.repeat(n, 1, 1),
        draft_token_ids=drafts.view(n, k),
        q_token_ids=q_ids.repeat(n, 1, 1),
        q_probs=q_probs.repeat(n, 1, 1),
        num_draft=torch.full((n,), k),
        accept_uniforms=torch.rand(n, k, generator=gen),
        sample_uniforms=torch.rand(n, k + 1, generator=gen),
    )
    first = out[:, 0].numpy()
    assert chi_square_pvalue(np.bincount(first, minlength=vocab), p[0].numpy()) > ALPHA
    # Given anything about position 1, position 2 is again distributed as p_2.
    second = out[accepted >= 1, 1].numpy()
    assert chi_square_pvalue(np.bincount(second, minlength=vocab), p[1].numpy()) > ALPHA
    # Acceptance rate equals sum_x min(p(x), q(x)) (Leviathan et al.), within sampling error.
    q_dense = torch.zeros(vocab).scatter(0, q_ids[0], q_probs[0])
    expected_rate = torch.minimum(p[0], q_dense).sum().item()
    assert abs((accepted >= 1).float().mean().item() - expected_rate) < 0.015


SETTINGS = [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=5),
    dict(temperature=1.3, top_p=0.8),
    dict(temperature=0.9, top_k=8, top_p=0.9),
]


@pytest.fixture(scope="module")
def small_vocab_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("v16")
    target = build_model("qwen2", seed=11, vocab_size=16, scale=0.25).to(torch.float64)
    draft = perturbed_copy(target, noise=0.15, seed=12)
    return save_model(target, root / "t", with_tokenizer=False), save_model(draft, root / "d", with_tokenizer=False), target


def exact_marginals(model, prompt, params: SamplingParams, steps: int) -> list[np.ndarray]:
    """Exact distribution of each generated position, by enumerating every prefix under the processed p."""
    def probs_after(seq_batch):
        with torch.no_grad():
            logits = model(torch.tensor(seq_batch)).logits[:, -1].double()
        return warped_probs(logits, params.temperature, params.top_k, params.top_p)

    prefixes, weights = [list(prompt)], torch.ones(1, dtype=torch.float64)
    marginals = []
    for _ in range(steps):
        probs = probs_after(prefixes) * weights[:, None]
        marginals.append(probs.sum(0).numpy())
        vocab = probs.shape[1]
        keep = probs.reshape(-1) > 1e-12
        idx = torch.nonzero(keep).squeeze(1)
        prefixes = [prefixes[i // vocab] + [i % vocab] for i in idx.tolist()]
        weights = probs.reshape(-1)[idx]
    return marginals


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_speculative_sampling_matches_target_distribution(small_vocab_pair, setting):
    target_dir, draft_dir, hf_target = small_vocab_pair
    prompt = [3, 1, 4, 1, 5]
    n = 2000
    config = CoordinatorConfig(max_num_seqs=500, max_waiting=n)
    engine = LocalEngine(target_dir, draft_dir, num_speculative_tokens=3, dtype="float64", coordinator_config=config)

    results = seeded_runs(engine, prompt, n, 3, setting)
    outputs = np.array([r.token_ids for r in results])
    assert outputs.shape == (n, 3)
    drafted = sum(r.stats.draft_tokens for r in results)
    assert drafted > 0 and 0 < sum(r.stats.accepted_tokens for r in results) < drafted
    marginals = exact_marginals(hf_target, prompt, SamplingParams(**setting), 3)
    for position in (1, 2):  # position 0 comes from the target's prefill; 1 and 2 from speculative rounds
        counts = np.bincount(outputs[:, position], minlength=16)
        assert chi_square_pvalue(counts, marginals[position]) > ALPHA, f"position {position}"
    assert engine.kv_blocks_used() == {"target": 0, "draft": 0}



PIPELINED_SETTINGS = [dict(temperature=0.5), dict(temperature=0.8, top_k=4)]


@pytest.fixture(scope="module")
def close_small_vocab_pair(tmp_path_factory):
    """A draft close enough that whole rounds, bonus guess included, are often right (the pipelined path runs)."""
    root = tmp_path_factory.mktemp("v16close")
    target = build_model("qwen2", seed=11, vocab_size=16, scale=0.25).to(torch.float64)
    draft = perturbed_copy(target, noise=0.03, seed=12)
    return save_model(target, root / "t", with_tokenizer=False), save_model(draft, root / "d", with_tokenizer=False), target


def next_token_probs(model, prefixes: list[list[int]], params: SamplingParams) -> np.ndarray:
    """The target's processed distribution after each prefix: [n, vocab]."""
    with torch.no_grad():
        logits = model(torch.tensor(prefixes)).logits[:, -1].double()
    return warped_probs(logits, params.temperature, params.top_k, params.top_p).numpy()


@pytest.mark.parametrize("setting", PIPELINED_SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_pipelined_sampling_matches_target_distribution(close_small_vocab_pair, setting):
    """Overlapped rounds (--overlap on), k = 1, 5 tokens: round 1 proposes d_1 and a bonus guess, and the draft
    proposes round 2 ahead from them; when the verdict matches (d_1 accepted, bonus = guess), round 2 verifies that
    pre-proposal and decides position 3. Positions 1-3 keep the target's exact marginals; and among the requests whose
    round 2 ran on a pre-proposal, position 3 follows the target's conditional given their prefix (the selection
    depends only on positions 1-2 and their own randomness, so the pooled expectation is the mean conditional)."""
    target_dir, draft_dir, hf_target = close_small_vocab_pair
    prompt = [3, 1, 4, 1, 5]
    n = 1500
    config = CoordinatorConfig(max_num_seqs=500, max_waiting=n, overlap="on", speculation="fixed")
    engine = LocalEngine(target_dir, draft_dir, num_speculative_tokens=1, dtype="float64", coordinator_config=config)

    results = seeded_runs(engine, prompt, n, 5, setting)
    outputs = np.array([r.token_ids for r in results])
    assert outputs.shape == (n, 5)
    params = SamplingParams(**setting)
    marginals = exact_marginals(hf_target, prompt, params, 4)
    for position in (1, 2, 3):
        counts = np.bincount(outputs[:, position], minlength=16)
        assert chi_square_pvalue(counts, marginals[position]) > ALPHA, f"position {position}"
    pipelined = [r.token_ids for r in results if r.stats.pre_proposed_rounds]
    assert len(pipelined) > n // 5, len(pipelined)  # the pipelined path ran often
    expected = next_token_probs(hf_target, [prompt + tokens[:3] for tokens in pipelined], params).mean(axis=0)
    counts = np.bincount([tokens[3] for tokens in pipelined], minlength=16)
    assert chi_square_pvalue(counts, expected) > ALPHA
    assert engine.kv_blocks_used() == {"target": 0, "draft": 0}


@pytest.mark.parametrize("setting", PIPELINED_SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_catch_up_sampling_matches_target_distribution(close_small_vocab_pair, setting):
    """Overlapped rounds with unseeded requests (whose output may depend on how rounds are cut), k = 1, 5 tokens: a
    sequence without proposals made ahead decodes one token alone while its draft catches up, guessing that token and
    proposing beyond it; when the guess is right, the next round verifies those proposals. Every position keeps the
    target's exact marginals, and the proposals drawn while catching up were verified in many rounds."""
    target_dir, draft_dir, hf_target = close_small_vocab_pair
    prompt = [3, 1, 4, 1, 5]
    n = 1500
    config = CoordinatorConfig(max_num_seqs=500, max_waiting=n, overlap="on", speculation="fixed")
    engine = LocalEngine(target_dir, draft_dir, num_speculative_tokens=1, dtype="float64", coordinator_config=config)
    engine.coordinator._rng = random.Random(7)  # the seeds it draws for unseeded requests: the same run every time

    results = seeded_runs(engine, prompt, n, 5, setting, seeded=False)
    outputs = np.array([r.token_ids for r in results])
    assert outputs.shape == (n, 5)
    marginals = exact_marginals(hf_target, prompt, SamplingParams(**setting), 4)
    for position in (1, 2, 3):
        counts = np.bincount(outputs[:, position], minlength=16)
        assert chi_square_pvalue(counts, marginals[position]) > ALPHA, f"position {position}"
    # Round 1 (after the prefill's token) always catches up; later ones verify what the draft drew meanwhile when
    # its guess came true (the request's last tokens leave no room to propose).
    assert sum(r.stats.pre_proposed_rounds for r in results) > n // 3
    assert sum(r.stats.draft_tokens for r in results) > n // 3
    assert engine.kv_blocks_used() == {"target": 0, "draft": 0}
