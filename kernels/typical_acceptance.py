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

Everything is tensor ops with shapes fixed by (num_seqs, max_k): no host reads, no loop over sequences, so it runs
inside the verification's captured CUDA graph.

Shapes (padded per sequence, as kernels/rejection_sampling.py):
    target_probs:        [num_seqs, max_k + 1, vocab] float32, rows sum to 1
    draft_token_ids:     [num_seqs, max_k] int64
    num_draft:           [num_seqs] int64 (<= max_k; the rest of a row is padding)
    sample_uniforms:     [num_seqs, max_k + 1] float32 in (0, 1), one per target row (STREAM_SAMPLE)
    posterior_threshold: float, or [num_seqs] float32 (per sequence: requests may set their own)
    posterior_alpha:     float, or [num_seqs] float32
Returns:
    output_tokens:       [num_seqs, max_k + 1] int64, emitted tokens, padded with -1
    num_accepted:        [num_seqs] int64
"""

import torch

from specsplit.kernels.invariant_reductions import ordered_sum
from specsplit.kernels.rejection_sampling import sample_from_probs_torch


def typical_bound(probs: torch.Tensor, posterior_threshold, posterior_alpha, ordered: bool = False) -> torch.Tensor:
    """min(threshold, alpha * exp(-entropy)) per row of probs [..., V] -> [...] float32 (0 log 0 counts as 0).
    Parameters are floats or tensors broadcasting against the rows (on probs' device). `ordered` (the
    batch-invariant mode): the entropy's terms summed by `ordered_sum`'s fixed tree instead of torch's sum."""
    terms = torch.special.entr(probs.float())
    entropy = ordered_sum(terms) if ordered else terms.sum(dim=-1)
    scaled = posterior_alpha * torch.exp(-entropy)
    if torch.is_tensor(posterior_threshold):
        return torch.minimum(scaled, posterior_threshold.to(scaled.dtype))
    return scaled.clamp(max=posterior_threshold)


def typical_accept_torch(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_draft: torch.Tensor,
    sample_uniforms: torch.Tensor,
    posterior_threshold,
    posterior_alpha,
    sample=sample_from_probs_torch,
    ordered: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample(probs [N, V], uniforms [N]) -> [N]`: inverse-CDF sampling (the Triton one on a GPU, same result);
    `ordered`: as in `typical_bound`."""
    num_seqs, width, _ = target_probs.shape
    max_k = width - 1
    device = target_probs.device
    seqs = torch.arange(num_seqs, device=device)
    cols = torch.arange(width, device=device)[None, :]
    if max_k:
        p_rows = target_probs[:, :max_k]
        p_of_draft = p_rows.gather(2, draft_token_ids[..., None]).squeeze(-1)
        threshold = posterior_threshold[:, None] if torch.is_tensor(posterior_threshold) else posterior_threshold
        alpha = posterior_alpha[:, None] if torch.is_tensor(posterior_alpha) else posterior_alpha
        bound = typical_bound(p_rows, threshold, alpha, ordered)
        passed = (p_of_draft > bound) & (cols[:, :max_k] < num_draft[:, None])
        # Accepted prefix: passes up to the first failure (cumprod of 0/1 stays 1 only while every test passed).
        num_accepted = passed.to(torch.int64).cumprod(dim=1).sum(dim=1)
    else:
        num_accepted = torch.zeros(num_seqs, dtype=torch.int64, device=device)
    # The token after the prefix: a sample of p at the first failed position, or the bonus row after all k.
    emitted = sample(target_probs[seqs, num_accepted], sample_uniforms[seqs, num_accepted])
    drafts = torch.cat([draft_token_ids, emitted[:, None]], dim=1)
    output = torch.where(cols < num_accepted[:, None], drafts, -1)
    output.scatter_(1, num_accepted[:, None], emitted[:, None])
    return output, num_accepted
