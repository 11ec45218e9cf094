"""Paged KV bookkeeping: which fixed-size blocks of the cache each sequence owns.

Paired verbs as in nano-vllm: `can_allocate`/`allocate` before a sequence's first tokens, `can_append`/`append`
before each step, `truncate` to roll back rejected speculative tokens, `free` when a sequence ends. Blocks are
reference counted so a sequence can be forked (shared prefix); writing into a shared block copies it first
(`append` returns the copies the cache must perform). Running out of blocks raises `KVCacheFull` and changes nothing.
With prefix caching, a new sequence starts on the cached blocks of its prompt's prefix (`reuse_prefix`), its prompt
blocks are remembered once written (`remember_prefix`), and freed cached blocks wait, counted as free, for reuse
(kv/prefix_cache.py).
"""

from collections import deque
from dataclasses import dataclass, field

from specsplit.services.errors import KVCacheFull
from specsplit.services.kv.prefix_cache import PrefixCache, block_keys


@dataclass
class BlockTable:
    """One sequence's blocks, in order, and how many token slots of them are filled. The runner mirrors it on the
    device (runtime/device_block_tables.py): `device_row` is where, and entries from `first_unsynced` on may have
    changed since the last upload (appends past it need no mark; a replaced or re-grown entry lowers it)."""

    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0
    device_row: int = -1
    first_unsynced: int = 0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self._free = deque(range(num_blocks))
        self.prefix_cache = PrefixCache() if prefix_caching else None

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds, idle cached ones included (they are taken back when needed)."""
        return len(self._free) + (self.prefix_cache.num_idle if self.prefix_cache else 0)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def reuse_prefix(self, table: BlockTable, token_ids: list[int], max_tokens: int) -> int:
        """Start an empty `table` on the cached blocks of `token_ids`' longest cached prefix, at most `max_tokens`
        tokens of it. Returns how many tokens it now holds (0 without prefix caching)."""
        if table.block_ids:
            raise ValueError("a prefix can only be reused by an empty block table")
        if self.prefix_cache is None:
            return 0
        cache = self.prefix_cache
        for key in block_keys(token_ids[:max_tokens], self.block_size):
            block = cache.lookup(key)
            if block is None:
                break
            if self.ref_counts[block] == 0:
                cache.unpark(block)
            self.ref_counts[block] += 1
            table.block_ids.append(block)
            table.num_tokens += self.block_size
        cache.queried_tokens += len(token_ids)
        cache.hit_tokens += table.num_tokens
        return table.num_tokens

    def remember_prefix(self, table: BlockTable, token_ids: list[int]) -> None:
        """The KV of `token_ids` (the table's first tokens) is written: remember its full blocks for reuse."""
        if self.prefix_cache is None:
            return
        written = min(len(token_ids), table.num_tokens) // self.block_size
        for block, key in zip(table.block_ids[:written], block_keys(token_ids[: written * self.block_size], self.block_size)):
            self.prefix_cache.remember(block, key)

    def blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def new_blocks_needed(self, table: BlockTable, num_new_tokens: int) -> int:
        """Blocks `append` would take: new blocks past the end, plus a copy of a shared partial last block."""
        needed = self.blocks_for(table.num_tokens + num_new_tokens) - len(table.block_ids)
        if num_new_tokens > 0 and table.num_tokens % self.block_size and self._last_is_shared(table):
            needed += 1
        return max(needed, 0)

    def can_append(self, table: BlockTable, num_new_tokens: int) -> bool:
        return self.new_blocks_needed(table, num_new_tokens) <= self.num_free_blocks

    def can_allocate(self, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) <= self.num_free_blocks

    def allocate(self, num_tokens: int) -> BlockTable:
        table = BlockTable()
        self.append(table, num_tokens)
        return table

    def append(self, table: BlockTable, num_new_tokens: int) -> list[tuple[int, int]]:
        """Make room for `num_new_tokens` more tokens. Returns (source, destination) block copies to perform."""
        needed = self.new_blocks_needed(table, num_new_tokens)
        if needed > self.num_free_blocks:
            raise KVCacheFull(
                f"KV cache full: {num_new_tokens} more tokens need {needed} blocks, {self.num_free_blocks} free "
                f"of {self.num_blocks}"
            )
        copies = []
        if num_new_tokens > 0 and table.num_tokens % self.block_size and self._last_is_shared(table):
            old = table.block_ids[-1]
            new = self._take()
            self._release(old)
            table.block_ids[-1] = new
            table.first_unsynced = min(table.first_unsynced, len(table.block_ids) - 1)
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
        table.first_unsynced = min(table.first_unsynced, keep)
        table.num_tokens = num_tokens
        if self.prefix_cache and num_tokens % self.block_size:
            last = table.block_ids[-1]
            if self.ref_counts[last] == 1:  # ours alone and about to be overwritten: no longer its cached prefix
                self.prefix_cache.forget(last)

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
        block = self._free.popleft() if self._free else self.prefix_cache.evict()
        self.ref_counts[block] = 1
        return block

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            if self.prefix_cache and self.prefix_cache.holds(block):
                self.prefix_cache.park(block)
            else:
                self._free.append(block)
