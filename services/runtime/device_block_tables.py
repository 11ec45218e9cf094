"""Every sequence's block table mirrored as one row of a device tensor, sent to the device only where it changed.

Step programs look up KV slots on the device (`tables[row, position // block_size]`), so a call uploads block ids
only for blocks that changed since the sequence's last call: usually none, one when a sequence crosses into a new
block. A `BlockTable` records the first entry the device may not have (`first_unsynced`); this class assigns rows
and applies the changes with one copy and one scatter for the whole batch. Unused entries point at the scratch
block, and one extra row (`padding_row`) is all scratch, for the dummy sequences that pad a batch to its graph.
"""

import numpy as np
import torch

from specsplit.services.kv.block_manager import BlockTable


class DeviceBlockTables:
    def __init__(self, max_blocks_per_seq: int, scratch_block: int, device, rows: int = 256, on_grow=None):
        self.width = max_blocks_per_seq
        self.scratch_block = scratch_block
        self.device = torch.device(device)
        self.on_grow = on_grow  # called after the tensor is replaced (captured graphs held the old one)
        self._allocate(rows)
        self._free_rows: list[int] = list(range(rows - 1, -1, -1))
        self._staging: torch.Tensor | None = None  # pinned host buffer for the entries a call uploads
        self._staged: torch.cuda.Event | None = None

    @property
    def padding_row(self) -> int:
        return self.tables.shape[0] - 1

    def rows(self, tables: list[BlockTable]) -> np.ndarray:
        """Rows of `tables` (assigned on first use), with every change since their last call on the device."""
        rows = np.empty(len(tables), dtype=np.int64)
        changed_rows, changed_cols, changed_ids = [], [], []
        for i, table in enumerate(tables):
            if table.device_row < 0:
                table.device_row = self._take_row()
                table.first_unsynced = 0
            rows[i] = table.device_row
            first, count = table.first_unsynced, len(table.block_ids)
            if first < count:
                changed_rows.append(np.full(count - first, table.device_row))
                changed_cols.append(np.arange(first, count))
                changed_ids.append(table.block_ids[first:])
                table.first_unsynced = count
        if changed_rows:
            self._apply(np.concatenate(changed_rows), np.concatenate(changed_cols), np.concatenate(changed_ids))
        return rows

    def _apply(self, rows: np.ndarray, cols: np.ndarray, ids: np.ndarray) -> None:
        """tables[rows, cols] = ids on the device: one copy of the three columns, one scatter."""
        count = len(rows)
        if self.device.type != "cuda":
            self.tables[torch.from_numpy(rows), torch.from_numpy(cols)] = torch.from_numpy(ids).to(torch.int32)
            return
        if self._staging is None or self._staging.numel() < 3 * count:
            self._staging = torch.empty(max(3 * count, 2 * (0 if self._staging is None else self._staging.numel())),
                                        dtype=torch.int64, pin_memory=True)
        # The staging buffer is reused: wait for the copy of the previous call before overwriting it.
        if self._staged is not None:
            self._staged.synchronize()
        staging = self._staging[: 3 * count]  # contiguous, so the copy below stays asynchronous
        staging.numpy().reshape(3, count)[:] = (rows, cols, ids)
        update = staging.to(self.device, non_blocking=True).view(3, count)
        self._staged = torch.cuda.Event()
        self._staged.record(torch.cuda.current_stream(self.device))
        self.tables[update[0], update[1]] = update[2].to(torch.int32)

    def release(self, table: BlockTable) -> None:
        """The sequence is gone: its row is free (stale entries are overwritten before the row is read again)."""
        if table.device_row >= 0:
            self._free_rows.append(table.device_row)
            table.device_row = -1

    def gather(self, rows: torch.Tensor, width: int) -> torch.Tensor:
        """[len(rows), width] int32 block tables of the given rows (a copy: safe to read inside a graph)."""
        return self.tables[rows, :width]

    def _take_row(self) -> int:
        if not self._free_rows:
            old = self.tables
            count = old.shape[0] - 1
            self._allocate(2 * count)
            self.tables[:count] = old[:count]
            self._free_rows = list(range(2 * count - 1, count - 1, -1))
            if self.on_grow is not None:
                self.on_grow()
        return self._free_rows.pop()

    def _allocate(self, rows: int) -> None:
        self.tables = torch.full((rows + 1, self.width), self.scratch_block, dtype=torch.int32, device=self.device)
