"""Flat per-step tensors that tell attention which tokens belong to which sequence and where their KV lives."""

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor      # [num_tokens] int64: cache slot each new token's K/V is written to
    block_tables: torch.Tensor      # [num_seqs, max_blocks] int32: each sequence's blocks in order (-1 padding)
    seq_lens: torch.Tensor          # [num_seqs] int32: context length including this step's tokens
    query_start_loc: torch.Tensor   # [num_seqs + 1] int32: cumulative query lengths
    max_query_len: int              # host copies of the maxima, so kernels launch without a device sync
    max_seq_len: int

    @classmethod
    def make_dummy(cls, num_seqs: int = 2, query_len: int = 3, block_size: int = 16, device="cpu") -> "AttentionMetadata":
        """A valid metadata for warm-up and tests: each sequence has `query_len` new tokens and no history."""
        blocks_per_seq = (query_len + block_size - 1) // block_size
        tables = torch.arange(num_seqs * blocks_per_seq, dtype=torch.int32, device=device).view(num_seqs, -1)
        positions = torch.arange(query_len, device=device)
        blocks = tables[:, positions // block_size].long()
        slots = (blocks * block_size + (positions % block_size)[None, :]).reshape(-1)
        return cls(
            slot_mapping=slots,
            block_tables=tables,
            seq_lens=torch.full((num_seqs,), query_len, dtype=torch.int32, device=device),
            query_start_loc=torch.arange(0, (num_seqs + 1) * query_len, query_len, dtype=torch.int32, device=device),
            max_query_len=query_len,
            max_seq_len=query_len,
        )
