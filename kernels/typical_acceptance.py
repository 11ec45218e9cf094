"""Typical acceptance (Medusa, Cai et al. 2024, section 3.3.1), batched torch: NOT LOSSLESS, opt-in only.

A proposal d_i is accepted when the target finds it typical enough:

    p_i(d_i) > min(posterior_threshold, posterior_alpha * exp(-H(p_i))),   H(p) = -sum_v p(v) log p(v)

i.e. a fixed probability floor, lowered where the target itself is unsure (high entropy). The draft's q plays no
part, so unlike rejection sampling (kernels/rejection_sampling.py) the output is NOT distributed as the target's:
tokens the target finds likely are kept more often than the target would sample them. It raises acceptance at
higher temperatures, which is why it exists; it must be asked for and labelled wherever it is used.

Per sequence, the accepted prefix ends at the first proposal that fails. The token emitted after it:
- on a failure at position i: a sample from p_i, drawn with the SAMPLE-stream uniform of that absolute position.
  That is the very token target-only decoding would draw there (same p, same counter uniform), so a position the
  draft could not fill is decoded exactly as the target alone would. (vLLM's sampler emits the target's own sample
  there too; its first version, like Medusa's paper, took the argmax, which would make a rejected position greedy
  whatever the request's temperature.) The sample may equal the failed d_i: it is a fresh draw from p_i.
- when all k are accepted: the bonus token, a sample from p_{k+1} the same way.

Greedy rows are one-hot at the argmax: H = 0, the bound is min(threshold, alpha) < 1 and p(d) is 1 or 0, so d is
accepted iff it is the argmax and the emitted token is the argmax: exactly rejection sampling's greedy behaviour.
A token the target's top-k/top-p removed has p = 0 and is never accepted (the bound is >= 0 and the test strict).

Everything is tensor ops with shapes fixed by (num_draft_total, num_seqs, max_num_draft): no host reads, no loop
over sequences, so it can run inside a captured CUDA graph.

Shapes (as kernels/rejection_sampling.py: sequence b owns draft rows `cu_num_draft[b]:cu_num_draft[b+1]` and target
rows `cu_num_draft[b] + b : cu_num_draft[b+1] + b + 1`):
    target_probs:        [num_draft_total + num_seqs, vocab] float32, rows sum to 1
    draft_token_ids:     [num_draft_total] int64
    cu_num_draft:        [num_seqs + 1] int64
    sample_uniforms:     [num_draft_total + num_seqs] float32 in (0, 1), one per target row (STREAM_SAMPLE)
    posterior_threshold: float, or [num_draft_total] float32 (per proposal: requests may set their own)
    posterior_alpha:     float, or [num_draft_total] float32
    max_num_draft:       the largest k in the batch, known on the host (fixes the output's shape)
Returns:
    output_tokens:       [num_seqs, max_num_draft + 1] int64, emitted tokens, padded with -1
    num_accepted:        [num_seqs] int64
"""

import torch

from specsplit.kernels.rejection_sampling import sample_from_probs_torch


def typical_bound(probs: torch.Tensor, posterior_threshold, posterior_alpha) -> torch.Tensor:
    """min(threshold, alpha * exp(-entropy)) per row of probs [N, V] -> [N] float32 (0 log 0 counts as 0).
    Parameters are floats or [N] tensors on probs' device (floats become kernel arguments, never copies)."""
    entropy = torch.special.entr(probs.float()).sum(dim=-1)
    scaled = posterior_alpha * torch.exp(-entropy)
    if torch.is_tensor(posterior_threshold):
        return torch.minimum(scaled, posterior_threshold.to(scaled.dtype))
    return scaled.clamp(max=posterior_threshold)


def typical_accept_torch(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    cu_num_draft: torch.Tensor,
    sample_uniforms: torch.Tensor,
    posterior_threshold,
    posterior_alpha,
    max_num_draft: int,
    sample=sample_from_probs_torch,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample(probs [N, V], uniforms [N]) -> [N]`: inverse-CDF sampling (the Triton one on a GPU, same result)."""
    device = target_probs.device
    num_seqs = cu_num_draft.shape[0] - 1
    num_draft_total = draft_token_ids.shape[0]
    num_draft = cu_num_draft[1:] - cu_num_draft[:-1]
    seq_index = torch.arange(num_seqs, device=device)

    # Each draft row's sequence and column in a [num_seqs, max_num_draft] grid; grid padding counts as a failure.
    seq_of_row = torch.repeat_interleave(seq_index, num_draft, output_size=num_draft_total)
    col_of_row = torch.arange(num_draft_total, device=device) - cu_num_draft[:-1][seq_of_row]
    p_rows = target_probs[torch.arange(num_draft_total, device=device) + seq_of_row]
    p_of_draft = p_rows.gather(1, draft_token_ids[:, None]).squeeze(1)
    passed = p_of_draft > typical_bound(p_rows, posterior_threshold, posterior_alpha)

    grid_passed = torch.zeros(num_seqs, max_num_draft, dtype=torch.bool, device=device)
    grid_drafts = torch.full((num_seqs, max_num_draft + 1), -1, dtype=torch.int64, device=device)
    grid_passed[seq_of_row, col_of_row] = passed
    grid_drafts[seq_of_row, col_of_row] = draft_token_ids
    # Accepted prefix: passes up to the first failure (cumprod of 0/1 stays 1 only while every test passed).
    num_accepted = grid_passed.to(torch.int64).cumprod(dim=1).sum(dim=1)

    # The token after the prefix: a sample of p at the first failed position, or the bonus row after all k.
    emit_row = cu_num_draft[:-1] + seq_index + num_accepted
    emitted = sample(target_probs[emit_row], sample_uniforms[emit_row])
    cols = torch.arange(max_num_draft + 1, device=device)[None, :]
    output = torch.where(cols < num_accepted[:, None], grid_drafts, torch.full_like(grid_drafts, -1))
    output.scatter_(1, num_accepted[:, None], emitted[:, None])
    return output, num_accepted
