"""TailCache and the prefix cache's tails: the longest matching tail under the same chain and adapter, LRU-bounded,
evicted before any full block when blocks are needed (handed to the offload tiers' spill first), no KV event; a
tail's key in the tiers is its own, never a block hash."""

from __future__ import annotations

from pdserve.kvcache.block_hash import BlockHasher
from pdserve.kvcache.block_pool import BlockPool
from pdserve.kvcache.host_store import HostStore
from pdserve.kvcache.kv_events import KvEventRecorder
from pdserve.kvcache.prefix_cache import PrefixCache
from pdserve.kvcache.tail_cache import TAIL_KEY_PREFIX, Tail, TailCache, is_tail_key, tail_key

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


def test_evicted_tails_are_handed_to_spill_before_their_blocks_are_freed():
    spilled = []
    cache = PrefixCache(BlockPool(3), max_tails=2)
    cache.tails.spill = lambda tails: spilled.append([(t.block_id, cache.pool.ref_count(t.block_id)) for t in tails])
    a, b, c = cache.allocate(3)
    cache.keep_tail(Tail(a, None, None, (1,)))
    cache.keep_tail(Tail(b, b"h", None, (2, 3)))
    cache.keep_tail(Tail(c, b"h", None, (4,)))  # past the bound: a, the least recently used, leaves
    assert spilled == [[(a, 1)]]  # still held while spilled: its KV intact
    assert cache.allocate(2) == [a, b] and spilled == [[(a, 1)], [(b, 1)]]  # taken for blocks: spilled too
    cache.keep_tail(Tail(a, None, None, (2,)))
    cache.keep_tail(Tail(b, None, None, (2,)))  # an equal tail kept already: b freed, nothing spilled
    assert len(spilled) == 2 and cache.pool.num_free == 1 and len(cache.tails) == 2


def test_a_tail_key_is_its_own_and_never_a_block_hash_nor_a_kv_event():
    key = tail_key(b"p" * 32, None, (1, 2))
    assert key == tail_key(b"p" * 32, None, [1, 2]) and key.startswith(TAIL_KEY_PREFIX) and len(key) == 45
    assert len({key, tail_key(b"p" * 32, ADA, (1, 2)), tail_key(None, None, (1, 2)), tail_key(b"p" * 32, None, (1,)),
                tail_key(b"q" * 32, None, (1, 2))}) == 5
    assert is_tail_key(key) and not is_tail_key(key[:-1]) and not is_tail_key(b"x" * 45)
    for algo in ("sha256", "sha256_cbor"):  # 32 bytes (xxhash's: 16)
        assert not is_tail_key(BlockHasher(algo).hashes([1, 2, 3, 4], 4)[0])
    published = []
    recorder = KvEventRecorder("GPU", publisher=type("Sink", (), {"publish": lambda self, b: published.append(b)})())
    host = HostStore(100, events=recorder)
    assert host.put(key, b"k" * 60) and host.put(b"h" * 32, b"b" * 60)  # the block evicts the tail: no event
    assert host.evict(b"h" * 32)
    recorder.flush()
    kinds = [(type(e).__name__, len(e.block_hashes)) for batch in published for e in batch.events]
    assert kinds == [("BlockStored", 1), ("BlockRemoved", 1)]  # the block's, none for the tail
