"""Prefix caching over a BlockPool: full blocks named by a hash chained over every token before them.

A full block's hash covers its own token ids and its parent's hash (vLLM's scheme), so equal hashes
mean equal prefixes, not just equal blocks. A registered block keeps one reference held by the cache;
while a sequence also holds it, it is in use. When only the cache holds it, it is evictable: it still
counts as free capacity, and `allocate` evicts the least recently used such blocks when the pool's
free list runs short. `enabled=False` keeps the same interface and caches nothing.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from pdserve.kvcache.block_pool import BlockPool, OutOfBlocks

HASH_BYTES = 16


def block_hashes(token_ids: list[int], block_size: int, limit: int | None = None) -> list[bytes]:
    """The chained hash of each full block of token_ids (of the first `limit` blocks when given)."""
    count = len(token_ids) // block_size if limit is None else min(limit, len(token_ids) // block_size)
    return extend_hashes([], token_ids, block_size, count)


def extend_hashes(hashes: list[bytes], token_ids: list[int], block_size: int, count: int) -> list[bytes]:
    """`hashes`, the chained hashes of token_ids' first blocks, extended in place to its first `count` full
    blocks (at most as many as it holds); returns the first `count` of them."""
    count = min(count, len(token_ids) // block_size)
    parent = hashes[-1] if hashes else b""
    for i in range(len(hashes), count):
        block = token_ids[i * block_size : (i + 1) * block_size]
        h = hashlib.blake2b(parent, digest_size=HASH_BYTES)
        h.update(b"".join(t.to_bytes(8, "little", signed=True) for t in block))
        parent = h.digest()
        hashes.append(parent)
    return hashes[:count]


class PrefixCache:
    def __init__(self, pool: BlockPool, enabled: bool = True) -> None:
        self.pool = pool
        self.enabled = enabled
        self._by_hash: dict[bytes, int] = {}
        self._lru: OrderedDict[int, bytes] = OrderedDict()
        """Every cached block id -> its hash, least recently used first."""
        self._evictable = 0
        """Cached blocks no sequence holds (ref count 1: the cache's own), kept as references change: the
        decode scheduler asks for it before every block it hands out."""

    @property
    def num_cached(self) -> int:
        """Blocks the cache holds."""
        return len(self._lru)

    @property
    def num_evictable(self) -> int:
        """Cached blocks no sequence holds."""
        return self._evictable

    @property
    def num_available(self) -> int:
        """Blocks `allocate` can hand out: free ones and evictable ones."""
        return self.pool.num_free + self.num_evictable

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

    def register(self, block_ids: list[int], hashes: list[bytes]) -> None:
        """Caches full blocks (their KV written) under their chained hashes; known hashes are skipped."""
        if not self.enabled:
            return
        for block_id, h in zip(block_ids, hashes, strict=False):
            if h in self._by_hash or block_id in self._lru:
                continue
            self.pool.incref([block_id])
            self._by_hash[h] = block_id
            self._lru[block_id] = h

    def free(self, block_ids: list[int]) -> None:
        """Drops a sequence's references; its cached blocks become the most recently used."""
        before = {b: self.pool.ref_count(b) for b in block_ids if b in self._lru}
        self.pool.free(block_ids)
        self._evictable += sum((self.pool.ref_count(b) == 1) - (held == 1) for b, held in before.items())
        for block_id in block_ids:
            if block_id in self._lru:
                self._lru.move_to_end(block_id)

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks, evicting least recently used cached blocks as needed; all or nothing."""
        short = n - self.pool.num_free
        if short > 0:
            if short > self.num_evictable:
                raise OutOfBlocks(n, self.num_available, self.pool.num_total)
            self.evict(short)
        return self.pool.allocate(n)

    def evict(self, n: int) -> list[int]:
        """Returns n evictable blocks to the pool, least recently used first; the ids evicted."""
        victims = []
        for block_id in self._lru:
            if len(victims) == n:
                break
            if self.pool.ref_count(block_id) == 1:
                victims.append(block_id)
        for block_id in victims:
            del self._by_hash[self._lru.pop(block_id)]
        self.pool.free(victims)
        self._evictable -= len(victims)
        return victims

    def clear(self) -> None:
        """Evicts every evictable block."""
        self.evict(self.num_evictable)
