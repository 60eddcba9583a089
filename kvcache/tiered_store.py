"""TieredStore: the offload tiers under a worker's prefix cache, host memory first, then a local disk, then a
directory every worker shares; saves and loads on background threads.

Life of a block here:
1. Saved: the prefix cache evicts it, the worker copies its bytes off the device and calls `save` (it returns at
   once): a saver thread puts the bytes into every tier, host first (write-through, so a block reaches the shared
   directory, where other workers find it, and survives the host tier's eviction). At most `max_pending_saves`
   wait; a save past that is dropped and counted (`save_drops`): the block is then a miss, nothing worse.
2. Looked up: at admission the worker asks `contains` for the hashes its device cache lacks, in order (an
   index look-up in memory, a stat for a shared directory), then `load` gets the leading ones on a loader thread,
   each from the first tier that has it, checked; a block a lower tier had is put back into the host tier.
   The load stops at the first miss: the prefix after it is computed again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from pdserve.kvcache.block_store import BlockStore

log = logging.getLogger("pdserve.kvcache")

T = TypeVar("T")


class TieredStore:
    def __init__(self, tiers: list[BlockStore], *, max_pending_saves: int = 256, save_threads: int = 1,
                 load_threads: int = 2) -> None:
        if not tiers:
            raise ValueError("a tiered KV store needs at least one tier")
        self.tiers = tiers
        self.max_pending_saves = max_pending_saves
        self.save_drops = 0
        """Saves dropped because `max_pending_saves` were waiting."""
        self._pending = 0
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._savers = ThreadPoolExecutor(save_threads, thread_name_prefix="kv-offload-save")
        self._loaders = ThreadPoolExecutor(load_threads, thread_name_prefix="kv-offload-load")

    def describe(self) -> str:
        def size(t: BlockStore) -> str:
            return f"{t.capacity_bytes / 2**30:.3g} GiB" if t.capacity_bytes else "unbounded"

        return ", ".join(f"{t.name} ({size(t)}{f' at {t.path}' if hasattr(t, 'path') else ''})" for t in self.tiers)

    def save(self, key: bytes, data: bytes) -> bool:
        """Queues the block's bytes for every tier; False when dropped (too many saves wait)."""
        with self._lock:
            if self._pending >= self.max_pending_saves:
                self.save_drops += 1
                return False
            self._pending += 1
        self._savers.submit(self._save, key, data)
        return True

    def _save(self, key: bytes, data: bytes) -> None:
        try:
            for tier in self.tiers:
                try:
                    tier.put(key, data)
                except Exception:  # a tier's bug must not stop the saver thread
                    log.exception("%s KV tier: saving a block failed; it will be a miss", tier.name)
        finally:
            with self._lock:
                self._pending -= 1
                if not self._pending:
                    self._idle.notify_all()

    def wait_saved(self, timeout: float | None = None) -> bool:
        """Blocks until no save waits (True) or timeout seconds pass (False)."""
        with self._lock:
            return self._idle.wait_for(lambda: not self._pending, timeout)

    def contains(self, key: bytes) -> bool:
        return any(t.contains(key) for t in self.tiers)

    def held_prefix(self, keys: list[bytes]) -> int:
        """How many of the keys, from the first, some tier holds."""
        for i, key in enumerate(keys):
            if not self.contains(key):
                return i
        return len(keys)

    def get(self, key: bytes) -> bytes | None:
        """The block's checked bytes from the first tier that has them (put back into the tiers above it)."""
        for i, tier in enumerate(self.tiers):
            data = tier.get(key)
            if data is not None:
                for upper in self.tiers[:i]:
                    upper.put(key, data)
                return data
        return None

    def load(self, keys: list[bytes]) -> list[bytes]:
        """The bytes of the leading keys the tiers hold, stopping at the first miss."""
        out = []
        for key in keys:
            data = self.get(key)
            if data is None:
                break
            out.append(data)
        return out

    def submit(self, fn: Callable[..., T], *args) -> Future[T]:
        """Runs fn on a loader thread (a load and what the worker does with its bytes)."""
        return self._loaders.submit(fn, *args)

    def stats(self) -> dict[str, dict[str, int]]:
        """Each tier's counters (`TierStats`), by tier name."""
        return {t.name: t.stats.as_dict() | {"used_bytes": t.used_bytes} for t in self.tiers}

    def close(self, wait: bool = True) -> None:
        """Stops the threads; `wait`: after the queued saves are written."""
        self._loaders.shutdown(wait=wait, cancel_futures=not wait)
        self._savers.shutdown(wait=wait, cancel_futures=not wait)
