"""BENCHMARK ONLY: synthetic acceptance, which replaces the verifier's accept test by a coin of fixed bias alpha.

NOT LOSSLESS. Output produced in this mode is not a sample of the target model's distribution; it exists so that
models with random weights (whose draft and target never agree) show the round shapes of a trained pair with
acceptance rate alpha, as vLLM's synthetic-acceptance benchmark mode does. It is enabled only by an explicit
`synthetic_acceptance=` argument (`specsplit target --synthetic-acceptance ALPHA`), which logs a warning, and every
result measured with it must be labelled synthetic.

Overlapped rounds (coordinator/pre_proposals.py) also guess the bonus token; a random-weight draft never guesses a
real one, so when a sequence sends its guess and every proposal was accepted, a coin of the same bias at the bonus
position (the same stream: that position's coin decides nothing else) says whether the bonus is the guess: heads
emits the guess, tails the target's sample. A pre-proposal is then used with probability alpha^(k+1), as for a
trained pair whose acceptance rate, bonus guess included, is alpha. A sequence that decodes one token alone while its
draft catches up (the draft's guess of that token is drawn beside the verification) gets the same coin from the
coordinator (`synthetic_guess_right`, the alpha the target reports in Describe).

Per proposal d_i the coin is a counter-based uniform of (request seed, absolute position, its own stream): accepted
iff u < alpha. The first rejected position (or the position after the last proposal) then emits a real sample of
the target's distribution p there, so emitted tokens are still the target's samples, only the accept decision is
synthetic. Everything runs as batched tensor ops, with no host reads, inside the verification's graph.
"""

import logging

import torch

from specsplit.kernels.counter_rng import STREAM_SAMPLE, counter_uniform_scalar
from specsplit.kernels.dispatch import counter_uniform, sample_from_probs

STREAM_SYNTHETIC = 3  # the counter RNG's fourth stream (draft=0, accept=1, sample=2)

log = logging.getLogger(__name__)


def synthetic_guess_right(alpha: float, seed: int, position: int) -> bool:
    """The coin for a guess of a token the target decoded alone (an overlapped round's catch-up: the guess was
    drawn beside the verification, so the verifier could not see it): heads with probability alpha, at that
    position's synthetic stream, which decides nothing else there (no proposal was verified at it)."""
    return counter_uniform_scalar(seed, position, STREAM_SYNTHETIC) < alpha


def check_alpha(alpha: float) -> float:
    alpha = float(alpha)
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"synthetic acceptance rate must be in [0, 1], got {alpha}")
    return alpha


def warn_enabled(alpha: float, where: str) -> None:
    log.warning(
        "!!! SYNTHETIC ACCEPTANCE %.3f ENABLED in %s: proposals are accepted by a biased coin, NOT by the lossless "
        "test. Outputs do NOT follow the target model. For benchmarks only; never serve with this. !!!", alpha, where,
    )


def synthetic_accept(
    alpha: float,
    logits: torch.Tensor,
    probs: torch.Tensor | None,
    proposals: torch.Tensor,
    num_draft: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    guesses: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The verifier's decision with a coin (same layout as kernels/rejection_sampling.py, padded per sequence).

    logits [n, k+1, V]; probs: the processed distributions there, or None for greedy rows (emit the argmax);
    proposals [n, k]; num_draft [n]; seeds and positions [n, k+1] (position of each target row's decision);
    guesses [n]: each sequence's bonus guess, -1 for none (None: no sequence guessed).
    Returns (output_tokens [n, k+1] padded with -1, num_accepted [n]). No host reads: runs inside a graph.
    """
    num_seqs, width, _ = logits.shape
    k = width - 1
    device = logits.device
    seqs = torch.arange(num_seqs, device=device)
    columns = torch.arange(width, device=device)[None, :]
    if k:
        heads = counter_uniform(seeds[:, :k], positions[:, :k], STREAM_SYNTHETIC) < alpha
        heads &= columns[:, :k] < num_draft[:, None]  # padding positions count as rejected
        num_accepted = heads.to(torch.int64).cumprod(dim=1).sum(dim=1)
    else:
        num_accepted = torch.zeros(num_seqs, dtype=torch.int64, device=device)
    # The emitted token after the accepted prefix: a real sample of p at that row (the argmax when greedy).
    if probs is None:
        emitted = logits[seqs, num_accepted].argmax(dim=-1)
    else:
        uniforms = counter_uniform(seeds[seqs, num_accepted], positions[seqs, num_accepted], STREAM_SAMPLE)
        emitted = sample_from_probs(probs[seqs, num_accepted], uniforms)
    if guesses is not None:  # every proposal accepted and a guess sent: a coin says whether the bonus is the guess
        at = seqs, num_accepted
        right = counter_uniform(seeds[at], positions[at], STREAM_SYNTHETIC) < alpha
        right &= (num_accepted == num_draft) & (num_draft > 0) & (guesses >= 0)
        emitted = torch.where(right, guesses, emitted)
    output = torch.where(columns < num_accepted[:, None], torch.cat([proposals, emitted[:, None]], dim=1), -1)
    output.scatter_(1, num_accepted[:, None], emitted[:, None])
    return output, num_accepted
