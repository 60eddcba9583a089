"""Prefix caching over a BlockPool: full blocks named by vLLM's block hash, chained over every token before them.

A full block's hash covers its own token ids and its parent's hash, computed exactly as vLLM computes it for the
configured `--prefix-caching-hash-algo` (`block_hash.BlockHasher`), so equal hashes mean equal prefixes and the
name a block has here is the one vLLM, KV events and external routers give it. A registered block keeps one
reference held by the cache; while a sequence also holds it, it is in use. When only the cache holds it, it is
evictable: it still counts as free capacity, and `allocate` evicts the least recently used such blocks when the
pool's free list runs short. `enabled=False` keeps the same interface and caches nothing.

With a `KvEventRecorder` (`kv_events.py`), what the cache stores and evicts becomes KV events: each `register`
call's newly cached blocks one `BlockStored` per consecutive run (a hit, a known hash: nothing), each eviction a
`BlockRemoved`, a `clear` that empties the cache `AllBlocksCleared`. The worker flushes them once a step.

With a `spill` callback (the offload tiers, `tiered_store.py`), every evicted block is handed to it, (block id,
hash) each, before its id returns to the pool: the worker copies its KV out while it is still intact.

With `max_tails`, ended sequences' last partial blocks are kept too (`tail_cache.py`: `keep_tail`, `take_tail`),
each counted as available capacity and evicted before any full block when blocks are needed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from pdserve.kvcache.adapter_key import AdapterKey
from pdserve.kvcache.block_hash import DEFAULT_HASHER, BlockHasher
from pdserve.kvcache.block_pool import BlockPool, OutOfBlocks
from pdserve.kvcache.kv_events import KvEventRecorder
from pdserve.kvcache.tail_cache import Tail, TailCache


def block_hashes(token_ids: list[int], block_size: int, limit: int | None = None,
                 hasher: BlockHasher = DEFAULT_HASHER) -> list[bytes]:
    """The chained hash of each full block of token_ids (of the first `limit` blocks when given)."""
    return hasher.hashes(token_ids, block_size, limit)


def extend_hashes(hashes: list[bytes], token_ids: list[int], block_size: int, count: int,
                  hasher: BlockHasher = DEFAULT_HASHER) -> list[bytes]:
    """`hashes`, the chained hashes of token_ids' first blocks, extended in place to its first `count` full
    blocks (at most as many as it holds); returns the first `count` of them."""
    return hasher.extend(hashes, token_ids, block_size, count)


class PrefixCache:
    def __init__(self, pool: BlockPool, enabled: bool = True, *, hasher: BlockHasher = DEFAULT_HASHER,
                 events: KvEventRecorder | None = None,
                 spill: Callable[[list[tuple[int, bytes]]], None] | None = None, max_tails: int = 0) -> None:
        """max_tails: at most this many partial blocks kept as tails (0: none)."""
        self.pool = pool
        self.enabled = enabled
        self.hasher = hasher
        """Names blocks: its callers hash their tokens with it (`hashes`, `extend`)."""
        self.events = events if enabled else None
        self.spill = spill
        """Takes each evicted block's (id, hash) before the id is free again (the offload tiers' save)."""
        self._by_hash: dict[bytes, int] = {}
        self._lru: OrderedDict[int, bytes] = OrderedDict()
        """Every cached block id -> its hash, least recently used first."""
        self._evictable = 0
        """Cached blocks no sequence holds (ref count 1: the cache's own), kept as references change: the
        decode scheduler asks for it before every block it hands out."""
        self.tails = TailCache(max_tails if enabled else 0)
        """Ended sequences' last partial blocks, each block held by the tail alone."""

    @property
    def num_cached(self) -> int:
        """Blocks the cache holds."""
        return len(self._lru)

    @property
    def num_evictable(self) -> int:
        """Cached blocks no sequence holds, and tails."""
        return self._evictable + len(self.tails)

    @property
    def num_available(self) -> int:
        """Blocks `allocate` can hand out: free ones and evictable ones (tails too)."""
        return self.pool.num_free + self.num_evictable

    def keep_tail(self, tail: Tail) -> None:
        """Keeps a partial block's KV as a tail, taking over the reference its caller holds to the block (a tail
        equal to a kept one, or one past the bound, has it freed)."""
        self.pool.free(self.tails.add(tail))

    def take_tail(self, parent: bytes | None, extra_keys: tuple | None, tokens: list[int]) -> Tail | None:
        """The longest kept tail after the chain `parent` (and adapter) whose tokens begin `tokens`, taken out: its
        block's reference is the caller's until it gives the tail back (`keep_tail`) or frees it."""
        return self.tails.take(parent, extra_keys, tokens) if self.enabled else None

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The cached blocks of the longest cached prefix of `hashes`, one reference each taken."""
        if not self.enabled:
            return []
        hits: list[int] = []
        for h in hashes:
            block_id = self._by_hash.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        self._evictable -= sum(1 for b in hits if self.pool.ref_count(b) == 1)
        self.pool.incref(hits)
        for block_id in hits:
            self._lru.move_to_end(block_id)
        return hits

    def register(self, block_ids: list[int], hashes: list[bytes], token_ids: list[int] | None = None,
                 parent: bytes | None = None, adapter: AdapterKey | None = None) -> None:
        """Caches full blocks (their KV written) under their chained hashes; known hashes are skipped.

        token_ids: the blocks' tokens, parent: the hash before hashes[0] (None: the chain's first block), adapter:
        the LoRA adapter their KV was computed with (its key is in the hashes already); the KV events'
        BlockStored carry them (needed only with a recorder)."""
        if not self.enabled:
            return
        run: list[bytes] = []
        run_start = 0
        for i, (block_id, h) in enumerate(zip(block_ids, hashes, strict=False)):
            if h in self._by_hash or block_id in self._lru:
                self._stored(run, run_start, hashes, token_ids, parent, len(block_ids), adapter)
                run = []
                continue
            if not run:
                run_start = i
            run.append(h)
            self.pool.incref([block_id])
            self._by_hash[h] = block_id
            self._lru[block_id] = h
        self._stored(run, run_start, hashes, token_ids, parent, len(block_ids), adapter)

    def _stored(self, run: list[bytes], start: int, hashes: list[bytes], token_ids: list[int] | None,
                parent: bytes | None, num_blocks: int, adapter: AdapterKey | None = None) -> None:
        if not run or self.events is None:
            return
        if token_ids is None:
            raise ValueError("PrefixCache.register: a cache that records KV events needs the blocks' token_ids")
        block_size = len(token_ids) // num_blocks
        self.events.stored(run, hashes[start - 1] if start else parent,
                           token_ids[start * block_size : (start + len(run)) * block_size], block_size, adapter)

    def free(self, block_ids: list[int]) -> None:
        """Drops a sequence's references; its cached blocks become the most recently used."""
        before = {b: self.pool.ref_count(b) for b in block_ids if b in self._lru}
        self.pool.free(block_ids)
        self._evictable += sum((self.pool.ref_count(b) == 1) - (held == 1) for b, held in before.items())
        for block_id in block_ids:
            if block_id in self._lru:
                self._lru.move_to_end(block_id)

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks, evicting tails, then least recently used cached blocks, as needed; all or nothing."""
        short = n - self.pool.num_free
        if short > 0:
            if short > self.num_evictable:
                raise OutOfBlocks(n, self.num_available, self.pool.num_total)
            tails = self.tails.evict(short)
            self.pool.free(tails)
            if short > len(tails):
                self.evict(short - len(tails))
        return self.pool.allocate(n)

    def evict(self, n: int, announce: bool = True) -> list[int]:
        """Returns n evictable blocks to the pool, least recently used first; the ids evicted (each a
        BlockRemoved event unless `announce` is False)."""
        victims = []
        for block_id in self._lru:
            if len(victims) == n:
                break
            if self.pool.ref_count(block_id) == 1:
                victims.append(block_id)
        evicted = []
        for block_id in victims:
            h = self._lru.pop(block_id)
            del self._by_hash[h]
            evicted.append((block_id, h))
            if self.events is not None and announce:
                self.events.removed(h)
        if self.spill is not None and evicted:
            self.spill(evicted)
        self.pool.free(victims)
        self._evictable -= len(victims)
        return victims

    def clear(self) -> None:
        """Evicts every evictable block and every tail: one AllBlocksCleared event when that empties the cache
        (vLLM's reset_prefix_cache), else a BlockRemoved each."""
        self.pool.free(self.tails.evict(len(self.tails)))
        empties = self._evictable == self.num_cached
        self.evict(self._evictable, announce=not empties)
        if empties and self.events is not None:
            self.events.cleared()
