"""Prefix caching: full KV blocks of prompts, remembered by content, so a later prompt starting the same way reuses
them instead of running those tokens again (shared system prompts, chat templates, retries, preempted sequences).

A block's key is SHA-256 over its parent block's key and its own token ids, so one key names the whole prefix up to
the block's end. A cryptographic hash because keys are shared across requests and tenants: a collision would hand
one request another's KV, and Python's hash() of integers is easy to make collide on purpose.

Blocks nobody uses any more stay cached, counted as free, until the pool needs them: least recently used first.
"""

import hashlib
from array import array
from collections import OrderedDict


def block_keys(token_ids: list[int], block_size: int) -> list[bytes]:
    """One key per full block of `token_ids`, in order."""
    keys, parent = [], b""
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        digest = hashlib.sha256(parent)
        digest.update(array("q", token_ids[start : start + block_size]).tobytes())
        parent = digest.digest()
        keys.append(parent)
    return keys


class PrefixCache:
    """Which blocks hold which prefix, and which of them are idle (no sequence holds them; evictable)."""

    def __init__(self):
        self._block_by_key: dict[bytes, int] = {}
        self._key_by_block: dict[int, bytes] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # oldest first
        self.queried_tokens = 0  # prompt tokens looked up
        self.hit_tokens = 0      # of those, found in the cache (their forward was skipped)
        self.evicted_blocks = 0  # idle cached blocks taken back for new KV (many: the cache is too small to keep prefixes)

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    def lookup(self, key: bytes) -> int | None:
        return self._block_by_key.get(key)

    def holds(self, block: int) -> bool:
        return block in self._key_by_block

    def remember(self, block: int, key: bytes) -> None:
        """`block` now holds the prefix `key` names (its KV has been written). First writer wins."""
        if key not in self._block_by_key and block not in self._key_by_block:
            self._block_by_key[key] = block
            self._key_by_block[block] = key

    def forget(self, block: int) -> None:
        """`block`'s content is about to change: it no longer names its prefix."""
        key = self._key_by_block.pop(block, None)
        if key is not None:
            del self._block_by_key[key]
        self._idle.pop(block, None)

    def park(self, block: int) -> None:
        """The last sequence holding `block` let it go: keep it for reuse until evicted."""
        self._idle[block] = None

    def unpark(self, block: int) -> None:
        """An idle block was reused."""
        del self._idle[block]

    def evict(self) -> int:
        """Hand back the least recently used idle block, forgotten."""
        block = next(iter(self._idle))
        self.forget(block)
        self.evicted_blocks += 1
        return block
