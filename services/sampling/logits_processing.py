"""Turn logits into the distribution a request samples from: temperature, then top-k, then top-p.

Greedy rows (temperature 0) become one-hot at the argmax, which makes greedy decoding a special case of the same
rejection sampler (see kernels/rejection_sampling.py).

The sort and the cumulative sum of top-p go through kernels/dispatch.py, which fixes their order in the
batch-invariant mode; the softmax is torch's row kernel (one row per block on a GPU, per thread on the CPU: a row's
result does not depend on the others).
"""

from dataclasses import dataclass

import torch

from specsplit.kernels.dispatch import batch_invariant, cumsum_rows, sort_rows_descending


@dataclass(frozen=True)
class SamplingFlags:
    """Whether any row of a batch uses top-k, top-p or greedy: known on the host, so no GPU read-back is needed."""
    top_k: bool
    top_p: bool
    greedy: bool


def processed_probs(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
    flags: SamplingFlags | None = None,
) -> torch.Tensor:
    """logits [N, V] float32; temperature/top_p [N] float; top_k [N] int (0 = off) -> probs [N, V] float32."""
    greedy = temperature == 0
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    if flags is None:  # read the flags from the tensors (a device sync on a GPU)
        flags = SamplingFlags(
            top_k=bool(((top_k > 0) & (top_k < logits.shape[-1])).any()),
            top_p=bool((top_p < 1.0).any()),
            greedy=bool(greedy.any()),
        )
    needs_top_k, needs_top_p = flags.top_k, flags.top_p
    if needs_top_k or needs_top_p:
        scaled = _mask_top_k_top_p(scaled, top_k, top_p, needs_top_k, needs_top_p)
    probs = torch.softmax(scaled, dim=-1)
    if flags.greedy:
        one_hot = torch.zeros_like(probs)
        one_hot.scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], one_hot, probs)
    return probs


def _mask_top_k_top_p(scaled, top_k, top_p, needs_top_k, needs_top_p):
    sorted_logits, sorted_index = sort_rows_descending(scaled)
    vocab = scaled.shape[-1]
    ranks = torch.arange(vocab, device=scaled.device)[None, :]
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if needs_top_k:
        k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
        remove |= ranks >= k[:, None]
    if needs_top_p:
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
        cumulative = cumsum_rows(sorted_logits.softmax(dim=-1))
        # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass before it already does.
        mass_before = cumulative - sorted_logits.softmax(dim=-1)
        if batch_invariant():  # a row without top-p keeps every token, as when no row of its batch uses top-p
            remove |= (mass_before >= top_p[:, None]) & (top_p < 1.0)[:, None]
        else:
            remove |= mass_before >= top_p[:, None]
        remove[:, 0] = False
    mask = torch.zeros_like(remove).scatter(1, sorted_index, remove)
    return scaled.masked_fill(mask, float("-inf"))
