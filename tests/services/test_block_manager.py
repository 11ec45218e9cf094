import pytest

from specsplit.services.errors import KVCacheFull
from specsplit.services.kv.block_manager import BlockManager, BlockTable


def test_allocate_append_truncate_free_returns_every_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    table = bm.allocate(6)
    assert len(table.block_ids) == 2 and table.num_tokens == 6
    bm.append(table, 3)
    assert len(table.block_ids) == 3 and bm.num_free_blocks == 5
    bm.truncate(table, 4)  # roll back rejected tokens
    assert len(table.block_ids) == 1 and table.num_tokens == 4 and bm.num_free_blocks == 7
    bm.free(table)
    assert bm.num_free_blocks == 8 and all(c == 0 for c in bm.ref_counts)


def test_running_out_raises_and_changes_nothing():
    bm = BlockManager(num_blocks=2, block_size=4)
    table = bm.allocate(5)
    assert not bm.can_append(table, 4)
    with pytest.raises(KVCacheFull, match="KV cache full"):
        bm.append(table, 4)
    assert table.num_tokens == 5 and len(table.block_ids) == 2 and bm.num_free_blocks == 0
    with pytest.raises(KVCacheFull):
        bm.allocate(1)


def test_fork_shares_blocks_and_copies_on_write():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = bm.allocate(6)
    child = bm.fork(parent)
    assert child.block_ids == parent.block_ids
    assert bm.ref_counts[parent.block_ids[1]] == 2
    copies = bm.append(child, 1)  # writes into the shared, partly filled last block
    assert copies == [(parent.block_ids[1], child.block_ids[1])]
    assert child.block_ids[0] == parent.block_ids[0] and child.block_ids[1] != parent.block_ids[1]
    bm.free(parent)
    bm.free(child)
    assert bm.num_free_blocks == 8


def test_truncate_beyond_length_is_an_error():
    bm = BlockManager(num_blocks=4, block_size=4)
    table = bm.allocate(3)
    with pytest.raises(ValueError):
        bm.truncate(table, 4)


def cached_manager(num_blocks=8, block_size=4):
    return BlockManager(num_blocks=num_blocks, block_size=block_size, prefix_caching=True)


def start(bm, prompt, max_tokens=None):
    """A sequence as a worker starts one: reuse what is cached, reserve the rest, then remember the prompt."""
    table = BlockTable()
    hit = bm.reuse_prefix(table, prompt, len(prompt) - 1 if max_tokens is None else max_tokens)
    bm.append(table, len(prompt) - hit)
    bm.remember_prefix(table, prompt)
    return table, hit


def test_prompt_blocks_are_reused_after_their_sequence_ends():
    bm = cached_manager()
    first, hit = start(bm, list(range(10)))
    assert hit == 0
    blocks = list(first.block_ids)
    bm.free(first)
    assert bm.num_free_blocks == 8 and bm.num_used_blocks == 0  # idle cached blocks count as free
    second, hit = start(bm, list(range(10)) + [99, 98])
    assert hit == 8 and second.block_ids[:2] == blocks[:2]  # two full blocks; the partial third never is cached
    assert bm.prefix_cache.hit_tokens == 8 and bm.prefix_cache.queried_tokens == 22


def test_a_block_is_reused_only_under_the_same_whole_prefix():
    bm = cached_manager(num_blocks=16)
    table, _ = start(bm, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    _, hit = start(bm, [0, 2, 3, 4, 5, 6, 7, 8, 9])  # second block's tokens equal, first differs
    assert hit == 0
    _, hit = start(bm, [1, 2, 3, 4, 5, 6, 7, 0, 9])
    assert hit == 4
    shared, hit = start(bm, [1, 2, 3, 4, 5, 6, 7, 8, 9])  # running sequences share too
    assert hit == 8 and shared.block_ids[:2] == table.block_ids[:2] and bm.ref_counts[table.block_ids[0]] == 3


def test_the_last_prompt_token_is_left_to_run_when_asked():
    bm = cached_manager()
    start(bm, list(range(8)))
    _, hit = start(bm, list(range(8)))  # max_tokens = 7: the second block cannot be used whole
    assert hit == 4


def test_idle_cached_blocks_are_evicted_least_recently_used_first():
    bm = cached_manager(num_blocks=5)
    a, _ = start(bm, [1] * 9)  # two full cached blocks and a partial one
    b, _ = start(bm, [2] * 5)  # one full cached block and a partial one
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 5 and bm.prefix_cache.num_idle == 3
    c, hit = start(bm, [3] * 12)  # three blocks: the two plain free ones, then the oldest idle one (a's first)
    assert hit == 0 and bm.num_free_blocks == 2
    _, hit = start(bm, [2] * 5)  # b's block is still cached; its partial block evicts a's second
    assert hit == 4 and bm.num_free_blocks == 0
    assert bm.reuse_prefix(BlockTable(), [1] * 9, 8) == 0  # a's prefix is gone
    assert bm.prefix_cache.evicted_blocks == 2
    with pytest.raises(KVCacheFull):
        bm.allocate(1)


def test_a_cached_block_written_over_is_forgotten():
    bm = cached_manager()
    table, _ = start(bm, list(range(8)))
    bm.truncate(table, 6)  # rollback into a cached block held by this sequence alone
    bm.append(table, 2)    # new tokens 6, 7 would land in it: it must no longer name [4..7]
    bm.free(table)
    _, hit = start(bm, list(range(8)) + [50])
    assert hit == 4


def test_a_shared_cached_block_is_copied_before_it_is_written():
    bm = cached_manager()
    a, _ = start(bm, list(range(8)))
    b, hit = start(bm, list(range(8)) + [1])
    assert hit == 8 and b.block_ids[1] == a.block_ids[1]
    bm.truncate(b, 6)
    copies = bm.append(b, 1)
    assert copies == [(a.block_ids[1], b.block_ids[1])] and b.block_ids[1] != a.block_ids[1]
    bm.free(b)
    bm.free(a)
    _, hit = start(bm, list(range(8)) + [1])
    assert hit == 8  # the original block still names the prefix


def test_without_prefix_caching_nothing_is_reused():
    bm = BlockManager(num_blocks=8, block_size=4)
    first, hit = start(bm, list(range(10)))
    bm.free(first)
    _, hit = start(bm, list(range(10)))
    assert hit == 0 and bm.prefix_cache is None
