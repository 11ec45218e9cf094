"""A model plus its paged KV cache: runs one batched forward over many sequences' new tokens.

Each `ForwardItem` names a sequence's block table (what is already cached), the tokens to add, and how many of the
last positions need logits (1 for a draft step, k+1 for verification, 0 for a draft prefill). Long inputs are split
into chunks of at most `max_batch_tokens` so a long prompt never needs one giant activation.
"""

import os
from dataclasses import dataclass
from itertools import accumulate

import torch

from specsplit.services.errors import KVCacheFull
from specsplit.services.kv.block_manager import BlockManager, BlockTable
from specsplit.services.kv.paged_cache import PagedKVCache
from specsplit.services.models.loader import LoadedModel
from specsplit.kernels.dispatch import use_triton
from specsplit.services.runtime.attention_metadata import AttentionMetadata, slots_for
from specsplit.services.runtime.cuda_graphs import GraphedForward
from specsplit.services.runtime.host_transfer import to_device

CUDA_GRAPHS_ENV = "SPECSPLIT_CUDA_GRAPHS"  # "0" turns them off (benchmarks compare both)


@dataclass
class ForwardItem:
    table: BlockTable
    token_ids: list[int]
    num_logits: int


class ModelRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        num_blocks: int | None = None,
        block_size: int = 16,
        kv_cache_bytes: int = 1 << 30,
        max_batch_tokens: int = 2048,
        cuda_graphs: bool | None = None,
        prefix_caching: bool = True,
    ):
        """`cuda_graphs`: replay captured graphs for uniform batches (runtime/cuda_graphs.py); None = on a CUDA
        device with the Triton kernels unless SPECSPLIT_CUDA_GRAPHS=0. `prefix_caching`: prompts reuse the KV of
        earlier prompts' identical leading blocks (kv/prefix_cache.py)."""
        self.loaded = loaded
        self.model = loaded.model
        self.config = loaded.config
        param = next(self.model.parameters())
        self.device, self.dtype = param.device, param.dtype
        if num_blocks is None:
            num_blocks = max(kv_cache_bytes // PagedKVCache.bytes_per_block(self.config, block_size, self.dtype), 1)
        if cuda_graphs is None:
            cuda_graphs = param.is_cuda and use_triton(param) and os.environ.get(CUDA_GRAPHS_ENV, "1") != "0"
        self.block_manager = BlockManager(num_blocks, block_size, prefix_caching=prefix_caching)
        # With graphs, one more block past the managed ones: where padding rows of a graph batch write their KV.
        self.cache = PagedKVCache(self.config, num_blocks + (1 if cuda_graphs else 0), block_size, self.dtype, self.device)
        self.block_size = block_size
        self.max_batch_tokens = max_batch_tokens
        self.max_model_len = min(self.config.max_model_len, num_blocks * block_size)
        self.graphs = None
        if cuda_graphs:
            self.graphs = GraphedForward(self.model, self.cache.layers, block_size, num_blocks, self.max_model_len)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def reserve(self, items: list[ForwardItem]) -> list[Exception | None]:
        """Claim KV slots for every item's new tokens; an item that does not fit gets KVCacheFull, others go on."""
        errors: list[Exception | None] = []
        for item in items:
            try:
                copies = self.block_manager.append(item.table, len(item.token_ids))
                self.cache.copy_blocks(copies)
                errors.append(None)
            except KVCacheFull as error:
                errors.append(error)
        return errors

    def forward(self, items: list[ForwardItem]) -> list[torch.Tensor]:
        """Run items whose slots are already reserved. Returns each item's logits [num_logits, vocab] (float32)."""
        return list(self.forward_flat(items).split([item.num_logits for item in items]))

    @torch.inference_mode()
    def forward_flat(self, items: list[ForwardItem], input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Like `forward`, but all items' logits rows in one [sum(num_logits), vocab] tensor, in item order.
        `input_ids`: the items' tokens as one tensor already on the device (e.g. the draft's last samples), used
        instead of `item.token_ids`, which then only give the counts — the tokens never visit the host."""
        q = self.graphs.query_len(items, input_ids) if self.graphs is not None else None
        if q is not None:
            hidden = self.graphs.run(items, q, input_ids)  # q rows per item, its own tokens first
            keep = [b * q + j for b, item in enumerate(items)
                    for j in range(len(item.token_ids) - item.num_logits, len(item.token_ids))]
            if not keep:
                return torch.empty(0, self.vocab_size, device=self.device)
            if len(keep) < len(hidden):
                hidden = hidden[to_device(keep, torch.int64, self.device)]
            return self.model.compute_logits(hidden)
        if input_ids is not None:
            offsets = [0, *accumulate(len(item.token_ids) for item in items)]
            items = [ForwardItem(item.table, input_ids[lo:hi], item.num_logits)
                     for item, lo, hi in zip(items, offsets, offsets[1:])]
        # Where each item's new tokens start inside its (already extended) table.
        starts = [item.table.num_tokens - len(item.token_ids) for item in items]
        done = [0] * len(items)
        pieces: list[list[torch.Tensor]] = [[] for _ in items]
        while any(done[i] < len(item.token_ids) for i, item in enumerate(items)):
            budget = self.max_batch_tokens
            chunk = []
            for i, item in enumerate(items):
                remaining = len(item.token_ids) - done[i]
                if remaining == 0 or budget == 0:
                    continue
                take = min(remaining, budget)
                chunk.append((i, done[i], take))
                budget -= take
            hidden_rows = self._forward_chunk(items, starts, chunk)
            for (i, offset, take), rows in zip(chunk, hidden_rows):
                if rows is not None:
                    pieces[i].append(rows)
                done[i] += take
        # One vocabulary projection for every row that needs logits (the head is the largest single matmul: one
        # launch reads its weight once instead of once per sequence).
        rows = [part for parts in pieces for part in parts]
        if not rows:
            return torch.empty(0, self.vocab_size, device=self.device)
        return self.model.compute_logits(torch.cat(rows) if len(rows) > 1 else rows[0])

    def _forward_chunk(self, items, starts, chunk) -> list[torch.Tensor | None]:
        token_ids, positions, slots, seq_lens, query_lens, tables = [], [], [], [], [], []
        for i, offset, take in chunk:
            item = items[i]
            first = starts[i] + offset
            token_ids.append(item.token_ids[offset : offset + take])
            pos = range(first, first + take)
            positions.extend(pos)
            blocks = item.table.block_ids
            slots.extend(slots_for(blocks, pos, self.block_size))
            seq_lens.append(first + take)
            query_lens.append(take)
            tables.append(blocks)
        width = max(len(t) for t in tables)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=to_device(slots, torch.int64, dev),
            block_tables=to_device([t + [-1] * (width - len(t)) for t in tables], torch.int32, dev),
            seq_lens=to_device(seq_lens, torch.int32, dev),
            query_start_loc=to_device([0] + list(accumulate(query_lens)), torch.int32, dev),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
        )
        if isinstance(token_ids[0], torch.Tensor):  # ids already on the device
            input_ids = torch.cat(token_ids) if len(token_ids) > 1 else token_ids[0]
        else:
            input_ids = to_device([t for part in token_ids for t in part], torch.int64, dev)
        hidden = self.model(
            input_ids,
            to_device(positions, torch.int64, dev),
            meta,
            self.cache.layers,
        )
        # Keep hidden rows of the positions that need logits: the item's last `num_logits` tokens.
        out, cursor = [], 0
        for i, offset, take in chunk:
            item = items[i]
            first_needed = len(item.token_ids) - item.num_logits
            lo, hi = max(first_needed, offset), offset + take
            out.append(hidden[cursor + lo - offset : cursor + hi - offset] if hi > lo else None)
            cursor += take
        return out

