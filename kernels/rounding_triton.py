"""Float downcasts that round to nearest even on the GPU and in Triton's CPU interpreter alike.

On a GPU `x.to(tl.bfloat16)` rounds to nearest even, as torch does. Triton's interpreter (the CPU test path)
truncates fp32 -> bf16 instead, which biases every rounded value toward zero. Kernels that run under the interpreter
in tests pass EMULATE=True and get the rounding done on the bits, so the CPU tests check the GPU's arithmetic.
"""

import triton
import triton.language as tl


@triton.jit
def _round_fp32_to_bf16_bits(x):
    """fp32 -> fp32 holding the nearest-even bf16 value (finite inputs), by integer arithmetic on the bits."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + (0x7FFF + ((bits >> 16) & 1))
    return (bits & 0xFFFF0000).to(tl.float32, bitcast=True)


@triton.jit
def cast_rtne(x, dtype: tl.constexpr, EMULATE: tl.constexpr):
    """x (any float dtype) -> dtype, rounded to nearest even."""
    if x.dtype == dtype:
        return x
    elif EMULATE and dtype == tl.bfloat16:
        # Already exactly representable, so the interpreter's truncating cast is exact.
        return _round_fp32_to_bf16_bits(x.to(tl.float32)).to(dtype)
    else:
        return x.to(dtype)
