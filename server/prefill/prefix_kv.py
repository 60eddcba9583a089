"""PrefixKv: the KV of recently prefilled prompts' full blocks, kept by the prefill worker for reuse.

The same scheme as the decode tier's prefix cache, and its code: logical blocks from a
`kvcache.BlockPool` named by vLLM's block hash (`kvcache.block_hash`: each block's hash chains over every
token before it) and evicted least recently used by `PrefixCache`; the physical storage here is one
host array per k and v, [blocks, L, block_size, Hkv, D] in the compute dtype, sized by the byte budget.

Life of a prefix:
1. `store(tokens, k, v)` after a prompt's prefill: its full blocks not cached yet are written (evicting
   the least recently used blocks when the budget is full) and registered under their hashes; with a
   KV event recorder, what it stored and evicted is published as one batch (medium "CPU").
2. `lookup(tokens)` for a new prompt: the KV of its longest cached prefix, copied out (so eviction
   cannot pull it from under a running prompt), always leaving at least the last token to compute
   (its logits give the first token). The prompt then prefills from there: chunked prefill whose
   first chunk's context is that prefix.

A LoRA adapter's prompt hashes its blocks with the adapter's extra key (`kvcache/adapter_key.py`, as vLLM's and the
decode tier's do): its KV is found only by prompts of the same adapter, and its KV events name it.

With offload tiers (`kvcache/tiered_store.py`, `--kv-offloading-*`), each block the cache evicts is saved to them
(its bytes copied at once, written by the store's saver thread), and so is each block `store` finds no room for, and `fetch(tokens)`, awaited before the prompt is
queued, loads the blocks after the cached prefix that a tier holds (on a loader thread, while steps run), which
`lookup` then continues the cached prefix with (and caches them as far as the budget allows). A tier's block is the same bytes a decode worker's cache saves for the same
layout (`kvcache/block_bytes.py`): through a shared directory each tier reads what the other stored.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np

from pdserve.kvcache.adapter_key import AdapterKey, extra_keys
from pdserve.kvcache.block_bytes import BlockKv, unpack_block
from pdserve.kvcache.block_hash import DEFAULT_HASHER, BlockHasher
from pdserve.kvcache.block_pool import BlockPool
from pdserve.kvcache.kv_events import KvEventRecorder
from pdserve.kvcache.layout import KvLayout, LayoutKind
from pdserve.kvcache.prefix_cache import PrefixCache
from pdserve.kvcache.tiered_store import TieredStore

@dataclass
class Fetched:
    """Blocks `fetch` loaded from the offload tiers: the prompt's blocks start, start + 1, ..."""

    start: int
    blocks: list[BlockKv]


BLOCK_SIZE = 16
"""Tokens per cached block (whatever the decode worker's block size: hits are rounded down to its)."""


class PrefixKv:
    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int, dtype, budget_bytes: int,
                 block_size: int = BLOCK_SIZE, hasher: BlockHasher = DEFAULT_HASHER,
                 kv_events: KvEventRecorder | None = None, offload: TieredStore | None = None,
                 kind: LayoutKind = "heads"):
        """kind mla_latent: each block holds MLA latent entries (num_kv_heads 1, head_dim the entry's width), no V."""
        self.block_size = block_size
        self.layout = KvLayout.of(num_layers, num_kv_heads, head_dim, block_size, np.dtype(dtype).name, kind=kind)
        """What a block's bytes hold in the offload tiers."""
        shape = (num_layers, block_size, num_kv_heads, head_dim)  # one block of all layers
        num_blocks = budget_bytes // (self.layout.bytes_per_token * block_size)
        self.offload = offload if num_blocks > 0 else None
        self.cache = PrefixCache(BlockPool(max(num_blocks, 1)), enabled=num_blocks > 0, hasher=hasher,
                                 events=kv_events, spill=self._spill if self.offload is not None else None)
        self.k = np.zeros((num_blocks, *shape), dtype)  # [N, L, bs, Hkv, D]
        self.v = np.zeros((num_blocks, *shape[:3], self.layout.value_dim), dtype)  # [N, L, bs, Hkv, D | 0]
        self.hits = 0
        """Prompt tokens served from the cache (not computed)."""
        self.loaded_blocks = 0
        """Blocks loaded back from the offload tiers."""

    @property
    def enabled(self) -> bool:
        return self.cache.enabled

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def lookup(self, token_ids: list[int], multiple_of: int = 1, fetched: Fetched | None = None,
               adapter: AdapterKey | None = None) -> tuple[np.ndarray, np.ndarray] | None:
        """k, v [L, m, Hkv, D] of the longest cached prefix (m a multiple of `multiple_of` and of the
        block size, m < len(token_ids)) computed with `adapter` (None: the base model), continued by the blocks
        `fetch` loaded after it; None when there is none."""
        if not self.enabled:
            return None
        hashes = self._hashes(token_ids, adapter, limit=(len(token_ids) - 1) // self.block_size)
        ids = self.cache.lookup(hashes)
        try:
            blocks = [(self.k[b], self.v[b]) for b in ids]  # each [L, bs, Hkv, D]
            if fetched is not None and fetched.start <= len(ids):
                blocks += [(b.k, b.v) for b in fetched.blocks[len(ids) - fetched.start :]]
            step = max(multiple_of // self.block_size, 1)
            used = blocks[: len(blocks) // step * step]
            if not used:
                return None
            k = np.concatenate([bk for bk, _ in used], axis=1)  # [L, m, Hkv, D]
            v = np.concatenate([bv for _, bv in used], axis=1)
            self.hits += k.shape[1]
            return k, v
        finally:
            self.cache.free(ids)

    def _hashes(self, token_ids: list[int], adapter: AdapterKey | None, limit: int | None = None) -> list[bytes]:
        return self.cache.hasher.hashes(token_ids, self.block_size, limit=limit, extra_keys=extra_keys(adapter))

    def _spill(self, evicted: list[tuple[int, bytes]]) -> None:
        """Queues evicted blocks' bytes (block id, hash each) for the offload tiers."""
        for block_id, h in evicted:
            self.offload.save(h, self.k[block_id].tobytes() + self.v[block_id].tobytes())

    async def fetch(self, token_ids: list[int], adapter: AdapterKey | None = None) -> Fetched | None:
        """The blocks after the cached prefix of token_ids (those `lookup` may use) that the offload tiers hold, up
        to the first that fails its check, loaded on a loader thread; also cached here as far as the budget allows.
        None when there are none. Hand it to `lookup` at once (no await between): the prefix it follows is then
        still cached."""
        if self.offload is None:
            return None
        hashes = self._hashes(token_ids, adapter, limit=(len(token_ids) - 1) // self.block_size)
        held = self.cache.lookup(hashes)
        try:
            wanted = hashes[len(held) : len(held) + self.offload.held_prefix(hashes[len(held):])]
            if not wanted:
                return None
            datas = await asyncio.wrap_future(self.offload.submit(self.offload.load, wanted))
            blocks = []
            for data in datas:
                try:
                    blocks.append(unpack_block(self.layout, data))
                except ValueError:
                    break
            self._cache_loaded(token_ids, hashes, len(held), blocks, adapter)
            self.loaded_blocks += len(blocks)
            return Fetched(len(held), blocks) if blocks else None
        finally:
            self.cache.free(held)
            if self.cache.events is not None:
                self.cache.events.flush()

    def _cache_loaded(self, token_ids: list[int], hashes: list[bytes], first: int, blocks: list[BlockKv],
                      adapter: AdapterKey | None = None) -> None:
        """Caches loaded blocks (the first of them block `first` of the prompt) as far as the budget allows."""
        new = self.cache.allocate(min(len(blocks), self.cache.num_available))
        for block_id, block in zip(new, blocks):
            self.k[block_id], self.v[block_id] = block.k, block.v
        bs = self.block_size
        self.cache.register(new, hashes[first : first + len(new)], token_ids[first * bs : (first + len(new)) * bs],
                            hashes[first - 1] if first else None, adapter)
        self.cache.free(new)

    def store(self, token_ids: list[int], k: np.ndarray, v: np.ndarray, adapter: AdapterKey | None = None) -> None:
        """Caches the full blocks of a prompt whose k, v [L, n >= full blocks' tokens, Hkv, D] are given, computed
        with `adapter` (None: the base model)."""
        if not self.enabled:
            return
        hashes = self._hashes(token_ids, adapter)
        held = self.cache.lookup(hashes)
        try:
            fresh = min(len(hashes) - len(held), self.cache.num_available)
            new = self.cache.allocate(fresh)
        except Exception:
            self.cache.free(held)
            raise
        bs = self.block_size
        for i, block_id in enumerate(new, start=len(held)):
            self.k[block_id] = k[:, i * bs : (i + 1) * bs]
            self.v[block_id] = v[:, i * bs : (i + 1) * bs]
        first, end = len(held), len(held) + len(new)
        self.cache.register(new, hashes[first:end], token_ids[first * bs : end * bs], hashes[first - 1] if first else None,
                            adapter)
        if self.offload is not None:  # the blocks past the budget go straight to the offload tiers
            for i in range(end, len(hashes)):
                self.offload.save(hashes[i], np.ascontiguousarray(k[:, i * bs : (i + 1) * bs], self.k.dtype).tobytes()
                                  + np.ascontiguousarray(v[:, i * bs : (i + 1) * bs], self.v.dtype).tobytes())
        self.cache.free(held + new)
        if self.cache.events is not None:
            self.cache.events.flush()
