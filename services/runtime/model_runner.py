"""A model plus its paged KV cache, run two ways.

- `run_step`: the rounds' calls (the draft's k steps, the target's verification). A step program sees a batch of
  sequences with the same number of tokens each (padded), built from one packed input buffer and the device
  mirror of the block tables, and returns one packed result; on a GPU it is one CUDA-graph replay
  (runtime/cuda_graphs.py), elsewhere the same program runs eagerly. Its forward is `forward_rows`.
- `forward` / `forward_flat`: prefills and other ragged work. Each `ForwardItem` names a sequence's block table
  (what is already cached), the tokens to add, and how many of the last positions need logits. Long inputs are split
  into chunks of at most `max_batch_tokens` so a long prompt never needs one giant activation.
"""

import os
from dataclasses import dataclass
from itertools import accumulate

import numpy as np
import torch

from specsplit.services.errors import KVCacheFull
from specsplit.services.kv.block_manager import BlockManager, BlockTable
from specsplit.services.kv.paged_cache import PagedKVCache
from specsplit.services.models.loader import LoadedModel
from specsplit.kernels.dispatch import use_triton
from specsplit.services.runtime.attention_metadata import AttentionMetadata, slots_for
from specsplit.services.models.rotary import PADDING_POSITIONS
from specsplit.services.runtime.cuda_graphs import GraphCache, bucket_for
from specsplit.services.runtime.device_block_tables import DeviceBlockTables
from specsplit.services.runtime.host_transfer import to_device
from specsplit.services.runtime.pending_step import PendingStep

CUDA_GRAPHS_ENV = "SPECSPLIT_CUDA_GRAPHS"  # "0" turns them off (benchmarks compare both)
CONTEXT_CLASSES = (256, 2048)  # then the served context
KV_CACHE_BYTES_ENV = "SPECSPLIT_KV_CACHE_BYTES"  # the KV cache's size when no block count is given (default 1 GiB)


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
        kv_cache_bytes: int | None = None,
        max_batch_tokens: int = 2048,
        cuda_graphs: bool | None = None,
        prefix_caching: bool = True,
    ):
        """`cuda_graphs`: replay captured graphs of the step programs (runtime/cuda_graphs.py); None = on a CUDA
        device with the Triton kernels unless SPECSPLIT_CUDA_GRAPHS=0. `prefix_caching`: prompts reuse the KV of
        earlier prompts' identical leading blocks (kv/prefix_cache.py)."""
        self.loaded = loaded
        # Whether this runner's step programs decide tokens (rank 0 of a tensor-parallel replica, or a whole model);
        # the other ranks run only the forwards and collectives (runtime/tensor_parallel_runner.py).
        self.decides = True
        self.model = loaded.model
        self.config = loaded.config
        param = next(self.model.parameters())
        self.device, self.dtype = param.device, param.dtype
        if num_blocks is None:
            kv_cache_bytes = kv_cache_bytes or int(os.environ.get(KV_CACHE_BYTES_ENV, 1 << 30))
            num_blocks = max(kv_cache_bytes // PagedKVCache.bytes_per_block(self.config, block_size, self.dtype), 1)
        if cuda_graphs is None:
            cuda_graphs = param.is_cuda and use_triton(param) and os.environ.get(CUDA_GRAPHS_ENV, "1") != "0"
        self.block_manager = BlockManager(num_blocks, block_size, prefix_caching=prefix_caching)
        # One more block past the managed ones: where padding tokens of a step write their KV (never read for real).
        self.scratch_block = num_blocks
        self.cache = PagedKVCache(self.config, num_blocks + 1, block_size, self.dtype, self.device)
        self.block_size = block_size
        self.max_batch_tokens = max_batch_tokens
        self.max_model_len = min(self.config.max_model_len, num_blocks * block_size)
        self.graphs = GraphCache(self.device) if cuda_graphs else None
        max_blocks = -(-(self.max_model_len + PADDING_POSITIONS) // block_size)
        self.block_tables = DeviceBlockTables(max_blocks, self.scratch_block, self.device,
                                              on_grow=self.graphs.clear if self.graphs else None)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def reserve(self, items: list[ForwardItem]) -> list[Exception | None]:
        """Claim KV slots for every item's new tokens; an item that does not fit gets KVCacheFull, others go on."""
        errors: list[Exception | None] = []
        for item in items:
            try:
                self.reserve_tokens(item.table, len(item.token_ids))
                errors.append(None)
            except KVCacheFull as error:
                errors.append(error)
        return errors

    def reserve_tokens(self, table: BlockTable, count: int) -> None:
        """Claim KV slots for `count` more tokens of one sequence (copying a shared last block first); raises
        KVCacheFull and changes nothing if they do not fit."""
        self.cache.copy_blocks(self.block_manager.append(table, count))

    def forward(self, items: list[ForwardItem]) -> list[torch.Tensor]:
        """Run items whose slots are already reserved. Returns each item's logits [num_logits, vocab] (float32)."""
        return list(self.forward_flat(items).split([item.num_logits for item in items]))

    @torch.inference_mode()
    def forward_flat(self, items: list[ForwardItem]) -> torch.Tensor:
        """Like `forward`, but all items' logits rows in one [sum(num_logits), vocab] tensor, in item order."""
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

    def run_step(self, program, shape, values: dict, tables: list[BlockTable]) -> np.ndarray:
        """Run a step program over the sequences of `tables`: `values` are its per-sequence input fields (numpy,
        one row per table); returns its packed result (numpy, one row per padded sequence, the real ones first).
        On a GPU with graphs: one upload, one replay, one copy back."""
        return self.execute_step(program, shape, *self._packed(program, shape, values, tables))

    def launch_step(self, program, shape, values: dict, tables: list[BlockTable]) -> PendingStep:
        """`run_step` without waiting for the result: on a GPU the step is queued and the host goes on; the result
        is read from the PendingStep, before any other step program of this runner runs (target/decode_ahead.py)."""
        return self.start_step(program, shape, *self._packed(program, shape, values, tables))

    def _packed(self, program, shape, values: dict, tables: list[BlockTable]):
        """(layout, packed host inputs, batch bucket) of a step over `tables` (bucket None: eager, unpadded)."""
        bucket = bucket_for(len(tables)) if self.graphs is not None else None
        layout = program.layout(shape, bucket or len(tables))
        host = layout.pack({**values, **self.block_tables.sync(tables)}, np.empty(layout.size, dtype=np.int64))
        return layout, host, bucket

    def start_step(self, program, shape, layout, host: np.ndarray, bucket: int | None) -> PendingStep:
        """`execute_step`'s launch alone (the ranks of a tensor-parallel replica run it as they run that)."""
        if bucket is not None:
            return self.graphs.launch((program.name, shape, bucket),
                                      lambda inputs: self._run_program(program, shape, layout, inputs), host)
        with torch.inference_mode():
            output = self._run_program(program, shape, layout, torch.from_numpy(host).to(self.device))
            if output.device.type != "cuda":
                return PendingStep(output.numpy())
            result = torch.empty(output.shape, dtype=output.dtype, pin_memory=True)
            result.copy_(output, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(output.device))
            return PendingStep(result, event)

    def execute_step(self, program, shape, layout, host: np.ndarray, bucket: int | None) -> np.ndarray:
        """Run a step program on its packed inputs (a graph replay when `bucket` is set). The ranks of a
        tensor-parallel replica all run this with rank 0's inputs (runtime/tensor_parallel_runner.py); a rank that
        does not decide gets None, without waiting for the device."""
        if bucket is not None:
            key = (program.name, shape, bucket)
            return self.graphs.run(key, lambda inputs: self._run_program(program, shape, layout, inputs), host,
                                   wait=self.decides)
        with torch.inference_mode():
            inputs = torch.from_numpy(host).to(self.device)
            output = self._run_program(program, shape, layout, inputs)
            return output.cpu().numpy() if self.decides else None

    def _run_program(self, program, shape, layout, inputs: torch.Tensor) -> torch.Tensor:
        fields = layout.unpack(inputs)
        self.block_tables.apply(fields["row"], fields["update_col"], fields["update_id"])
        return program.run(self, shape, fields)

    def forward_rows(self, tokens: torch.Tensor, start: torch.Tensor, write: torch.Tensor, tables: torch.Tensor,
                     max_context: int) -> torch.Tensor:
        """The forward of a step program: sequence b adds tokens[b] ([num_seqs, q] int64, padded) at positions
        start[b], start[b] + 1, ...; only tokens with write[b, j] keep their KV (the rest go to the scratch block);
        tables [num_seqs, width] int32 cover every position read. No host reads: graph-safe.
        Returns final hidden states [num_seqs * q, hidden]."""
        num_seqs, q = tokens.shape
        offsets = torch.arange(q, device=tokens.device)
        positions = start[:, None] + offsets[None, :]
        blocks = tables.gather(1, (positions // self.block_size).clamp(max=tables.shape[1] - 1)).to(torch.int64)
        scratch = self.scratch_block * self.block_size + offsets % self.block_size
        slots = torch.where(write, blocks * self.block_size + positions % self.block_size, scratch[None, :])
        meta = AttentionMetadata(
            slot_mapping=slots.reshape(-1),
            block_tables=tables,
            seq_lens=(start + q).to(torch.int32),
            query_start_loc=torch.arange(0, (num_seqs + 1) * q, q, dtype=torch.int32, device=tokens.device),
            max_query_len=q,
            max_seq_len=max_context,
        )
        return self.model(tokens.reshape(-1), positions.reshape(-1), meta, self.cache.layers)

    def context_bound(self, longest: int) -> int:
        """The context length a step's attention is sized for. With graphs one of three classes: one graph serves
        every length up to its bound (the attention kernel sizes its KV splits from the real length on the device),
        and contexts of at most 256 tokens get a kernel without split-KV overhead. Eager: the exact length."""
        if self.graphs is None:
            return longest
        limit = self.max_model_len + PADDING_POSITIONS
        return next((c for c in CONTEXT_CLASSES if longest <= c), limit) if longest <= limit else longest

    def shape_size(self, needed: int, sizes: tuple[int, ...]) -> int:
        """With graphs, the smallest of `sizes` that holds `needed` (fewer shapes: fewer graphs to capture, and one
        captured before serving covers more calls); eager, `needed` itself."""
        if self.graphs is None:
            return needed
        return next((size for size in sizes if size >= needed), needed)

    def release(self, table: BlockTable) -> None:
        """A sequence is gone: free its KV blocks and its row of the device block tables."""
        self.block_manager.free(table)
        self.block_tables.release(table)

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

