"""Lossless speculative verification with a sparse draft distribution, eager torch reference.

Terms, per sequence with `k` draft tokens d_1..d_k:
- accepted tokens: the longest prefix where each d_i passed its test `u_i * q_i(d_i) < p_i(d_i)`, i.e. was kept with
  probability min(1, p_i(d_i) / q_i(d_i)).
- recovered token: at the first rejected position i, a sample from norm(max(p_i - q_i, 0)).
- bonus token: when all k are accepted, a sample from p_{k+1}.
So every sequence emits `accepted + 1` tokens. This is exactly distributed as sampling from p alone, for any draft
distribution q, provided q is the distribution d_i was really drawn from (Leviathan et al. 2023, Chen et al. 2023).

Greedy needs no special case: a greedy target row is one-hot at its argmax and a greedy draft's q is one-hot at its
token, so the test accepts iff d_i is the argmax and the residual is that argmax.

Shapes (padded per sequence, so every shape is fixed by (num_seqs, max_k) and a call can be captured in a graph;
sequence b proposed num_draft[b] <= max_k tokens, the rest of its row is padding):
    target_probs:    [num_seqs, max_k + 1, vocab] float32, p at every position, rows sum to 1
    draft_token_ids: [num_seqs, max_k] int64
    q_token_ids:     [num_seqs, max_k, K] int64, support of q (padding entries have probability 0)
    q_probs:         [num_seqs, max_k, K] float32
    num_draft:       [num_seqs] int64
    accept_uniforms: [num_seqs, max_k] float32 in (0, 1)
    sample_uniforms: [num_seqs, max_k + 1] float32 in (0, 1), one per target row
Returns:
    output_tokens:   [num_seqs, max_k + 1] int64, emitted tokens, padded with -1
    num_accepted:    [num_seqs] int64
"""

import torch


def sample_from_probs_torch(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: the first index whose cumulative mass reaches u * total. [N, V], [N] -> [N] int64."""
    cdf = probs.to(torch.float64).cumsum(dim=-1)
    threshold = uniforms.to(torch.float64) * cdf[:, -1]
    index = torch.searchsorted(cdf, threshold[:, None], right=False).squeeze(-1)
    return index.clamp(max=probs.shape[-1] - 1)


def rejection_sample_torch(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    q_token_ids: torch.Tensor,
    q_probs: torch.Tensor,
    num_draft: torch.Tensor,
    accept_uniforms: torch.Tensor,
    sample_uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched tensor ops only (no host reads), so this runs inside a graph as well as the Triton kernel does."""
    num_seqs, width, vocab = target_probs.shape
    max_k = width - 1
    device = target_probs.device
    seqs = torch.arange(num_seqs, device=device)
    positions = torch.arange(width, device=device)
    if max_k:
        # Accept tests for every draft position at once; padding positions count as rejected.
        p_of_draft = target_probs[:, :max_k].gather(2, draft_token_ids[..., None]).squeeze(-1)
        q_of_draft = (q_probs * (q_token_ids == draft_token_ids[..., None])).sum(-1)
        accepted = (accept_uniforms * q_of_draft < p_of_draft) & (positions[None, :max_k] < num_draft[:, None])
        num_accepted = accepted.to(torch.int64).cumprod(dim=1).sum(dim=1)
    else:
        num_accepted = torch.zeros(num_seqs, dtype=torch.int64, device=device)
    p = target_probs[seqs, num_accepted]  # [num_seqs, vocab]: the row that decides the emitted token
    if max_k:
        # Recovered token from the residual max(p - q, 0) at the rejected position.
        recover = num_accepted < num_draft
        at = num_accepted.clamp(max=max_k - 1)
        q_dense = torch.zeros_like(p).scatter_add_(1, q_token_ids[seqs, at], q_probs[seqs, at] * recover[:, None])
        residual = (p - q_dense).clamp(min=0)
        # A rejection is possible only where p < q somewhere, so the residual has mass; guard float round-off.
        use_residual = recover & (residual.sum(dim=1) > 0)
        p = torch.where(use_residual[:, None], residual, p)
    emitted = sample_from_probs_torch(p, sample_uniforms[seqs, num_accepted])
    output = torch.full((num_seqs, width), -1, dtype=torch.int64, device=device)
    if max_k:
        output[:, :max_k] = torch.where(positions[None, :max_k] < num_accepted[:, None], draft_token_ids, -1)
    output.scatter_(1, num_accepted[:, None], emitted[:, None])
    return output, num_accepted
