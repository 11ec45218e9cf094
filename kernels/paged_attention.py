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

`ordered` (the batch-invariant mode of kernels/dispatch.py): the padded batch above is shaped by the longest query and
context of the batch, and SDPA's blocking and reductions follow those shapes. In the mode a token's result depends
on its own query and context only: its scores (over head_dim) and its weighted sum of values (over its positions,
the positions after its own adding -0.0) by `ordered_sum`'s fixed trees in float32, and its softmax computed on
exactly its own [heads, positions] rows, in a tensor of that shape (torch's CPU exponential differs in the last bit
between its SIMD body and the scalar leftovers of a loop, so the shape a row is computed in must not change).
Slow; for the CPU only (the GPU runs the Triton kernel's own invariant mode).
"""

import torch
import torch.nn.functional as F

from specsplit.kernels.invariant_reductions import BLOCK_ELEMENTS, ordered_sum


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
    ordered: bool = False,
) -> torch.Tensor:
    """Gather each sequence's KV into a padded batch and run one masked SDPA call over all sequences (a call of one
    sequence on the CPU: its own context alone, `_one_sequence`)."""
    if ordered:
        return _attention_fixed_order(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale)
    if seq_lens.shape[0] == 1 and not query.is_cuda:  # it reads the lengths on the host: no graph, no GPU sync
        return _one_sequence(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale)
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


def _one_sequence(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale):
    """A call of one sequence (a lone request's decode, draft step, verification or prefill), on the CPU: its keys
    gathered to exactly its context, no padded batch and no masks to build for one query (it sees every position),
    a causal one for several. Half the time of the padded path at one query, where these ops are most of it."""
    first, last = query_start_loc[:2].tolist()
    context = int(seq_lens[0])
    queries = last - first
    if queries == 0:
        return query[first:last]
    table = block_tables[0, : -(-context // key_cache.shape[1])].long()
    keys = key_cache[table].flatten(0, 1)[:context].transpose(0, 1)  # [kv heads, context, head_dim]
    values = value_cache[table].flatten(0, 1)[:context].transpose(0, 1)
    mask = None
    if queries > 1:  # query i sits at position context - queries + i
        positions = torch.arange(context, device=query.device)
        mask = positions[None, :] <= positions[context - queries:, None]
    out = F.scaled_dot_product_attention(query[first:last].transpose(0, 1)[None], keys[None], values[None],
                                         attn_mask=mask, scale=scale,
                                         enable_gqa=query.shape[1] != key_cache.shape[2])
    return out[0].transpose(0, 1)


def _attention_fixed_order(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale):
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    accumulate = torch.float64 if query.dtype == torch.float64 else torch.float32
    out = torch.empty_like(query)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for seq, context in enumerate(lens):
        first, last = starts[seq], starts[seq + 1]
        if first == last:
            continue
        table = block_tables[seq, : -(-context // block_size)].long()
        keys = key_cache[table].reshape(-1, num_kv_heads, head_dim)[:context].to(accumulate)
        values = value_cache[table].reshape(-1, num_kv_heads, head_dim)[:context].to(accumulate)
        keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, context, head_dim]
        values = values.repeat_interleave(group, dim=1).permute(1, 2, 0)  # [heads, head_dim, context]
        step = max(1, BLOCK_ELEMENTS // (num_heads * head_dim * context))  # tokens x heads x head_dim x context
        for lo in range(first, last, step):
            hi = min(lo + step, last)
            seen = torch.arange(context - (last - lo) + 1, context - (last - hi) + 1)  # each token's position + 1
            q = query[lo:hi].to(accumulate)[:, :, None, :]
            scores = ordered_sum(q * keys[None]) * scale  # [tokens, heads, context]
            weights = torch.zeros_like(scores)
            for i, n in enumerate(seen.tolist()):
                weights[i, :, :n] = _softmax_alone(scores[i, :, :n])
            valid = torch.arange(context)[None, None, None, :] < seen[:, None, None, None]
            # Positions past a token's own add -0.0 (x + -0.0 == x), so its sum is the same tree as alone.
            weighted = torch.where(valid, weights[:, :, None, :] * values[None], -0.0)
            out[lo:hi] = ordered_sum(weighted).to(query.dtype)
    return out


def _softmax_alone(scores: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim of one token's [heads, positions] scores, computed in a tensor of its own (the
    exponential then meets the same SIMD/scalar split as when the token is alone) and summed by the fixed tree."""
    scores = scores.contiguous()
    weights = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    return weights / ordered_sum(weights)[:, None]
