"""BENCHMARK ONLY: synthetic acceptance, which replaces the verifier's accept test by a coin of fixed bias alpha.

NOT LOSSLESS. Output produced in this mode is not a sample of the target model's distribution; it exists so that
models with random weights (whose draft and target never agree) show the round shapes of a trained pair with
acceptance rate alpha, as vLLM's synthetic-acceptance benchmark mode does. It is enabled only by an explicit
`synthetic_acceptance=` argument (`specsplit target --synthetic-acceptance ALPHA`), which logs a warning, and every
result measured with it must be labelled synthetic.

Per proposal d_i the coin is a counter-based uniform of (request seed, absolute position, its own stream): accepted
iff u < alpha. The first rejected position (or the position after the last proposal) then emits a real sample of
the target's distribution p there, so emitted tokens are still the target's samples, only the accept decision is
synthetic. Everything runs as batched tensor ops, with no per-sequence host loop.
"""

import logging

import torch

from specsplit.kernels.dispatch import counter_uniform, sample_from_probs

STREAM_SYNTHETIC = 3  # the counter RNG's fourth stream (draft=0, accept=1, sample=2)

log = logging.getLogger(__name__)


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
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_draft: list[int],
    draft_seeds: torch.Tensor,
    draft_positions: torch.Tensor,
    sample_uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same inputs and outputs as the rejection sampler (see kernels/rejection_sampling.py), but with a coin.

    num_draft: per sequence, on the host. draft_seeds/draft_positions: [num_draft_total], the seed and absolute
    position of each proposal. Returns (output_tokens [num_seqs, max_k + 1] padded with -1, num_accepted [num_seqs]).
    """
    device = target_probs.device
    num_seqs, max_k = len(num_draft), max(num_draft, default=0)
    k = torch.tensor(num_draft, dtype=torch.int64).to(device, non_blocking=True)
    # Draft rows into a [num_seqs, max_k] grid; padding counts as rejected.
    seq_of_row = torch.repeat_interleave(torch.arange(num_seqs, device=device), k, output_size=sum(num_draft))
    starts = torch.cumsum(k, 0) - k
    col_of_row = torch.arange(sum(num_draft), device=device) - starts[seq_of_row]
    coins = torch.zeros(num_seqs, max_k, dtype=torch.bool, device=device)
    drafts = torch.full((num_seqs, max_k + 1), -1, dtype=torch.int64, device=device)
    if sum(num_draft):
        heads = counter_uniform(draft_seeds, draft_positions, STREAM_SYNTHETIC) < alpha
        coins[seq_of_row, col_of_row] = heads
        drafts[seq_of_row, col_of_row] = draft_token_ids
    num_accepted = coins.to(torch.int64).cumprod(dim=1).sum(dim=1) if max_k else torch.zeros(num_seqs, dtype=torch.int64, device=device)
    # The emitted token after the accepted prefix: a real sample of p at that row.
    target_row = starts + torch.arange(num_seqs, device=device) + num_accepted
    emitted = sample_from_probs(target_probs[target_row], sample_uniforms[target_row])
    cols = torch.arange(max_k + 1, device=device)[None, :]
    output = torch.where(cols < num_accepted[:, None], drafts, torch.full_like(drafts, -1))
    output.scatter_(1, num_accepted[:, None], emitted[:, None])
    return output, num_accepted
