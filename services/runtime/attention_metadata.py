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


def slots_for(block_ids: list[int], positions, block_size: int) -> list[int]:
    """The cache slot of each position of a sequence whose KV lives in `block_ids`."""
    return [block_ids[p // block_size] * block_size + p % block_size for p in positions]
