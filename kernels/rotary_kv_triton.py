"""Rotary embedding of q and k plus the KV-cache write, Triton version of `rotary_kv_torch` (same contract).

One program per token: it reads the token's q, k and v rows out of the fused projection once, rotates q and k with
the position's cos/sin (each product and the sum rounded in the activations' dtype, exactly as torch does; launched
without floating-point contraction so float32 matches too), writes q to its output and k, v to the token's cache
slot (none for a negative slot).
"""

import torch
import triton
import triton.language as tl

from specsplit.kernels.rounding_triton import cast_rtne


@triton.jit
def rotate_pairs(x1, x2, c, s, DTYPE: tl.constexpr, INTERPRETER: tl.constexpr):
    """(x1 * c - x2 * s, x2 * c + x1 * s) with every product and sum rounded to DTYPE, as separate torch ops do."""
    out1 = cast_rtne(cast_rtne(x1 * c, DTYPE, INTERPRETER).to(tl.float32)
                     + cast_rtne(-x2 * s, DTYPE, INTERPRETER).to(tl.float32), DTYPE, INTERPRETER)
    out2 = cast_rtne(cast_rtne(x2 * c, DTYPE, INTERPRETER).to(tl.float32)
                     + cast_rtne(x1 * s, DTYPE, INTERPRETER).to(tl.float32), DTYPE, INTERPRETER)
    return out1, out2


@triton.jit
def _rotary_kv_kernel(
    qkv_ptr, positions_ptr, cos_sin_ptr, key_cache_ptr, value_cache_ptr, slot_ptr, q_out_ptr,
    stride_t, stride_qo_t, stride_qo_h,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    num_heads, num_kv_heads,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    INTERPRETER: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    dtype: tl.constexpr = qkv_ptr.dtype.element_ty
    head_dim: tl.constexpr = 2 * HALF
    position = tl.load(positions_ptr + token).to(tl.int64)
    j = tl.arange(0, HALF)
    # cos/sin in the activations' dtype, as torch casts them before multiplying.
    c = cast_rtne(tl.load(cos_sin_ptr + position * 2 * HALF + j), dtype, INTERPRETER).to(tl.float32)
    s = cast_rtne(tl.load(cos_sin_ptr + position * 2 * HALF + HALF + j), dtype, INTERPRETER).to(tl.float32)
    row = qkv_ptr + token * stride_t

    heads = tl.arange(0, BLOCK_H)[:, None]
    q_mask = heads < num_heads
    q1 = tl.load(row + heads * head_dim + j[None, :], mask=q_mask, other=0.0).to(tl.float32)
    q2 = tl.load(row + heads * head_dim + HALF + j[None, :], mask=q_mask, other=0.0).to(tl.float32)
    o1, o2 = rotate_pairs(q1, q2, c[None, :], s[None, :], dtype, INTERPRETER)
    q_out = q_out_ptr + token * stride_qo_t + heads * stride_qo_h
    tl.store(q_out + j[None, :], o1, mask=q_mask)
    tl.store(q_out + HALF + j[None, :], o2, mask=q_mask)

    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        kv_heads = tl.arange(0, BLOCK_KV)[:, None]
        kv_mask = kv_heads < num_kv_heads
        k_row = row + num_heads * head_dim + kv_heads * head_dim
        v_row = row + (num_heads + num_kv_heads) * head_dim + kv_heads * head_dim
        k1 = tl.load(k_row + j[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        k2 = tl.load(k_row + HALF + j[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        r1, r2 = rotate_pairs(k1, k2, c[None, :], s[None, :], dtype, INTERPRETER)
        kc = key_cache_ptr + block * stride_kcb + offset * stride_kcs + kv_heads * stride_kch
        cache_dtype: tl.constexpr = key_cache_ptr.dtype.element_ty
        tl.store(kc + j[None, :], cast_rtne(r1, cache_dtype, INTERPRETER), mask=kv_mask)
        tl.store(kc + HALF + j[None, :], cast_rtne(r2, cache_dtype, INTERPRETER), mask=kv_mask)
        vc = value_cache_ptr + block * stride_vcb + offset * stride_vcs + kv_heads * stride_vch
        v1 = tl.load(v_row + j[None, :], mask=kv_mask, other=0.0)
        v2 = tl.load(v_row + HALF + j[None, :], mask=kv_mask, other=0.0)
        tl.store(vc + j[None, :], cast_rtne(v1, cache_dtype, INTERPRETER), mask=kv_mask)
        tl.store(vc + HALF + j[None, :], cast_rtne(v2, cache_dtype, INTERPRETER), mask=kv_mask)


def rotary_kv_triton(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> torch.Tensor:
    tokens = qkv.shape[0]
    q = torch.empty(tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if tokens == 0:
        return q
    half = head_dim // 2
    assert qkv.stride(1) == 1 and cos_sin.is_contiguous() and key_cache.stride(3) == 1 and value_cache.stride(3) == 1
    assert half == triton.next_power_of_2(half), "head_dim must be twice a power of two"
    _rotary_kv_kernel[(tokens,)](
        qkv, positions, cos_sin, key_cache, value_cache, slot_mapping, q,
        qkv.stride(0), q.stride(0), q.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        num_heads, num_kv_heads,
        HALF=half, BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_KV=triton.next_power_of_2(num_kv_heads),
        BLOCK_SIZE=key_cache.shape[1], INTERPRETER=qkv.device.type == "cpu",
        num_warps=4, enable_fp_fusion=False,
    )
    return q
