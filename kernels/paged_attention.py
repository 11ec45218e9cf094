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

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specsplit.kernels.forward_memo import memoized


@dataclass
class AttentionPlan:
    """What every layer's attention needs from the step's metadata alone (kernels/forward_memo.py)."""
    token_index: torch.Tensor | None  # [num_seqs, max_query_len] query rows to gather; None: rows already in order
    query_valid: torch.Tensor         # [num_seqs, max_query_len] which padded rows are real queries
    tables: torch.Tensor              # [num_seqs, blocks_needed] int64 block ids
    mask: torch.Tensor                # [num_seqs, 1, max_query_len, blocks_needed * block_size]


def queries_in_order(query_start_loc: torch.Tensor, max_query_len: int, num_tokens: int) -> bool:
    """Every sequence has max_query_len queries and there are no others (a decode or a verification batch): the
    query is then already the padded batch. Checked only on the CPU, where reading query_start_loc costs no sync."""
    num_seqs = query_start_loc.shape[0] - 1
    return (query_start_loc.device.type == "cpu" and num_tokens == num_seqs * max_query_len
            and int(query_start_loc[-1]) == num_tokens)


def attention_plan(block_tables, seq_lens, query_start_loc, max_query_len: int, max_seq_len: int, block_size: int,
                   num_tokens: int) -> AttentionPlan:
    device = seq_lens.device
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    offsets = torch.arange(max_query_len, device=device)
    query_valid = offsets[None, :] < query_lens[:, None]
    token_index = None if queries_in_order(query_start_loc, max_query_len, num_tokens) else (
        query_start_loc[:-1, None] + offsets[None, :]).clamp(max=max(num_tokens - 1, 0))

    blocks_needed = (max_seq_len + block_size - 1) // block_size
    tables = block_tables[:, :blocks_needed].long().clamp(min=0)

    # Causal mask with the query block at the end of the context.
    kv_positions = torch.arange(blocks_needed * block_size, device=device)
    query_positions = (seq_lens - query_lens)[:, None] + offsets[None, :]
    mask = kv_positions[None, None, :] <= query_positions[:, :, None]
    mask &= kv_positions[None, None, :] < seq_lens[:, None, None]
    mask &= query_valid[:, :, None]
    # Padded query rows attend to position 0 so softmax stays finite; their output is discarded.
    mask[:, :, 0] |= ~query_valid
    return AttentionPlan(token_index, query_valid, tables, mask[:, None, :, :])


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
    plan = memoized("paged_attention", (block_tables, seq_lens, query_start_loc),
                    (max_query_len, max_seq_len, block_size, num_tokens),
                    lambda: attention_plan(block_tables, seq_lens, query_start_loc, max_query_len, max_seq_len,
                                           block_size, num_tokens))

    # Padded query batch [num_seqs, max_query_len, num_heads, head_dim].
    if plan.token_index is None:
        padded_query = query.reshape(num_seqs, max_query_len, num_heads, head_dim)
    else:
        padded_query = query[plan.token_index]

    # Gathered KV [num_seqs, max_blocks * block_size, num_kv_heads, head_dim].
    context = plan.tables.shape[1] * block_size
    keys = key_cache[plan.tables].reshape(num_seqs, context, num_kv_heads, head_dim)
    values = value_cache[plan.tables].reshape(num_seqs, context, num_kv_heads, head_dim)

    out = F.scaled_dot_product_attention(
        padded_query.transpose(1, 2),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=plan.mask,
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    ).transpose(1, 2)
    if plan.token_index is None:
        return out.reshape(num_tokens, num_heads, head_dim)
    return out[plan.query_valid]
