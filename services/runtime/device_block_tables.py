"""Every sequence's block table mirrored as one row of a device tensor, sent to the device only where it changed.

Step programs look up KV slots on the device (`tables[row, position // block_size]`), so a call carries block ids
only for blocks that changed since the sequence's last call: usually none, one when a sequence crosses into a new
block. A `BlockTable` records the first entry the device may not have (`first_unsynced`). Up to UPDATE_SLOTS
changed entries per sequence travel inside the call's own input buffer and the step program writes them before it
reads the tables (`apply`), so keeping the tables current costs no copy or launch of its own; a sequence with more
changes (its first call after a prefill) has them written beforehand with one copy and one scatter. Row 0 is all
scratch: padding sequences (and unused update slots) point there. Unused entries point at the scratch block.
"""

import numpy as np
import torch

from specsplit.services.kv.block_manager import BlockTable

UPDATE_SLOTS = 4  # changed entries per sequence a call carries in its inputs
PADDING_ROW = 0


class DeviceBlockTables:
    def __init__(self, max_blocks_per_seq: int, scratch_block: int, device, rows: int = 256, on_grow=None):
        self.width = max_blocks_per_seq
        self.scratch_block = scratch_block
        self.device = torch.device(device)
        self.on_grow = on_grow  # called after the tensor is replaced (captured graphs held the old one)
        # Called with ("write", rows, cols, ids) / ("grow", rows) before this mirror changes outside a step program:
        # the other ranks of a tensor-parallel replica make the same change (runtime/tensor_parallel_runner.py).
        self.on_change = None
        self._allocate(rows)
        self._free_rows: list[int] = list(range(rows, 0, -1))

    def sync(self, tables: list[BlockTable]) -> dict[str, np.ndarray]:
        """Rows of `tables` (assigned on first use) and their changes since the last call, as step-program fields:
        "row" [n], "update_col" and "update_id" [n, UPDATE_SLOTS] (column -1: unused). Changes that do not fit the
        slots are written to the device now."""
        n = len(tables)
        rows = np.empty(n, dtype=np.int64)
        cols = np.full((n, UPDATE_SLOTS), -1, dtype=np.int64)
        ids = np.zeros((n, UPDATE_SLOTS), dtype=np.int64)
        overflow = []
        for i, table in enumerate(tables):
            if table.device_row < 0:
                table.device_row = self._take_row()
                table.first_unsynced = 0
            rows[i] = table.device_row
            first, count = table.first_unsynced, len(table.block_ids)
            if first < count:
                if count - first <= UPDATE_SLOTS:
                    cols[i, : count - first] = range(first, count)
                    ids[i, : count - first] = table.block_ids[first:]
                else:
                    overflow.append((table.device_row, first, table.block_ids[first:]))
                table.first_unsynced = count
        if overflow:
            self._write([np.full(len(b), r) for r, _, b in overflow], [np.arange(f, f + len(b)) for _, f, b in overflow],
                        [np.asarray(b) for _, _, b in overflow])
        return {"row": rows, "update_col": cols, "update_id": ids}

    def apply(self, rows: torch.Tensor, update_col: torch.Tensor, update_id: torch.Tensor) -> None:
        """Inside a step program: write the updates a call carries (unused slots rewrite row 0's scratch entry)."""
        used = update_col >= 0
        target_rows = torch.where(used, rows[:, None], PADDING_ROW)
        self.tables[target_rows.reshape(-1), update_col.clamp(min=0).reshape(-1)] = torch.where(
            used, update_id, self.scratch_block).reshape(-1).to(torch.int32)

    def release(self, table: BlockTable) -> None:
        """The sequence is gone: its row is free (stale entries are overwritten before the row is read again)."""
        if table.device_row >= 0:
            self._free_rows.append(table.device_row)
            table.device_row = -1

    def gather(self, rows: torch.Tensor, width: int) -> torch.Tensor:
        """[len(rows), width] int32 block tables of the given rows (a copy: safe to read inside a graph)."""
        return self.tables[rows, :width]

    def _write(self, rows: list, cols: list, ids: list) -> None:
        self.write(np.stack([np.concatenate(rows), np.concatenate(cols), np.concatenate(ids)]))

    def write(self, update: np.ndarray) -> None:
        """Write entries [3, n] (rows, columns, block ids) now."""
        if self.on_change is not None:
            self.on_change(("write", update))
        update = torch.from_numpy(update).to(self.device)
        self.tables[update[0], update[1]] = update[2].to(torch.int32)

    def _take_row(self) -> int:
        if not self._free_rows:
            count = self.tables.shape[0]
            self.grow()
            self._free_rows = list(range(2 * count, count - 1, -1))
        return self._free_rows.pop()

    def grow(self) -> None:
        """Twice the rows (the old ones kept)."""
        if self.on_change is not None:
            self.on_change(("grow",))
        old = self.tables
        count = old.shape[0]
        self._allocate(2 * count)
        self.tables[:count] = old
        if self.on_grow is not None:
            self.on_grow()

    def _allocate(self, rows: int) -> None:
        """`rows` sequences plus the padding row 0."""
        self.tables = torch.full((rows + 1, self.width), self.scratch_block, dtype=torch.int32, device=self.device)
