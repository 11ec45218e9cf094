"""The eager reference `paged_attention_torch` against naive per-sequence dense attention, in float64."""

import pytest
import torch

from paged_batch_inputs import make_paged_batch, naive_attention, relative_error
from specsplit.kernels import paged_attention
from specsplit.kernels.paged_attention import paged_attention_torch


@pytest.mark.parametrize(
    "num_heads, num_kv_heads, head_dim, block_size",
    [(14, 2, 64, 16), (12, 2, 128, 32), (4, 4, 32, 16)],
)
def test_reference_matches_naive_dense_attention(num_heads, num_kv_heads, head_dim, block_size, generator):
    # decode, draft catch-up, verification (k+1 = 5), a prefill chunk after history, a whole-prompt prefill
    query_lens = [1, 2, 5, 9, 6]
    seq_lens = [37, 18, 64, 50, 6]
    batch = make_paged_batch(query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, torch.float64,
                             "cpu", generator)
    got = paged_attention_torch(*batch.args())
    assert got.shape == batch.query.shape
    assert relative_error(got, naive_attention(batch)) < 1e-12


def test_reference_single_token_context_is_its_value(generator):
    # One token attending to itself alone returns that token's value exactly.
    batch = make_paged_batch([1], [1], 4, 2, 16, 16, torch.float64, "cpu", generator)
    got = paged_attention_torch(*batch.args())
    block = int(batch.block_tables[0, 0])
    want = batch.value_cache[block, 0].repeat_interleave(2, dim=0)
    torch.testing.assert_close(got[0], want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("query_len, seq_len", [(1, 37), (1, 16), (5, 64), (9, 50), (6, 6)],
                         ids=["decode", "decode-one-block", "verification", "prefill-chunk", "whole-prompt"])
def test_a_lone_sequence_takes_the_unpadded_path_and_gets_the_batched_result(query_len, seq_len, generator,
                                                                          monkeypatch):
    # A call of one sequence gathers exactly its context (no padded batch, no mask for one query): the same
    # attention as the sequence computed beside others in the padded path.
    taken = []
    monkeypatch.setattr(paged_attention, "_one_sequence",
                        lambda *args, _original=paged_attention._one_sequence: taken.append(1) or _original(*args))
    batch = make_paged_batch([3, query_len], [40, seq_len], 14, 2, 64, 16, torch.float64, "cpu", generator)
    beside_another = paged_attention_torch(*batch.args())[3:]
    tables, lens = batch.block_tables[1:], batch.seq_lens[1:]
    alone = paged_attention_torch(batch.query[3:], batch.key_cache, batch.value_cache, tables, lens,
                                  torch.tensor([0, query_len], dtype=torch.int32), batch.scale, query_len, seq_len)
    assert taken == [1]  # the lone call only, not the two-sequence one
    assert alone.shape == beside_another.shape
    assert relative_error(alone, beside_another) < 1e-12
    assert relative_error(alone, naive_attention(batch)[3:]) < 1e-12
