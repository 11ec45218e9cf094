"""SiLU(gate) * up in one pass, Triton version of `silu_mul_torch`: the activation rounded to the output dtype
before the product, as torch's two ops round it."""

import torch
import triton
import triton.language as tl

from specsplit.kernels.rounding_triton import cast_rtne


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, stride_in, stride_out, intermediate,
                     BLOCK: tl.constexpr, INTERPRETER: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < intermediate
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + intermediate + cols, mask=mask, other=0.0).to(tl.float32)
    activated = cast_rtne(gate / (1.0 + tl.exp(-gate)), dtype, INTERPRETER).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, cast_rtne(activated * up, dtype, INTERPRETER), mask=mask)


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    tokens, width = gate_up.shape
    intermediate = width // 2
    out = torch.empty(tokens, intermediate, dtype=gate_up.dtype, device=gate_up.device)
    if tokens:
        block = min(triton.next_power_of_2(intermediate), 2048)
        _silu_mul_kernel[(tokens, triton.cdiv(intermediate, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), intermediate,
            BLOCK=block, INTERPRETER=gate_up.device.type == "cpu", num_warps=4,
        )
    return out
