"""HostStore: the host-memory tier, blocks' bytes in a dict bounded by bytes, least recently used evicted first."""

from __future__ import annotations

import threading
from collections import OrderedDict

from pdserve.kvcache.block_store import BlockStore, TierStats
from pdserve.kvcache.kv_events import MEDIUM_CPU, KvEventRecorder


class HostStore(BlockStore):
    name = "host"
    medium = MEDIUM_CPU

    def __init__(self, capacity_bytes: int, events: KvEventRecorder | None = None) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"a host KV tier needs a positive size, got {capacity_bytes} bytes")
        self.capacity_bytes = capacity_bytes
        self.events = events
        self.stats = TierStats()
        self._blocks: OrderedDict[bytes, bytes] = OrderedDict()
        """Key -> bytes, least recently used first."""
        self._used = 0
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        return self._used

    def keys(self) -> list[bytes]:
        """The keys held, least recently used first."""
        with self._lock:
            return list(self._blocks)

    def get(self, key: bytes) -> bytes | None:
        with self._lock:
            data = self._blocks.get(key)
            if data is None:
                self.stats.misses += 1
                return None
            self._blocks.move_to_end(key)
            self.stats.hits += 1
            self.stats.bytes_read += len(data)
            return data

    def put(self, key: bytes, data: bytes) -> bool:
        if len(data) > self.capacity_bytes:
            return False
        with self._lock:
            if key in self._blocks:
                self._blocks.move_to_end(key)
                return True
            while self._used + len(data) > self.capacity_bytes:
                old, dropped = self._blocks.popitem(last=False)
                self._used -= len(dropped)
                self.stats.evictions += 1
                if self.events is not None:
                    self.events.removed(old, self.medium)
            self._blocks[key] = data
            self._used += len(data)
            self.stats.saves += 1
            self.stats.bytes_written += len(data)
            if self.events is not None:
                self.events.offloaded(key, self.medium)
            return True

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self._blocks

    def evict(self, key: bytes) -> bool:
        with self._lock:
            data = self._blocks.pop(key, None)
            if data is None:
                return False
            self._used -= len(data)
            self.stats.evictions += 1
            if self.events is not None:
                self.events.removed(key, self.medium)
            return True
