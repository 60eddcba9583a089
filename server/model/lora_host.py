"""The adapters a worker holds packed in host memory, both tiers' (`--max-cpu-loras`): an LRU, loaded from an
adapter's path on a miss (the load time logged), the least recently used dropped past the bound. What "packed"
means is the tier's (`pack`: numpy stacks for the JAX prefill, torch tensors for the decode engine)."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from pdserve.kvcache.adapter_key import AdapterKey
from pdserve.server.model.config import ModelConfig
from pdserve.server.model.lora import LoraCheckpoint, load_lora

Packed = TypeVar("Packed")


class HostAdapters(Generic[Packed]):
    def __init__(self, config: ModelConfig, max_cpu_loras: int, max_rank: int,
                 pack: Callable[[AdapterKey, LoraCheckpoint], Packed],
                 log: logging.Logger, on_load: Callable[[float], None] | None = None) -> None:
        """pack: the tier's packing of a read checkpoint; log: the tier's logger (a line per load and eviction);
        on_load: called with each load's seconds (a metric)."""
        self.config, self.max_cpu_loras, self.max_rank = config, max_cpu_loras, max_rank
        self._pack, self._log, self._on_load = pack, log, on_load
        self._lru: OrderedDict[AdapterKey, Packed] = OrderedDict()
        self._lock = threading.Lock()
        """`get` runs in loading threads beside the event loop."""

    def __iter__(self) -> Iterator[AdapterKey]:
        """The adapters held, least recently used first."""
        with self._lock:
            return iter(list(self._lru))

    def __len__(self) -> int:
        return len(self._lru)

    def get(self, key: AdapterKey) -> Packed:
        """The adapter packed: from the LRU, else loaded from its path (LoraLoadError if it cannot be: the request
        is refused, the worker serves on)."""
        with self._lock:
            packed = self._lru.get(key)
            if packed is not None:
                self._lru.move_to_end(key)
                return packed
        began = time.perf_counter()
        ckpt = load_lora(key.name, key.path, self.config, self.max_rank)
        packed = self._pack(key, ckpt)
        with self._lock:
            self._lru[key] = packed
            while len(self._lru) > self.max_cpu_loras:
                evicted, _ = self._lru.popitem(last=False)
                self._log.info("LoRA adapter %r evicted from host memory (--max-cpu-loras %d)", evicted.name,
                         self.max_cpu_loras)
        seconds = time.perf_counter() - began
        if self._on_load is not None:
            self._on_load(seconds)
        self._log.info("LoRA adapter %r (id %d, rank %d, %s) loaded from %s in %.1f ms", key.name, key.id, ckpt.rank,
                 "/".join(ckpt.targets), key.path, seconds * 1e3)
        return packed
