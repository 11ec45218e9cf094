"""`write_kv_torch` against a per-token loop, and `write_kv_triton` against `write_kv_torch`."""

import pytest
import torch

from specsplit.kernels.kv_write import write_kv_torch
from specsplit.kernels.kv_write_triton import write_kv_triton


def _inputs(num_tokens, num_kv_heads, head_dim, block_size, num_blocks, dtype, device, generator):
    # K and V as slices of one fused projection, as the model produces them: strided views, not contiguous.
    fused = torch.randn(num_tokens, 3, num_kv_heads, head_dim, generator=generator).to(dtype=dtype, device=device)
    key, value = fused[:, 1], fused[:, 2]
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    slots[::4] = -1  # padding tokens: not written
    return key, value, slots.to(device)


def _poisoned_caches(num_blocks, block_size, num_kv_heads, head_dim, dtype, device):
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return (torch.full(shape, float("nan"), dtype=dtype, device=device),
            torch.full(shape, float("nan"), dtype=dtype, device=device))


def test_reference_writes_each_token_to_its_slot_and_skips_negative_slots(generator):
    key, value, slots = _inputs(11, 2, 8, 4, 6, torch.float32, "cpu", generator)
    key_cache, value_cache = _poisoned_caches(6, 4, 2, 8, torch.float32, "cpu")
    write_kv_torch(key, value, key_cache, value_cache, slots)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(key_cache[slot // 4, slot % 4], key[t])
            assert torch.equal(value_cache[slot // 4, slot % 4], value[t])
    written = int((slots >= 0).sum())
    assert int((~key_cache.isnan()).all(-1).all(-1).sum()) == written
    assert int((~value_cache.isnan()).all(-1).all(-1).sum()) == written


@pytest.mark.parametrize(
    "num_kv_heads, head_dim, block_size, src_dtype, cache_dtype",
    [
        (2, 64, 16, torch.float32, torch.float32),
        (4, 128, 32, torch.bfloat16, torch.bfloat16),
        (2, 64, 16, torch.float32, torch.bfloat16),  # cast on write, rounded to nearest even like torch
        (3, 80, 16, torch.float16, torch.float16),
    ],
)
def test_triton_matches_reference(num_kv_heads, head_dim, block_size, src_dtype, cache_dtype, device, generator):
    num_blocks = 7
    key, value, slots = _inputs(19, num_kv_heads, head_dim, block_size, num_blocks, src_dtype, device, generator)
    want_k, want_v = _poisoned_caches(num_blocks, block_size, num_kv_heads, head_dim, cache_dtype, device)
    got_k, got_v = _poisoned_caches(num_blocks, block_size, num_kv_heads, head_dim, cache_dtype, device)
    write_kv_torch(key, value, want_k, want_v, slots)
    write_kv_triton(key, value, got_k, got_v, slots)
    # Bitwise, NaN where nothing was written on both sides.
    assert torch.equal(got_k.isnan(), want_k.isnan()) and torch.equal(got_v.isnan(), want_v.isnan())
    assert torch.equal(got_k.nan_to_num(), want_k.nan_to_num())
    assert torch.equal(got_v.nan_to_num(), want_v.nan_to_num())


def test_triton_with_no_tokens_is_a_no_op(device):
    key = torch.empty(0, 2, 16, device=device)
    caches = _poisoned_caches(2, 16, 2, 16, torch.float32, device)
    write_kv_triton(key, key, *caches, torch.empty(0, dtype=torch.int64, device=device))
    assert caches[0].isnan().all() and caches[1].isnan().all()
