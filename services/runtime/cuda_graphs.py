"""CUDA graphs for the forwards of every round after prefill: draft steps and decodes (1 token per sequence),
draft catch-ups (1-2) and verifications (k+1).

Eager, a 7B forward spends 20-40 ms of host time launching ~400 kernels for ~5 ms of GPU work at batch 1;
replaying a captured graph launches them all in one call. One graph per (q, batch bucket), captured on first use,
all in one memory pool; inputs live in static buffers sized for the largest bucket. A graph runs q tokens for every
sequence, so the batch is padded to that shape here, for every caller: a sequence with fewer tokens gets dummy
tokens after its own (causal attention keeps its real rows exact), and a batch smaller than its bucket gets dummy
sequences. Dummy tokens write their KV to one scratch block outside the block manager's pool and their rows are
dropped. The attention split count is fixed at capture for the longest context the cache holds: the kernel gives
splits past a sequence's length nothing to do, so one graph serves every context length.
"""

import torch

from specsplit.services.runtime.attention_metadata import AttentionMetadata, slots_for
from specsplit.services.runtime.host_transfer import to_device

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
MAX_GRAPH_QUERY_LEN = 17  # k+1 for k up to 16, the workers' limit


class GraphedForward:
    def __init__(self, model, kv_layers, block_size: int, scratch_block: int, max_model_len: int):
        self.model = model
        self.kv_layers = kv_layers
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.max_model_len = max_model_len
        # Room for the longest context plus a graph's dummy tokens after it.
        self.max_blocks = -(-(max_model_len + MAX_GRAPH_QUERY_LEN) // block_size)
        self.device = next(model.parameters()).device
        self.pool = torch.cuda.graph_pool_handle()
        self.capture_stream = torch.cuda.Stream(self.device)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.buffers: dict[int, dict[str, torch.Tensor]] = {}

    @staticmethod
    def bucket_for(num_seqs: int) -> int | None:
        return next((b for b in BATCH_BUCKETS if b >= num_seqs), None)

    def query_len(self, items, input_ids: torch.Tensor | None = None) -> int | None:
        """The token count q a graph would run `items` with (their longest), or None to run them eagerly."""
        if not items or self.bucket_for(len(items)) is None:
            return None
        lengths = [len(item.token_ids) for item in items]
        q = max(lengths)
        if q > MAX_GRAPH_QUERY_LEN or (input_ids is not None and min(lengths) != q):
            return None  # too long for a graph; or device-side ids, which are laid out without padding
        return q

    def run(self, items, q: int, input_ids: torch.Tensor | None) -> torch.Tensor:
        """Final hidden states [len(items) * q, hidden]: item b's tokens are rows [b*q, b*q + len), padding after.
        Items' KV slots are reserved. The result lives in the graph's memory: use it before the next call.
        `input_ids` (on the device, q per item) replaces the items' ids."""
        num_seqs = len(items)
        bucket = self.bucket_for(num_seqs)
        graph, hidden = self.graphs.get((q, bucket)) or self._capture(q, bucket)
        buffers = self.buffers[q]
        positions, slots, seq_lens, tables, ids = [], [], [], [], []
        for item in items:
            n, length = len(item.token_ids), item.table.num_tokens
            pad = q - n
            positions.extend(range(length - n, length + pad))
            slots.extend(slots_for(item.table.block_ids, range(length - n, length), self.block_size))
            slots.extend(self._scratch_slots(pad))
            seq_lens.append(length + pad)
            tables.append(item.table.block_ids)
            if input_ids is None:
                ids.extend(item.token_ids)
                ids.extend([0] * pad)
        for _ in range(bucket - num_seqs):
            positions.extend(range(q))
            slots.extend(self._scratch_slots(q))
            seq_lens.append(q)
            tables.append([])
        # Every row's table covers its whole (padded) length; positions past a sequence's blocks, which only its
        # dummy rows read, point at the scratch block.
        width = -(-max(seq_lens) // self.block_size)
        n = bucket * q
        staged = to_device(positions + slots + seq_lens + ids, torch.int64, self.device)
        buffers["positions"][:n].copy_(staged[:n])
        buffers["slots"][:n].copy_(staged[n : 2 * n])
        buffers["seq_lens"][:bucket].copy_(staged[2 * n : 2 * n + bucket])
        buffers["input_ids"][: num_seqs * q].copy_(input_ids if input_ids is not None else staged[2 * n + bucket :])
        buffers["block_tables"][:bucket, :width].copy_(
            to_device([t + [self.scratch_block] * (width - len(t)) for t in tables], torch.int32, self.device)
        )
        with torch.cuda.device(self.device):  # a graph replays on its own device's stream
            graph.replay()
        return hidden[: num_seqs * q]

    def _scratch_slots(self, count: int) -> list[int]:
        return [self.scratch_block * self.block_size + j % self.block_size for j in range(count)]

    def _static_buffers(self, q: int) -> dict[str, torch.Tensor]:
        if q not in self.buffers:
            rows, dev = BATCH_BUCKETS[-1], self.device
            self.buffers[q] = {
                "input_ids": torch.zeros(rows * q, dtype=torch.int64, device=dev),
                "positions": torch.zeros(rows * q, dtype=torch.int64, device=dev),
                "slots": torch.zeros(rows * q, dtype=torch.int64, device=dev),
                "seq_lens": torch.zeros(rows, dtype=torch.int32, device=dev),
                "block_tables": torch.zeros(rows, self.max_blocks, dtype=torch.int32, device=dev),
                "query_start_loc": torch.arange(0, (rows + 1) * q, q, dtype=torch.int32, device=dev),
            }
        return self.buffers[q]

    def _capture(self, q: int, bucket: int):
        with torch.cuda.device(self.device):  # capture runs on the current device's streams: make it this one
            return self._capture_on_device(q, bucket)

    def _capture_on_device(self, q: int, bucket: int):
        buffers = self._static_buffers(q)
        n = bucket * q
        # Every row a padding row while capturing: all writes land in the scratch block.
        buffers["positions"][:n].copy_(torch.arange(q, device=self.device).repeat(bucket))
        buffers["slots"][:n].copy_(torch.tensor(self._scratch_slots(q), device=self.device).repeat(bucket))
        buffers["seq_lens"][:bucket].fill_(q)
        buffers["block_tables"][:bucket].fill_(self.scratch_block)
        meta = AttentionMetadata(
            slot_mapping=buffers["slots"][:n],
            block_tables=buffers["block_tables"][:bucket],
            seq_lens=buffers["seq_lens"][:bucket],
            query_start_loc=buffers["query_start_loc"][: bucket + 1],
            max_query_len=q,
            max_seq_len=self.max_model_len,  # fixes the split count for the longest context
        )

        def forward():
            return self.model(buffers["input_ids"][:n], buffers["positions"][:n], meta, self.kv_layers)

        # Warm up outside the capture (compiles the Triton kernels, settles cuBLAS workspaces).
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side), torch.inference_mode():
            forward()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # An explicit capture stream on this device: torch's default one is made once, on whichever device was
        # current at the first capture in the process.
        with torch.inference_mode(), torch.cuda.graph(graph, pool=self.pool, stream=self.capture_stream):
            hidden = forward()
        self.graphs[(q, bucket)] = (graph, hidden)
        return graph, hidden
