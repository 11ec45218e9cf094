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

Shapes (flattened over sequences; sequence b owns draft rows `cu_num_draft[b]:cu_num_draft[b+1]` and target rows
`cu_num_draft[b] + b : cu_num_draft[b+1] + b + 1`):
    target_probs:    [num_draft_total + num_seqs, vocab] float32, p at every position, rows sum to 1
    draft_token_ids: [num_draft_total] int64
    q_token_ids:     [num_draft_total, K] int64, support of q (padding entries have probability 0)
    q_probs:         [num_draft_total, K] float32
    cu_num_draft:    [num_seqs + 1] int64
    accept_uniforms: [num_draft_total] float32 in (0, 1)
    sample_uniforms: [num_draft_total + num_seqs] float32 in (0, 1), one per target row
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
    cu_num_draft: torch.Tensor,
    accept_uniforms: torch.Tensor,
    sample_uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    num_seqs = cu_num_draft.shape[0] - 1
    num_draft = (cu_num_draft[1:] - cu_num_draft[:-1]).tolist()
    max_k = max(num_draft, default=0)
    device = target_probs.device
    output = torch.full((num_seqs, max_k + 1), -1, dtype=torch.int64, device=device)
    num_accepted = torch.zeros(num_seqs, dtype=torch.int64, device=device)

    # Accept tests for every draft position at once.
    num_draft_total = draft_token_ids.shape[0]
    draft_row_seq = torch.repeat_interleave(torch.arange(num_seqs, device=device), torch.tensor(num_draft, device=device))
    target_rows_of_draft = torch.arange(num_draft_total, device=device) + draft_row_seq
    p_rows = target_probs[target_rows_of_draft]
    p_of_draft = p_rows.gather(1, draft_token_ids[:, None]).squeeze(1)
    q_of_draft = (q_probs * (q_token_ids == draft_token_ids[:, None])).sum(dim=1)
    accepted = accept_uniforms * q_of_draft < p_of_draft

    cu = cu_num_draft.tolist()
    for b in range(num_seqs):
        k = num_draft[b]
        seq_accepted = accepted[cu[b] : cu[b + 1]]
        rejected_at = torch.nonzero(~seq_accepted)
        n_acc = int(rejected_at[0, 0]) if rejected_at.numel() else k
        num_accepted[b] = n_acc
        output[b, :n_acc] = draft_token_ids[cu[b] : cu[b] + n_acc]
        target_row = cu[b] + b + n_acc
        p = target_probs[target_row]
        if n_acc < k:
            # Recovered token from the residual max(p - q, 0) at the rejected position.
            q_dense = torch.zeros_like(p)
            q_dense.scatter_add_(0, q_token_ids[cu[b] + n_acc], q_probs[cu[b] + n_acc])
            residual = (p - q_dense).clamp(min=0)
            # A rejection is possible only where p < q somewhere, so the residual has mass; guard float round-off.
            p = residual if float(residual.sum()) > 0 else p
        output[b, n_acc] = sample_from_probs_torch(p[None], sample_uniforms[target_row : target_row + 1])[0]
    return output, num_accepted
