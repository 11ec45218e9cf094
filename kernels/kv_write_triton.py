"""Write new keys and values into the paged KV cache, Triton version of `write_kv_torch` (same layouts).

One program per token copies that token's [num_kv_heads, head_dim] key and value rows into its slot; a negative
slot skips the token. Inputs may be strided views (e.g. slices of a fused qkv projection); the caches may be views
too, as long as each is addressable by (block, offset, head, dim) strides.
"""

import torch
import triton
import triton.language as tl

from specsplit.kernels.rounding_triton import cast_rtne


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    num_kv_heads, head_dim,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, INTERPRETER: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        heads = tl.arange(0, BLOCK_H)[:, None]
        dims = tl.arange(0, BLOCK_D)[None, :]
        mask = (heads < num_kv_heads) & (dims < head_dim)
        k = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims * stride_kd, mask=mask)
        v = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims * stride_vd, mask=mask)
        kc = key_cache_ptr + block * stride_kcb + offset * stride_kcs + heads * stride_kch + dims * stride_kcd
        vc = value_cache_ptr + block * stride_vcb + offset * stride_vcs + heads * stride_vch + dims * stride_vcd
        tl.store(kc, cast_rtne(k, key_cache_ptr.dtype.element_ty, INTERPRETER), mask=mask)
        tl.store(vc, cast_rtne(v, value_cache_ptr.dtype.element_ty, INTERPRETER), mask=mask)


def write_kv_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    block_size = key_cache.shape[1]
    _write_kv_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        *key.stride(), *value.stride(), *key_cache.stride(), *value_cache.stride(),
        num_kv_heads, head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        INTERPRETER=key.device.type == "cpu",  # see rounding_triton: the CPU interpreter truncates bf16 casts
        num_warps=1 if num_kv_heads * head_dim <= 512 else 4,
    )
