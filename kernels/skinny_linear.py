"""A matmul of few rows with its neighbours fused in, eager torch reference: what a decode step's layer does around
its projections, as one function per fusion.

A draft decode step multiplies one row (a few at batch > 1) by each weight. That is a matrix-vector product, bound by
reading the weight, and for a small model each projection reads only a few MB: the step's time goes to launching
and draining many short kernels (eleven per layer of 1.5-8 us on an H100, where the 0.5B's weights stream in 0.35 ms a
step). The Triton version (kernels/skinny_linear_triton.py) computes each of these in one kernel:

- `norm_linear`: (linear(weight * rmsnorm(x + residual)), x + residual): the previous sub-layer's residual add and
  this one's RMSNorm in the matmul's prologue (q/k/v and gate/up read normed rows);
- `linear_silu_mul`: SiLU(gate) * up of the fused gate/up projection in its epilogue;
- `skinny_linear`: the plain product (o_proj, down_proj), one kernel with no split-K reduction after it;
- `norm_qkv_rotary`: `norm_linear` of the fused q/k/v projection with rotary_kv's step in the epilogue: q leaves
  rotated, k (rotated) and v go straight into their cache slots, so a layer's one-row step needs no rotary kernel.

The arithmetic is the unfused path's (the residual add rounded as torch rounds it, the product summed in float32 and
rounded once with its bias, silu_mul_torch's roundings) but for the norm: the fused kernel scales the finished sums
by 1/rms instead of rounding the normed row to 16 bits before the matmul (skinny_linear_triton.py says why).

    x, residual: [rows, K]; norm_weight: [K]; weight: [N, K]; bias: [N] or None
"""

import torch
import torch.nn.functional as F

from specsplit.kernels.rms_norm import add_rms_norm_torch
from specsplit.kernels.rotary_kv import rotary_kv_torch
from specsplit.kernels.silu_mul import silu_mul_torch

SKINNY_MAX_ROWS = 8  # the most rows the Triton kernel takes


SMALL_WEIGHT_ELEMENTS = 10 * 1024 * 1024


def skinny_takes(rows: int, n: int, k: int) -> bool:
    """Where the kernel runs by default (kernels/dispatch.py): one row of a small model's weight (at most
    SMALL_WEIGHT_ELEMENTS) or of a vocabulary projection (N at least 16 K). On an H100 (bench/bench_skinny_linear.py,
    bench/results/skinny_linear_h100*.json) it beat the unfused kernels on the 0.5B draft's layers (a layer 30.6 ->
    24.5 us) and cuBLAS on both lm_heads (9-10%), and lost on the 7B's layers (a layer 181.6 -> 189.5 us: cuBLAS
    streams a large weight faster) and at 8 rows (2-4x: its rows share CUDA cores, cuBLAS's use tensor cores)."""
    return rows == 1 and (n * k <= SMALL_WEIGHT_ELEMENTS or n >= 16 * k)


def norm_linear_torch(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                      weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    normed, residual = add_rms_norm_torch(x, residual, norm_weight, eps)
    return F.linear(normed, weight, bias), residual


def linear_silu_mul_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """weight = [gate; up] stacked along N: returns SiLU(x @ gate^T) * (x @ up^T), [rows, N / 2]."""
    return silu_mul_torch(F.linear(x, weight, bias))


def norm_qkv_rotary_torch(x, residual, norm_weight, eps: float, weight, bias, positions, cos_sin, key_cache,
                          value_cache, slot_mapping, num_heads: int, num_kv_heads: int, head_dim: int):
    """(q rotated [rows, num_heads, head_dim], x + residual); k and v written into the cache (kernels/rotary_kv.py
    gives the layouts)."""
    qkv, residual = norm_linear_torch(x, residual, norm_weight, eps, weight, bias)
    return rotary_kv_torch(qkv, positions, cos_sin, key_cache, value_cache, slot_mapping, num_heads, num_kv_heads,
                           head_dim), residual
