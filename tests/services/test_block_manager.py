import pytest

from specsplit.services.errors import KVCacheFull
from specsplit.services.kv.block_manager import BlockManager


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
