"""Fused residual add + RMSNorm, Triton version of `add_rms_norm_torch` (same contract and rounding steps).

One program per token row: the add (rounded to the activations' dtype, as torch rounds it), the sum of squares in
float32, the scale, the cast back and the weight product (in the weight's dtype) in registers; the row is read once
and the normed row and new residual written once.
"""

import torch
import triton
import triton.language as tl

from specsplit.kernels.rounding_triton import cast_rtne


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    stride_x, stride_r, stride_o, stride_ro, hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, INTERPRETER: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = cast_rtne(x.to(tl.float32) + r.to(tl.float32), x_ptr.dtype.element_ty, INTERPRETER)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    variance = tl.sum(x32 * x32, axis=0) / hidden
    normed = cast_rtne(x32 * tl.math.rsqrt(variance + eps), x_ptr.dtype.element_ty, INTERPRETER)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = cast_rtne(w.to(tl.float32) * normed.to(tl.float32), out_ptr.dtype.element_ty, INTERPRETER)
    tl.store(out_ptr + row * stride_o + cols, out, mask=mask)


def add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, hidden = x.shape
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(tokens, hidden, dtype=out_dtype, device=x.device)
    residual_out = torch.empty_like(x) if residual is not None else x
    if tokens:
        block = triton.next_power_of_2(hidden)
        _add_rms_norm_kernel[(tokens,)](
            x, residual if residual is not None else x, weight, out, residual_out,
            x.stride(0), (residual if residual is not None else x).stride(0), out.stride(0), residual_out.stride(0),
            hidden, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, INTERPRETER=x.device.type == "cpu",
            num_warps=4 if block <= 2048 else 8,
        )
    return out, residual_out
