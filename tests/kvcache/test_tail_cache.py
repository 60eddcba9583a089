"""TailCache and the prefix cache's tails: the longest matching tail under the same chain and adapter, LRU-bounded,
evicted before any full block when blocks are needed, no KV event."""

from __future__ import annotations

from pdserve.kvcache.block_pool import BlockPool
from pdserve.kvcache.kv_events import KvEventRecorder
from pdserve.kvcache.prefix_cache import PrefixCache
from pdserve.kvcache.tail_cache import Tail, TailCache

ADA = (("lora", "ada", "/a"),)


def test_take_returns_the_longest_tail_whose_tokens_begin_the_next_tokens_and_removes_it():
    c = TailCache(max_blocks=8)
    assert c.add(Tail(3, b"p", None, (1, 2))) == [] and c.add(Tail(4, b"p", None, (1, 2, 3))) == []
    assert c.add(Tail(5, b"p", None, (1, 9))) == [] and c.add(Tail(6, b"q", None, (1, 2, 3))) == []
    assert c.take(b"p", None, [1, 2, 3, 7]).block_id == 4
    assert c.take(b"p", None, [1, 2, 3, 7]).block_id == 3  # the longer one was taken: the next longest
    assert c.take(b"p", None, [1, 2, 3, 7]) is None and len(c) == 2
    assert c.take(b"p", None, [1]) is None  # (1, 9) is longer than the tokens given
    assert c.take(b"p", ADA, [1, 9]) is None  # another adapter's chain
    assert c.take(None, None, [1, 2, 3]) is None  # the first block of a sequence: another chain
    assert c.take(b"q", None, [1, 2, 3]).block_id == 6


def test_an_equal_tail_and_tails_past_the_bound_hand_their_blocks_back_least_recently_used_first():
    c = TailCache(max_blocks=2)
    assert c.add(Tail(1, None, None, (5,))) == [] and c.add(Tail(2, None, ADA, (5,))) == []
    assert c.add(Tail(7, None, None, (5,))) == [7]  # kept already (block 1): the newcomer's block is unheld
    assert c.add(Tail(3, b"x", None, (6, 6))) == [2]  # (None, None, (5,)) was used last: ADA's goes
    assert c.take(None, ADA, [5]) is None and c.take(None, None, [5, 0]).block_id == 1
    assert TailCache(0).add(Tail(9, None, None, (1,))) == [9]


def test_the_prefix_cache_counts_tails_as_available_and_evicts_them_before_full_blocks():
    published = []
    recorder = KvEventRecorder("GPU", publisher=type("Sink", (), {"publish": lambda self, b: published.append(b)})())
    cache = PrefixCache(BlockPool(4), max_tails=2, events=recorder)
    a, b, c = cache.allocate(3)
    cache.register([a], [b"h0"], [1, 2, 3, 4])
    cache.free([a])  # a: a cached full block, evictable
    cache.keep_tail(Tail(b, b"h0", None, (5, 6)))  # b's reference now the tail's
    assert (cache.pool.num_free, cache.num_evictable, len(cache.tails), cache.num_available) == (1, 2, 1, 3)
    assert cache.allocate(2) == [3, b]  # the free block, then the tail's: the full block stays cached
    assert cache.num_cached == 1 and len(cache.tails) == 0 and cache.take_tail(b"h0", None, [5, 6, 7]) is None
    cache.free([3, b])
    cache.keep_tail(Tail(c, b"h0", None, (5,)))
    cache.clear()  # the tail goes too; the cache is empty: AllBlocksCleared
    assert cache.pool.num_free == 4 and len(cache.tails) == 0
    recorder.flush()
    kinds = [type(e).__name__ for batch in published for e in batch.events]
    assert kinds == ["BlockStored", "AllBlocksCleared"]  # nothing names a tail


def test_a_disabled_prefix_cache_keeps_no_tail():
    cache = PrefixCache(BlockPool(2), enabled=False, max_tails=2)
    block = cache.allocate(1)[0]
    cache.keep_tail(Tail(block, None, None, (1,)))
    assert cache.pool.num_free == 2 and cache.take_tail(None, None, [1, 2]) is None
