"""RMSNorm with the residual add that precedes it fused in, eager torch reference.

A decoder layer is `h = h + attn(norm(h)); h = h + mlp(norm(h))`. Carrying the residual stream beside the normed
activations turns each "add, then normalise" into one pass over the row (`add_rms_norm`), which on a GPU is one
kernel instead of eight small ones. The arithmetic is transformers': the add in the activations' dtype, the norm in
float32, cast back, then scaled by the weight in the weight's dtype, so outputs match it exactly on the CPU.

    x, residual: [tokens, hidden] (residual None for the first layer: the stream starts at x)
    returns (weight * norm(x + residual), x + residual)

`ordered` (the batch-invariant mode): the sum of squares by `ordered_sum`'s fixed tree, so a row's norm does not
depend on how torch splits a reduction over the tensor; everything else is elementwise (rsqrt correctly rounded).
"""

import torch

from specsplit.kernels.invariant_reductions import ordered_sum


def add_rms_norm_torch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, ordered: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    if residual is not None:
        x = x + residual
    dtype = x.dtype
    x32 = x.to(torch.float32)
    if ordered:
        variance = (ordered_sum(x32 * x32) / x32.shape[-1])[..., None]
    else:
        variance = x32.pow(2).mean(-1, keepdim=True)
    x32 = x32 * torch.rsqrt(variance + eps)
    return weight * x32.to(dtype), x
