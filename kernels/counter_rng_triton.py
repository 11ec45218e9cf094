"""Counter-based uniforms in Triton, bit-identical to `counter_uniform_torch`.

`counter_uniform` is a device function: any kernel can draw u = hash(seed, position, stream) in registers. The
reference keeps 32-bit values in int64 lanes and masks after each multiply; here the lanes are uint32, whose
multiply wraps modulo 2^32 and whose right shift is logical, which is the same arithmetic.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _lowbias32(x):
    x = x ^ (x >> 16)
    x = x * tl.full(x.shape, 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full(x.shape, 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def counter_uniform(seed, position, stream):
    """seed, position: int64 tensors (same shape); stream: int. Returns float32 uniforms in (0, 1)."""
    seed = seed.to(tl.int64)
    position = position.to(tl.int64)
    seed_lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    seed_hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    counter = (((position & 0x3FFFFFFF) * 4 + stream) & 0xFFFFFFFF).to(tl.uint32)
    golden = tl.full(seed_lo.shape, 0x9E3779B9, tl.uint32)
    h = _lowbias32(counter ^ _lowbias32(seed_hi ^ _lowbias32(seed_lo ^ golden)))
    # Same mapping as bits_to_uniform: 23 bits, centred, every step exact in float32.
    return ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)


@triton.jit
def _counter_uniform_kernel(seed_ptr, position_ptr, out_ptr, n, stream, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    seed = tl.load(seed_ptr + offs, mask=mask, other=0)
    position = tl.load(position_ptr + offs, mask=mask, other=0)
    tl.store(out_ptr + offs, counter_uniform(seed, position, stream), mask=mask)


def counter_uniform_triton(seeds: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """Same contract as `counter_uniform_torch`: float32 uniforms over the broadcast of `seeds` and `positions`."""
    seeds, positions = torch.broadcast_tensors(seeds.to(torch.int64), positions.to(torch.int64))
    seeds, positions = seeds.contiguous(), positions.contiguous()
    out = torch.empty(seeds.shape, dtype=torch.float32, device=seeds.device)
    n = seeds.numel()
    if n:
        block = 1024
        _counter_uniform_kernel[(triton.cdiv(n, block),)](seeds, positions, out, n, int(stream), BLOCK=block)
    return out
