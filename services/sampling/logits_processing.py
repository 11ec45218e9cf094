"""Turn logits into the distribution a request samples from: temperature, then top-k, then top-p.

The filters keep ties, so what survives depends only on the values, never on how a sort orders equal ones (bf16
logits tie often):
- top-k keeps every token whose scaled logit is >= the k-th largest (as transformers' TopKLogitsWarper and vLLM);
- top-p, applied to what top-k kept, takes the tokens from the most likely down while the mass of those before a
  token is below top_p (transformers' TopPLogitsWarper: the smallest prefix whose mass reaches top_p), then keeps
  every token tied with the least likely of them. transformers keeps only the tied tokens its sort happens to put
  first; without ties at the cut the two agree. top_p >= 1 keeps everything.
Both become one threshold per row, so the filter is fixed-shape tensor work (no read-back, CUDA-graph safe).

Greedy rows (temperature 0) become one-hot at the argmax, which makes greedy decoding a special case of the same
rejection sampler (see kernels/rejection_sampling.py).

The cumulative sum of top-p goes through kernels/dispatch.py, which fixes its order in the batch-invariant mode. The
sort needs no such care: only its values are read, and those do not depend on how it orders equal ones. The softmax
is torch's row kernel (one row per block on a GPU, per thread on the CPU: a row's result does not depend on the
others).
"""

from dataclasses import dataclass

import torch

from specsplit.kernels.dispatch import cumsum_rows


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
        scaled = scaled.masked_fill(scaled < _kept_threshold(scaled, top_k, top_p, needs_top_k, needs_top_p),
                                    float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if flags.greedy:
        one_hot = torch.zeros_like(probs)
        one_hot.scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], one_hot, probs)
    return probs


def _kept_threshold(scaled, top_k, top_p, needs_top_k, needs_top_p) -> torch.Tensor:
    """The smallest scaled logit each row keeps: [N, 1]. Tokens at or above it survive both filters."""
    sorted_logits = scaled.sort(dim=-1, descending=True).values
    vocab = scaled.shape[-1]
    threshold = torch.full_like(sorted_logits[:, :1], float("-inf"))
    if needs_top_k:
        k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
        threshold = sorted_logits.gather(1, (k - 1)[:, None])
        sorted_logits = sorted_logits.masked_fill(sorted_logits < threshold, float("-inf"))
    if needs_top_p:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = cumsum_rows(probs) - probs
        kept = (mass_before < top_p[:, None]) | (top_p >= 1.0)[:, None]
        kept[:, 0] = True
        # Sorted descending, the last kept position holds the row's smallest kept logit.
        threshold = torch.maximum(threshold, sorted_logits.masked_fill(~kept, float("inf")).amin(dim=-1, keepdim=True))
    return threshold
