"""KvOffload: the decode engine's side of the offload tiers (`kvcache/tiered_store.py`) under its prefix cache.

1. `spill`: the prefix cache evicts blocks (the scheduler needs their ids): their KV is copied off the device at
   once, while the blocks are intact, and queued for the tiers (written on the store's saver thread).
2. `held`: at admission, how many of a new prompt's blocks after the device cache's hits the tiers hold; the
   scheduler counts them as hits and gives them fresh blocks (`Sequence.offload_loads`).
3. `load`: the engine awaits it before it announces the sequence admitted (so neither the prefill tier nor a local
   prefill computes those blocks), while other sequences keep stepping: each block is read from the first tier
   that holds it, checked, and written into its device block on a loader thread. It stops at the first block that
   fails (gone, corrupt): those after it are computed as if never cached.
4. Tails (`kvcache/tail_cache.py`): a kept tail the device cache drops is saved too (`spill_tails`), under its
   `tail_key`, and remembered here by (parent, adapter, tokens) (`tails`, at most `max_tails`, least recently used
   dropped). A prompt computed here whose device cache lacks a tail after its cached blocks asks `held_tail`; the
   tail found is loaded into the sequence's next block after the full blocks (`load_tail`). A tail that fails to
   load (gone, corrupt) is a miss: its tokens are computed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from pdserve.kvcache.block_bytes import unpack_block
from pdserve.kvcache.tail_cache import Tail, TailCache, tail_key
from pdserve.kvcache.tiered_store import TieredStore
from pdserve.server.decode.kv_cache import PagedKvCache

log = logging.getLogger("pdserve.decode")


class KvOffload:
    def __init__(self, store: TieredStore, cache: PagedKvCache, max_tails: int = 65536) -> None:
        self.store = store
        self.cache = cache
        self.blocks_loaded = 0
        self.blocks_saved = 0
        self.tails = TailCache(max_tails)
        """The tails saved to the tiers, as `Tail`s with no block (-1): what `held_tail` can find."""
        self.tails_saved = 0
        self.tails_loaded = 0

    def spill(self, evicted: list[tuple[int, bytes]]) -> None:
        """Queues the evicted blocks' KV (block id, hash each) for the tiers."""
        try:
            datas = self.cache.block_bytes([block_id for block_id, _ in evicted])
        except Exception:  # never into the step: the blocks are then simply not offloaded
            log.exception("copying %d evicted KV blocks off the device failed; they are not offloaded", len(evicted))
            return
        for (_, h), data in zip(evicted, datas):
            self.blocks_saved += self.store.save(h, data)

    def spill_tails(self, tails: list[Tail]) -> None:
        """Queues the dropped tails' KV (their blocks still intact) for the tiers, each under its `tail_key`."""
        try:
            datas = self.cache.block_bytes([tail.block_id for tail in tails])
        except Exception:  # never into the step: the tails are then simply not offloaded
            log.exception("copying %d KV tails off the device failed; they are not offloaded", len(tails))
            return
        for tail, data in zip(tails, datas):
            if self.store.save(tail_key(*tail.key), data):
                self.tails.add(dataclasses.replace(tail, block_id=-1))
                self.tails_saved += 1

    def held_tail(self, parent: bytes | None, extra_keys: tuple | None, tokens: list[int]) -> Tail | None:
        """The longest saved tail after the chain `parent` (and adapter) whose tokens begin `tokens` that the tiers
        still hold (block -1: its KV is to be loaded, `load_tail`); None when none."""
        while (tail := self.tails.take(parent, extra_keys, tokens)) is not None:
            if self.store.contains(tail_key(*tail.key)):
                self.tails.add(tail)  # still named for later turns: the tiers keep it
                return tail
        return None

    async def load_tail(self, block_id: int, tail: Tail) -> tuple[bool, list]:
        """Writes the tail's KV from the tiers into the block: whether it was written, and the CUDA events that follow
        its copy (none on the CPU)."""
        return await asyncio.wrap_future(self.store.submit(self._load_tail, block_id, tail))

    def _load_tail(self, block_id: int, tail: Tail) -> tuple[bool, list]:
        data = self.store.get(tail_key(*tail.key))
        if data is None:
            return False, []
        try:
            copied = self.cache.write_block(block_id, unpack_block(self.cache.layout, data))
        except ValueError as e:  # bytes of another shape under this layout's name: a miss
            log.warning("an offloaded KV tail does not fit this cache (%s); computed again", e)
            return False, []
        self.tails_loaded += 1
        return True, [] if copied is None else [copied]

    def held(self, hashes: list[bytes]) -> int:
        """How many of the hashes, from the first, the tiers hold."""
        return self.store.held_prefix(hashes)

    async def load(self, loads: list[tuple[int, bytes]]) -> tuple[int, list]:
        """Writes the blocks (block id, hash each) from the tiers into the cache, in order, up to the first one
        that fails: how many were written, and the CUDA events that follow their copies (none on the CPU)."""
        return await asyncio.wrap_future(self.store.submit(self._load, loads))

    def _load(self, loads: list[tuple[int, bytes]]) -> tuple[int, list]:
        copies = []
        for n, (block_id, h) in enumerate(loads):
            data = self.store.get(h)
            if data is None:
                return n, copies
            try:
                copied = self.cache.write_block(block_id, unpack_block(self.cache.layout, data))
            except ValueError as e:  # bytes of another shape under this layout's name: a miss
                log.warning("an offloaded KV block does not fit this cache (%s); computed again", e)
                return n, copies
            if copied is not None:
                copies.append(copied)
            self.blocks_loaded += 1
        return len(loads), copies

    def close(self) -> None:
        self.store.close()
