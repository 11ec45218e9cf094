"""All-reduce fused with the residual add and RMSNorm that follow it, eager torch reference.

In a tensor-parallel decoder every row-parallel layer (o_proj, down_proj) ends in an all-reduce of its partial
sums, and the next thing the model does with the sum is the residual add + RMSNorm of the next sub-layer
(kernels/rms_norm.py). The fused kernel (all_reduce_rms_norm_triton.py) does all three in one launch: each rank
reads every rank's partial row over NVLink, sums them in rank order (so every rank gets the same bits), adds the
residual and normalises. This reference takes the ranks' partials as a list and does the same arithmetic: the sum
in the activations' dtype, rank 0 first (as one-shot all-reduces and NCCL's two-rank ring round it), then
add_rms_norm_torch.

    partials: world_size tensors [tokens, hidden]; residual [tokens, hidden] or None
    returns (weight * norm(sum + residual), sum + residual)
"""

import torch

from specsplit.kernels.rms_norm import add_rms_norm_torch


def all_reduce_add_rms_norm_torch(
    partials: list[torch.Tensor], residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    total = partials[0]
    for partial in partials[1:]:
        total = total + partial
    return add_rms_norm_torch(total, residual, weight, eps)
