"""Paged KV bookkeeping: which fixed-size blocks of the cache each sequence owns.

Paired verbs as in nano-vllm: `can_allocate`/`allocate` before a sequence's first tokens, `can_append`/`append`
before each step, `truncate` to roll back rejected speculative tokens, `free` when a sequence ends. Blocks are
reference counted so a sequence can be forked (shared prefix); writing into a shared block copies it first
(`append` returns the copies the cache must perform). Running out of blocks raises `KVCacheFull` and changes nothing.
"""

from collections import deque
from dataclasses import dataclass, field

from specsplit.services.errors import KVCacheFull


@dataclass
class BlockTable:
    """One sequence's blocks, in order, and how many token slots of them are filled."""

    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self._free = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def new_blocks_needed(self, table: BlockTable, num_new_tokens: int) -> int:
        """Blocks `append` would take: new blocks past the end, plus a copy of a shared partial last block."""
        needed = self.blocks_for(table.num_tokens + num_new_tokens) - len(table.block_ids)
        if num_new_tokens > 0 and table.num_tokens % self.block_size and self._last_is_shared(table):
            needed += 1
        return max(needed, 0)

    def can_append(self, table: BlockTable, num_new_tokens: int) -> bool:
        return self.new_blocks_needed(table, num_new_tokens) <= len(self._free)

    def can_allocate(self, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) <= len(self._free)

    def allocate(self, num_tokens: int) -> BlockTable:
        table = BlockTable()
        self.append(table, num_tokens)
        return table

    def append(self, table: BlockTable, num_new_tokens: int) -> list[tuple[int, int]]:
        """Make room for `num_new_tokens` more tokens. Returns (source, destination) block copies to perform."""
        needed = self.new_blocks_needed(table, num_new_tokens)
        if needed > len(self._free):
            raise KVCacheFull(
                f"KV cache full: {num_new_tokens} more tokens need {needed} blocks, {len(self._free)} free "
                f"of {self.num_blocks}"
            )
        copies = []
        if num_new_tokens > 0 and table.num_tokens % self.block_size and self._last_is_shared(table):
            old = table.block_ids[-1]
            new = self._take()
            self._release(old)
            table.block_ids[-1] = new
            copies.append((old, new))
        while len(table.block_ids) < self.blocks_for(table.num_tokens + num_new_tokens):
            table.block_ids.append(self._take())
        table.num_tokens += num_new_tokens
        return copies

    def truncate(self, table: BlockTable, num_tokens: int) -> None:
        """Keep only the first `num_tokens` tokens; blocks past them go back to the pool."""
        if num_tokens > table.num_tokens or num_tokens < 0:
            raise ValueError(f"cannot truncate {table.num_tokens} tokens to {num_tokens}")
        keep = self.blocks_for(num_tokens)
        for block in table.block_ids[keep:]:
            self._release(block)
        del table.block_ids[keep:]
        table.num_tokens = num_tokens

    def fork(self, table: BlockTable) -> BlockTable:
        """A new table sharing every block of `table` (copy-on-write on the next append into a shared block)."""
        for block in table.block_ids:
            self.ref_counts[block] += 1
        return BlockTable(list(table.block_ids), table.num_tokens)

    def free(self, table: BlockTable) -> None:
        self.truncate(table, 0)

    def _last_is_shared(self, table: BlockTable) -> bool:
        return bool(table.block_ids) and self.ref_counts[table.block_ids[-1]] > 1

    def _take(self) -> int:
        block = self._free.popleft()
        self.ref_counts[block] = 1
        return block

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self._free.append(block)
