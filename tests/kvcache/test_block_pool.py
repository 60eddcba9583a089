"""BlockPool: exact ids handed out, freed, reused FIFO; ref counts; all-or-nothing; double free."""

from __future__ import annotations

import pytest

from pdserve.kvcache.block_pool import BlockPool, OutOfBlocks


def test_fresh_pool_hands_out_lowest_ids_first():
    pool = BlockPool(8)
    assert (pool.num_total, pool.num_free) == (8, 8)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) == [3, 4]
    assert pool.allocate(0) == []
    assert pool.num_free == 3
    assert [pool.ref_count(i) for i in range(8)] == [1, 1, 1, 1, 1, 0, 0, 0]


def test_freed_ids_are_reused_fifo_after_the_never_used_ones():
    pool = BlockPool(6)
    a = pool.allocate(4)  # [0, 1, 2, 3]
    pool.free([a[2], a[0]])
    assert pool.num_free == 4
    assert pool.allocate(2) == [4, 5]
    assert pool.allocate(2) == [2, 0]
    pool.free([3])
    pool.free([1, 5])
    assert pool.allocate(3) == [3, 1, 5]
    assert pool.num_free == 0


def test_out_of_blocks_is_all_or_nothing():
    pool = BlockPool(4)
    assert pool.allocate(3) == [0, 1, 2]
    with pytest.raises(OutOfBlocks, match=r"asked for 2 KV blocks but only 1 of 4 are free") as err:
        pool.allocate(2)
    assert (err.value.requested, err.value.free, err.value.total) == (2, 1, 4)
    assert pool.num_free == 1
    assert pool.allocate(1) == [3]


def test_ref_counts_keep_shared_blocks_until_the_last_free():
    pool = BlockPool(4)
    blocks = pool.allocate(2)  # [0, 1]
    pool.incref(blocks)
    pool.incref([0])
    assert (pool.ref_count(0), pool.ref_count(1)) == (3, 2)
    pool.free(blocks)
    assert (pool.ref_count(0), pool.ref_count(1), pool.num_free) == (2, 1, 2)
    pool.free(blocks)
    assert (pool.ref_count(0), pool.ref_count(1), pool.num_free) == (1, 0, 3)
    pool.free([0])
    assert pool.num_free == 4
    assert pool.allocate(4) == [2, 3, 1, 0]


def test_double_free_raises_and_changes_nothing():
    pool = BlockPool(4)
    pool.allocate(2)  # [0, 1]
    pool.free([1])
    with pytest.raises(ValueError, match=r"cannot free block 1 1 time\(s\): it is already free"):
        pool.free([0, 1])
    assert (pool.ref_count(0), pool.num_free) == (1, 3)
    with pytest.raises(ValueError, match=r"cannot free block 0 2 time\(s\): it is held 1 time\(s\)"):
        pool.free([0, 0])
    assert (pool.ref_count(0), pool.num_free) == (1, 3)
    pool.free([0])
    assert pool.allocate(4) == [2, 3, 1, 0]


def test_bad_ids_and_sizes_are_refused():
    pool = BlockPool(2)
    with pytest.raises(ValueError, match=r"block id 2 is outside this pool's 0\.\.1"):
        pool.ref_count(2)
    with pytest.raises(ValueError, match=r"outside"):
        pool.free([-1])
    with pytest.raises(ValueError, match=r"cannot share block 0: it is free"):
        pool.incref([0])
    with pytest.raises(ValueError, match=r"negative"):
        pool.allocate(-1)
    with pytest.raises(ValueError, match=r"at least one block"):
        BlockPool(0)
