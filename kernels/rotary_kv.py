"""Rotary position embedding of q and k fused with writing k and v into the paged KV cache, eager torch reference.

After the fused q/k/v projection each token needs: q and k rotated by its position, then k and v stored in the
cache slot of that position. On a GPU that is one kernel (`rotary_kv_triton`) instead of a dozen (cos/sin, two
half-rotations, casts, the KV write). cos/sin come from a table computed once per model (`rotary_table`), so no
kernel recomputes them per layer. Rounding follows transformers: cos/sin cast to the activations' dtype, each
product and the sum rounded in that dtype.

    qkv:        [tokens, (num_heads + 2 * num_kv_heads) * head_dim], q then k then v
    positions:  [tokens] int64, absolute positions
    cos_sin:    [max_positions, 2, head_dim // 2] float32 (see rotary_table)
    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim] (written in place)
    slot_mapping: [tokens] int64 (negative = do not write)
    returns q rotated: [tokens, num_heads, head_dim]
"""

import torch

from specsplit.kernels.kv_write import write_kv_torch


def rotary_table(inv_freq: torch.Tensor, scaling: float, max_positions: int) -> torch.Tensor:
    """cos and sin of every position's angles, times the rope scaling: [max_positions, 2, head_dim // 2] float32.
    Computed on the CPU as transformers computes them (float32 product, then cos/sin), so every entry is
    bit-identical to computing it on the fly."""
    freqs = torch.arange(max_positions, dtype=torch.int64)[:, None].to(torch.float32) * inv_freq.cpu()[None, :]
    return torch.stack((freqs.cos() * scaling, freqs.sin() * scaling), dim=1)


def rotate_half_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [tokens, heads, head_dim]; cos/sin [tokens, head_dim // 2] float32 -> x rotated, in x's dtype."""
    half = x.shape[-1] // 2
    cos = torch.cat((cos, cos), dim=-1)[:, None, :].to(x.dtype)
    sin = torch.cat((sin, sin), dim=-1)[:, None, :].to(x.dtype)
    rotated_half = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated_half * sin


def rotary_kv_torch(
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
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    angles = cos_sin[positions]
    cos, sin = angles[:, 0], angles[:, 1]
    q = rotate_half_pairs(q.reshape(-1, num_heads, head_dim), cos, sin)
    k = rotate_half_pairs(k.reshape(-1, num_kv_heads, head_dim), cos, sin)
    write_kv_torch(k, v.reshape(-1, num_kv_heads, head_dim), key_cache, value_cache, slot_mapping)
    return q
