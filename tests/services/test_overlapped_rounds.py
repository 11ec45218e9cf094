"""Overlapped rounds in one process (`overlap="on"` runs the pipelined logic even where it cannot gain time):
greedy output identical to target alone and to serial rounds (its sequences catch up: a token decoded alone while
the draft runs ahead), seeded sampled output identical with and without overlap (its sequences propose first, the
rounds cut as serial rounds cut them), pre-proposals actually used, no KV left behind; the synthetic mode's
bonus-guess coins, the verifier's and the coordinator's."""

import asyncio

import pytest
import torch

from specsplit.services.local_engine import LocalEngine
from specsplit.services.sampling_params import SamplingParams
from specsplit.services.target.synthetic_acceptance import synthetic_accept

PROMPTS = [[1, 2, 3], [7, 7, 7, 7], [40, 41], [100, 3, 9, 12, 5]]


def run_all(engine, params_for):
    async def main():
        results = await asyncio.gather(*(engine.generate(p, params_for(i)) for i, p in enumerate(PROMPTS)))
        await engine.coordinator.wait_idle()
        return results

    return asyncio.run(main())


@pytest.fixture(scope="module")
def engines(tiny_pair):
    made = {}
    for mode in ("on", "off"):
        made[mode] = LocalEngine(tiny_pair["target"], tiny_pair["close"], num_speculative_tokens=4, dtype="float64",
                                 speculation="fixed", overlap=mode)
    made["alone"] = LocalEngine(tiny_pair["target"], None, num_speculative_tokens=0, dtype="float64")
    return made


def test_greedy_identical_with_and_without_overlap(engines):
    params = lambda i: SamplingParams(max_tokens=32, ignore_eos=True)  # noqa: E731
    alone = [r.token_ids for r in run_all(engines["alone"], params)]
    off = run_all(engines["off"], params)
    on = run_all(engines["on"], params)
    assert [r.token_ids for r in off] == alone
    assert [r.token_ids for r in on] == alone
    assert sum(r.stats.pre_proposed_rounds for r in off) == 0
    # The close draft is accepted most of the time: many rounds took the proposals made ahead.
    assert sum(r.stats.pre_proposed_rounds for r in on) > 2
    # Greedy sequences never wait for the draft: a miss is a round that decodes one token alone, so more rounds.
    assert sum(r.stats.rounds for r in on) > sum(r.stats.rounds for r in off)
    assert engines["on"].kv_blocks_used() == {"target": 0, "draft": 0}


@pytest.mark.parametrize("setting", [dict(temperature=0.3), dict(temperature=0.6, top_k=5, top_p=0.9)])
def test_seeded_sampling_identical_with_and_without_overlap(engines, setting):
    params = lambda i: SamplingParams(max_tokens=32, ignore_eos=True, seed=1000 + i, **setting)  # noqa: E731
    off = run_all(engines["off"], params)
    on = run_all(engines["on"], params)
    assert [r.token_ids for r in on] == [r.token_ids for r in off]
    assert sum(r.stats.pre_proposed_rounds for r in on) > 0
    # Seeded sequences propose first when they missed: their rounds are cut exactly as serial rounds cut them.
    assert [(r.stats.rounds, r.stats.draft_tokens) for r in on] == [(r.stats.rounds, r.stats.draft_tokens) for r in off]
    assert engines["on"].kv_blocks_used() == {"target": 0, "draft": 0}


def test_limits_near_the_end_and_short_requests(engines):
    # max_tokens smaller than k + 2: proposals ahead must respect the request's length.
    for max_tokens in (1, 2, 3, 5, 6, 7):
        params = lambda i: SamplingParams(max_tokens=max_tokens, ignore_eos=True)  # noqa: E731
        on = run_all(engines["on"], params)
        off = run_all(engines["off"], params)
        assert [r.token_ids for r in on] == [r.token_ids for r in off]
        assert all(len(r.token_ids) == max_tokens for r in on)
    assert engines["on"].kv_blocks_used() == {"target": 0, "draft": 0}


def test_auto_does_not_overlap_in_process(tiny_pair):
    engine = LocalEngine(tiny_pair["target"], tiny_pair["close"], num_speculative_tokens=4, dtype="float64",
                         speculation="fixed")  # overlap defaults to auto
    results = run_all(engine, lambda i: SamplingParams(max_tokens=16, ignore_eos=True))
    assert sum(r.stats.pre_proposed_rounds for r in results) == 0


@pytest.mark.parametrize("alpha", [0.5, 0.9])
def test_synthetic_bonus_guess_is_right_with_probability_alpha(alpha):
    num_seqs, k, vocab = 4000, 3, 50
    logits = torch.randn(num_seqs, k + 1, vocab)
    drafts = torch.randint(0, vocab, (num_seqs, k))
    guesses = (logits[:, k].argmax(-1) + 1) % vocab  # never the target's own choice
    seeds = torch.arange(num_seqs)[:, None].expand(num_seqs, k + 1)
    positions = torch.arange(k + 1).repeat(num_seqs, 1) + 5
    output, accepted = synthetic_accept(alpha, logits, None, drafts, torch.full((num_seqs,), k), seeds, positions,
                                        guesses)
    all_in = accepted == k
    matched = (output[:, k] == guesses) & all_in
    rate = matched.sum().item() / all_in.sum().item()
    assert abs(rate - alpha) < 0.05, rate
    # The accept coins are unchanged by the guess, and no guess is used where a proposal was rejected.
    _, accepted_without = synthetic_accept(alpha, logits, None, drafts, torch.full((num_seqs,), k), seeds, positions)
    assert torch.equal(accepted, accepted_without)
    rejected = ~all_in
    assert torch.equal(output[rejected].gather(1, accepted[rejected][:, None]).squeeze(1),
                       logits[rejected].argmax(-1).gather(1, accepted[rejected][:, None]).squeeze(1))
    # Unguessed rows (-1) get the target's token.
    none = torch.full((num_seqs,), -1)
    output_none, _ = synthetic_accept(alpha, logits, None, drafts, torch.full((num_seqs,), k), seeds, positions, none)
    assert not ((output_none[:, k] == guesses) & all_in).any()


@pytest.mark.parametrize("alpha", [0.5, 0.9])
def test_synthetic_coin_for_a_token_decoded_alone(alpha):
    """The coordinator's coin for a catch-up's guess: heads with probability alpha, a function of (seed, position)."""
    from specsplit.services.target.synthetic_acceptance import synthetic_guess_right

    flips = [synthetic_guess_right(alpha, seed, 17) for seed in range(4000)]
    assert abs(sum(flips) / len(flips) - alpha) < 0.03
    assert flips == [synthetic_guess_right(alpha, seed, 17) for seed in range(4000)]
    assert [synthetic_guess_right(alpha, 5, p) for p in range(200)] != [synthetic_guess_right(alpha, 6, p)
                                                                       for p in range(200)]


@pytest.mark.parametrize("alpha", [0.0, 0.9])
def test_synthetic_catch_up_guesses_come_true_at_alpha(tiny_pair, alpha):
    """Synthetic acceptance (NOT lossless) with a draft that never guesses right for real: only the coordinator's
    coin makes a catch-up's guess come true, so the rounds that verify proposals made ahead are the coin's share,
    about g / (g + 1 - a^k g) of rounds (0.69 at alpha 0.9, k = 4), and almost none at alpha 0."""
    engine = LocalEngine(tiny_pair["target"], tiny_pair["unrelated"], num_speculative_tokens=4, dtype="float64",
                         speculation="fixed", overlap="on", synthetic_acceptance=alpha)
    results = run_all(engine, lambda i: SamplingParams(max_tokens=48, ignore_eos=True))
    rounds = sum(r.stats.rounds for r in results)
    share = sum(r.stats.pre_proposed_rounds for r in results) / rounds
    if alpha == 0.0:
        assert share < 0.05  # only where the unrelated draft's guess is the target's token for real
    else:
        assert 0.5 < share < 0.85, share
    assert engine.kv_blocks_used() == {"target": 0, "draft": 0}


def test_a_phase_is_measured_only_when_every_draft_call_ahead_ran_in_full(tiny_pair):
    """`auto` compares the least of the last few measured phases: a round near a request's end, whose draft call
    ahead shrinks or is skipped, must not be one of them (it made overlap look cheaper than it is)."""
    engine = LocalEngine(tiny_pair["target"], tiny_pair["close"], num_speculative_tokens=4, dtype="float64",
                         speculation="fixed", overlap="on")
    coordinator = engine.coordinator
    lengths, measured = [], []
    ahead_length, round_, record_phase = coordinator._ahead_length, coordinator._round, coordinator.overlap.record_phase

    def tracked_ahead_length(sequence, batch, k, ahead):
        n = ahead_length(sequence, batch, k, ahead)
        lengths.append((k, n))
        return n

    async def tracked_round(sequences):
        lengths.clear()
        await round_(sequences)

    def tracked_record_phase(batch, k, phase_seconds, ahead_seconds):
        measured.append(all(n > k_of for k_of, n in lengths))
        record_phase(batch, k, phase_seconds, ahead_seconds)

    coordinator._ahead_length, coordinator._round = tracked_ahead_length, tracked_round
    coordinator.overlap.record_phase = tracked_record_phase
    for max_tokens in (7, 9, 20):  # rounds whose calls ahead are cut by the request's end, and full ones
        run_all(engine, lambda i: SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    assert measured and all(measured)
