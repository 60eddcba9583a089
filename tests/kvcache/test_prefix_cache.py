"""PrefixCache: chained block hashes, hits on the longest cached prefix, LRU eviction, exact block ids."""

from __future__ import annotations

import pytest

from pdserve.kvcache.block_pool import BlockPool, OutOfBlocks
from pdserve.kvcache.prefix_cache import PrefixCache, block_hashes, extend_hashes


def test_hashes_chain_over_every_token_before_the_block():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], block_size=4)
    assert len(a) == 2  # the partial third block has no hash
    b = block_hashes([0, 2, 3, 4, 5, 6, 7, 8], block_size=4)
    assert a[0] != b[0] and a[1] != b[1]  # same second block, different parent
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4) == a
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, limit=1) == a[:1]


def test_a_released_prefix_is_reused_with_its_block_ids():
    pool = BlockPool(8)
    cache = PrefixCache(pool)
    tokens = list(range(10))
    hashes = block_hashes(tokens, 4)
    table = cache.allocate(3)
    assert table == [0, 1, 2]
    cache.register(table[:2], hashes)
    cache.free(table)
    assert (pool.num_free, cache.num_cached, cache.num_evictable, cache.num_available) == (6, 2, 2, 8)
    assert cache.lookup(block_hashes(tokens[:8] + [99, 99, 99, 99], 4)) == [0, 1]
    assert cache.lookup(block_hashes([0, 1, 2, 3, 9, 9, 9, 9], 4)) == [0]  # only the first block matches
    assert [pool.ref_count(b) for b in (0, 1)] == [3, 2]
    assert cache.num_evictable == 0
    cache.free([0, 1, 0])
    assert pool.num_free + cache.num_evictable == 8


def test_allocation_evicts_least_recently_used_cached_blocks_first():
    pool = BlockPool(4)
    cache = PrefixCache(pool)
    first, second = block_hashes([1] * 8, 4), block_hashes([2] * 8, 4)
    a = cache.allocate(2)  # [0, 1]
    cache.register(a, first)
    b = cache.allocate(2)  # [2, 3]
    cache.register(b, second)
    cache.free(b)
    cache.free(a)  # a is now the most recently used
    assert pool.num_free == 0 and cache.num_available == 4
    assert cache.allocate(1) == [2]  # evicts b's first block
    assert cache.lookup(second) == []  # its chain is broken at the first block
    assert cache.lookup(first) == [0, 1]
    assert cache.allocate(1) == [3]
    with pytest.raises(OutOfBlocks):
        cache.allocate(1)  # 0 and 1 are held by the lookup: not evictable
    cache.free([0, 1])
    cache.free([2, 3])
    cache.clear()
    assert pool.num_free == 4 and cache.num_cached == 0


def test_a_known_hash_is_not_registered_twice():
    pool = BlockPool(4)
    cache = PrefixCache(pool)
    hashes = block_hashes([5] * 4, 4)
    a, b = cache.allocate(1), cache.allocate(1)
    cache.register(a, hashes)
    cache.register(b, hashes)  # the same prefix computed twice: the second copy is freed normally
    cache.free(a + b)
    assert (pool.num_free, cache.num_cached) == (3, 1)
    assert cache.lookup(hashes) == a


def test_disabled_caches_nothing():
    pool = BlockPool(4)
    cache = PrefixCache(pool, enabled=False)
    table = cache.allocate(2)
    cache.register(table, block_hashes([1] * 8, 4))
    cache.free(table)
    assert cache.lookup(block_hashes([1] * 8, 4)) == [] and pool.num_free == 4


def test_num_evictable_follows_every_operation():
    """The evictable count is kept as references change (the decode scheduler reads it per block): after
    every step of a seeded random mix of lookups, registrations, frees, allocations and evictions it equals
    the count of cached blocks whose only reference is the cache's."""
    import random

    from pdserve.kvcache.block_pool import BlockPool, OutOfBlocks
    from pdserve.kvcache.prefix_cache import PrefixCache, block_hashes, extend_hashes

    rng = random.Random(7)
    pool = BlockPool(24)
    cache = PrefixCache(pool)
    held: list[list[int]] = []
    for _ in range(2000):
        op = rng.random()
        if op < 0.35:
            tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 5) * 4)]  # few values: shared prefixes
            hashes = block_hashes(tokens, 4)
            hits = cache.lookup(hashes)
            try:
                fresh = cache.allocate(len(hashes) - len(hits))
            except OutOfBlocks:
                cache.free(hits)
                continue
            blocks = hits + fresh
            cache.register(blocks, hashes)
            held.append(blocks)
        elif op < 0.7 and held:
            cache.free(held.pop(rng.randrange(len(held))))
        elif op < 0.8:
            cache.evict(rng.randrange(3))
        elif op < 0.85:
            cache.clear()
        assert cache.num_evictable == sum(1 for b in cache._lru if pool.ref_count(b) == 1)
    for blocks in held:
        cache.free(blocks)
    assert cache.num_evictable == cache.num_cached


def test_hashes_extended_block_by_block_equal_the_whole_chain():
    tokens = list(range(40, 58))  # 4 full blocks of 4, and 2 tokens
    known: list[bytes] = []
    assert extend_hashes(known, tokens, 4, 1) == block_hashes(tokens, 4)[:1] and len(known) == 1
    assert extend_hashes(known, tokens, 4, 3) == block_hashes(tokens, 4)[:3]
    assert extend_hashes(known, tokens, 4, 9) == block_hashes(tokens, 4) and len(known) == 4  # full blocks only
    assert extend_hashes(known, tokens, 4, 2) == known[:2] and len(known) == 4
