"""Random paged-attention batches for the kernel tests, and a naive dense attention to check the reference with."""

from dataclasses import dataclass

import torch


@dataclass
class PagedBatch:
    query: torch.Tensor            # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor        # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor
    block_tables: torch.Tensor     # [num_seqs, max_blocks] int32, -1 past each sequence's blocks
    seq_lens: torch.Tensor         # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    scale: float
    max_query_len: int
    max_seq_len: int

    def args(self) -> tuple:
        return (self.query, self.key_cache, self.value_cache, self.block_tables, self.seq_lens, self.query_start_loc,
                self.scale, self.max_query_len, self.max_seq_len)

    def to(self, dtype: torch.dtype) -> "PagedBatch":
        return PagedBatch(self.query.to(dtype), self.key_cache.to(dtype), self.value_cache.to(dtype),
                          self.block_tables, self.seq_lens, self.query_start_loc, self.scale, self.max_query_len,
                          self.max_seq_len)


def make_paged_batch(query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device, generator,
                     query_gain: float = 1.5) -> PagedBatch:
    """Sequences own shuffled, non-contiguous blocks; a few spare blocks hold random values no one owns."""
    assert all(q <= s for q, s in zip(query_lens, seq_lens))
    blocks_per_seq = [(s + block_size - 1) // block_size for s in seq_lens]
    max_blocks = max(blocks_per_seq) + 2
    num_blocks = sum(blocks_per_seq) + 5
    physical = torch.randperm(num_blocks, generator=generator)
    tables = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(blocks_per_seq):
        tables[b, :n] = physical[used:used + n].to(torch.int32)
        used += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=generator)
    value_cache = torch.randn(shape, generator=generator)
    # Slots past each context inside a sequence's last block are garbage too: make them huge, not NaN (the
    # reference's masked SDPA multiplies them by zero weights, and NaN * 0 is NaN).
    for b, s in enumerate(seq_lens):
        if s % block_size:
            last = int(tables[b, blocks_per_seq[b] - 1])
            key_cache[last, s % block_size:] = 1e4
            value_cache[last, s % block_size:] = 1e4
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=generator) * query_gain
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    return PagedBatch(
        query=query.to(dtype=dtype, device=device),
        key_cache=key_cache.to(dtype=dtype, device=device),
        value_cache=value_cache.to(dtype=dtype, device=device),
        block_tables=tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        scale=head_dim**-0.5,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )


def naive_attention(batch: PagedBatch) -> torch.Tensor:
    """Per sequence, per head, dense float64 attention with the queries at the end of the context."""
    query = batch.query.double().cpu()
    keys_all, values_all = batch.key_cache.double().cpu(), batch.value_cache.double().cpu()
    num_heads, num_kv_heads = query.shape[1], keys_all.shape[2]
    block_size = keys_all.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    starts = batch.query_start_loc.tolist()
    for b, seq_len in enumerate(batch.seq_lens.tolist()):
        q = query[starts[b]:starts[b + 1]]
        n = q.shape[0]
        positions = torch.arange(seq_len)
        blocks = batch.block_tables[b].cpu().long()[positions // block_size]
        keys = keys_all[blocks, positions % block_size]      # [seq_len, num_kv_heads, head_dim]
        values = values_all[blocks, positions % block_size]
        query_positions = seq_len - n + torch.arange(n)
        allowed = positions[None, :] <= query_positions[:, None]
        for h in range(num_heads):
            scores = q[:, h] @ keys[:, h // group].T * batch.scale
            scores = scores.masked_fill(~allowed, float("-inf"))
            out[starts[b]:starts[b + 1], h] = scores.softmax(-1) @ values[:, h // group]
    return out


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double().cpu(), want.double().cpu()
    return float((got - want).norm() / want.norm())
