"""`paged_attention_triton` against the float64 reference: mixed batches, GQA, split-KV, block sizes, dtypes."""

import pytest
import torch

from paged_batch_inputs import make_paged_batch, relative_error
from specsplit.kernels.paged_attention import paged_attention_torch
from specsplit.kernels.paged_attention_triton import choose_num_splits, choose_tiles, paged_attention_triton

TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 1.5e-2}


def _check(batch, dtype, **knobs):
    want = paged_attention_torch(*batch.to(torch.float64).args())
    low = batch.to(dtype)
    out = torch.full_like(low.query, float("nan"))
    got = paged_attention_triton(*low.args(), out=out, **knobs)
    assert got is out
    assert not got.isnan().any(), "some output rows were never written"
    assert relative_error(got, want) < TOLERANCE[dtype]


# Shapes: (num_heads, num_kv_heads, head_dim) from Qwen2.5 0.5B (14/2, 64) and 1.5B (12/2, 128), cut small.
@pytest.mark.parametrize(
    "heads, block_size, dtype, num_splits",
    [
        ((14, 2, 64), 16, torch.float32, None),
        ((14, 2, 64), 32, torch.float32, 3),
        ((12, 2, 128), 16, torch.bfloat16, None),
        ((12, 2, 128), 32, torch.float16, 2),
    ],
)
def test_mixed_batch(heads, block_size, dtype, num_splits, device, generator):
    # One call: decode, catch-up (2), verification (k+1 = 5), and a prefill chunk after history.
    num_heads, num_kv_heads, head_dim = heads
    batch = make_paged_batch([1, 2, 5, 7], [45, 17, 70, 40], num_heads, num_kv_heads, head_dim, block_size,
                             torch.float32, device, generator)
    _check(batch, dtype, num_splits=num_splits)


def test_prefill_spanning_several_query_tiles(device, generator):
    # 20 queries with a group of 8 heads: tiles of 16 query tokens, so the prompt spans two tiles; one sequence
    # is a whole prompt (no history), one a chunk after history, one a decode riding along.
    batch = make_paged_batch([20, 18, 1], [20, 50, 33], 16, 2, 32, 16, torch.float32, device, generator)
    block_q, _ = choose_tiles(batch.max_query_len, 8)
    assert block_q < batch.max_query_len
    _check(batch, torch.float32)


def test_split_kv_decode_with_empty_splits(device, generator):
    # More splits than a short context has KV tiles: the extra splits are empty and must merge to nothing.
    batch = make_paged_batch([1, 1, 1], [130, 9, 64], 8, 1, 64, 16, torch.float32, device, generator)
    _check(batch, torch.float32, num_splits=5, block_n=16)


def test_verification_split_across_tile_boundary(device, generator):
    # k+1 = 5 queries whose causal diagonal straddles a KV tile edge, in several splits, group of 7 (Qwen2.5-7B).
    batch = make_paged_batch([5, 5], [66, 129], 14, 2, 64, 16, torch.float32, device, generator)
    _check(batch, torch.float32, num_splits=4, block_n=32)


def test_head_dim_not_a_power_of_two(device, generator):
    batch = make_paged_batch([1, 3], [21, 40], 4, 2, 80, 16, torch.float32, device, generator)
    _check(batch, torch.float32)


def test_num_splits_heuristic():
    # Few programs and a long context: split until one wave of 2 programs per SM is full, never past it.
    assert choose_num_splits(num_seqs=1, num_kv_heads=4, num_q_tiles=1, max_seq_len=32768, num_sms=132) == 66
    assert choose_num_splits(num_seqs=4, num_kv_heads=4, num_q_tiles=1, max_seq_len=32768, num_sms=132) == 16
    assert choose_num_splits(num_seqs=16, num_kv_heads=4, num_q_tiles=1, max_seq_len=32768, num_sms=132) == 4
    # Enough programs already: no split.
    assert choose_num_splits(num_seqs=64, num_kv_heads=4, num_q_tiles=1, max_seq_len=32768, num_sms=132) == 1
    # Short context: each split keeps at least 256 positions.
    assert choose_num_splits(num_seqs=1, num_kv_heads=4, num_q_tiles=1, max_seq_len=600, num_sms=132) == 2


def test_tiles_pack_query_tokens_with_the_head_group():
    assert choose_tiles(1, 7) == (2, 16)    # decode: 7 heads padded to 8, tile floor of 16 rows
    assert choose_tiles(5, 7) == (8, 64)    # verification k+1 = 5: one tile for all queries and heads
    assert choose_tiles(500, 6) == (16, 128)
