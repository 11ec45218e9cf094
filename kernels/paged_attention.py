"""Attention over a paged KV cache for variable-length queries, eager torch reference.

One call serves every query shape the round produces, mixed in one batch: prefill chunks (many queries), decode
(1 query), the draft's catch-up (1-2 queries) and the target's verification (k+1 queries). Sequence `b` owns
queries `query[query_start_loc[b]:query_start_loc[b+1]]`; its context is `seq_lens[b]` tokens long *including*
those queries, which are the last ones of the context. Query `i` of `n` sits at absolute position
`seq_lens[b] - n + i` and attends causally to every cached position up to and including its own.

Layouts (per layer):
    query:        [num_tokens, num_heads, head_dim]
    key_cache:    [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache:  [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: [num_seqs, max_blocks_per_seq] int32, block ids in order; unused entries are ignored
    seq_lens:     [num_seqs] int32
    query_start_loc: [num_seqs + 1] int32, cumulative query counts
GQA: query head `h` reads KV head `h // (num_heads // num_kv_heads)`.
"""

import torch
import torch.nn.functional as F


def paged_attention_torch(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
) -> torch.Tensor:
    """Gather each sequence's KV into a padded batch and run one masked SDPA call over all sequences."""
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    device = query.device

    # Padded query batch [num_seqs, max_query_len, num_heads, head_dim].
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    offsets = torch.arange(max_query_len, device=device)
    query_valid = offsets[None, :] < query_lens[:, None]
    token_index = (query_start_loc[:-1, None] + offsets[None, :]).clamp(max=max(num_tokens - 1, 0))
    padded_query = query[token_index]

    # Gathered KV [num_seqs, max_blocks * block_size, num_kv_heads, head_dim].
    blocks_needed = (max_seq_len + block_size - 1) // block_size
    tables = block_tables[:, :blocks_needed].long().clamp(min=0)
    keys = key_cache[tables].reshape(num_seqs, blocks_needed * block_size, num_kv_heads, head_dim)
    values = value_cache[tables].reshape(num_seqs, blocks_needed * block_size, num_kv_heads, head_dim)

    # Causal mask with the query block at the end of the context.
    kv_positions = torch.arange(blocks_needed * block_size, device=device)
    query_positions = (seq_lens - query_lens)[:, None] + offsets[None, :]
    mask = kv_positions[None, None, :] <= query_positions[:, :, None]
    mask &= kv_positions[None, None, :] < seq_lens[:, None, None]
    mask &= query_valid[:, :, None]
    # Padded query rows attend to position 0 so softmax stays finite; their output is discarded.
    mask[:, :, 0] |= ~query_valid

    out = F.scaled_dot_product_attention(
        padded_query.transpose(1, 2),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=mask[:, None, :, :],
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    ).transpose(1, 2)
    return out[query_valid]
