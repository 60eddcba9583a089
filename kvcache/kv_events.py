"""KV events in vLLM 0.32's wire format (`vllm/distributed/kv_events.py`), and the recorder a cache writes them to.

The structs mirror vLLM's field for field, so `msgspec.msgpack` encodes them byte for byte as vLLM does: a
`KVEventBatch` is an array `[ts, events, data_parallel_rank]`; each event a map tagged by its class name
(`{"type": "BlockStored", ...}`), fields equal to their default left out. pdserve fills what it knows:
the LoRA adapter of a stored block's request (lora_id, lora_name and untagged extra_keys as vLLM's; None for
the base model: `adapter_key.AdapterKey`), one KV cache group (group_idx 0), `medium` "GPU" for the decode
tier's paged cache (whatever its device, as vLLM's block pool writes it) and "CPU" for the prefill tier's host
prefix KV. The offload tiers under them (`offload_store.py`) record as vLLM's offloading connector does: medium
"CPU" for host memory, "STORAGE" for a disk or shared directory (`locality` "LOCAL" / "REMOTE"), and, knowing a
block only by its hash there, vLLM's placeholder payload (no token ids, no parent, block_size 0).

Life of an event: the prefix cache (`prefix_cache.PrefixCache`) calls `stored` when it registers new blocks,
`removed` when it evicts one, `cleared` when it drops them all; the worker's step calls `flush` once, which
hands the step's events as one batch to the publisher (`kv_event_publisher.py`, off the step's thread). A step
that stored and evicted nothing publishes nothing (vLLM publishes no empty batch).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Protocol

import msgspec

from pdserve.kvcache.adapter_key import AdapterKey
from pdserve.kvcache.tail_cache import is_tail_key

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"

ExternalBlockHash = bytes | int


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class of the events: tagged by class name."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def int_block_hashes() -> bool:
    """Hashes on the wire as vLLM sends them: the low 64 bits of the big-endian hash as an int unless
    VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 (vLLM 0.32's default is 1), else the raw bytes."""
    return bool(int(os.getenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")))


class Publisher(Protocol):
    def publish(self, batch: EventBatch) -> None: ...


class KvEventRecorder:
    """Collects one step's events of one cache; `flush` publishes them as one batch."""

    def __init__(self, medium: str, publisher: Publisher | None = None, int_hashes: bool | None = None) -> None:
        self.medium = medium
        self.publisher = publisher
        """None until the worker opens it (its address names it); a flush before then drops the events (none are
        stored before a worker serves; a slice's replaying processes never open one)."""
        self.int_hashes = int_block_hashes() if int_hashes is None else int_hashes
        self.pending: list[KVCacheEvent] = []
        self._lock = threading.Lock()
        """The offload tiers record from their background threads; the worker flushes from its loop."""

    def wire(self, h: bytes) -> ExternalBlockHash:
        return int.from_bytes(h, "big") & ((1 << 64) - 1) if self.int_hashes else h

    def stored(self, hashes: list[bytes], parent: bytes | None, token_ids: list[int], block_size: int,
               adapter: AdapterKey | None = None) -> None:
        """Full blocks newly cached, consecutive in one chain (`parent`: the hash before the first; None at the
        chain's start), `token_ids` theirs; adapter: the LoRA adapter their KV was computed with."""
        self._append(BlockStored(
            block_hashes=[self.wire(h) for h in hashes], parent_block_hash=None if parent is None else self.wire(parent),
            token_ids=list(token_ids), block_size=block_size, lora_id=None if adapter is None else adapter.id,
            medium=self.medium, lora_name=None if adapter is None else adapter.name,
            extra_keys=None if adapter is None else [adapter.event_extra_keys] * len(hashes), group_idx=0))

    def removed(self, h: bytes, medium: str | None = None, locality: str | None = None) -> None:
        """A block evicted (from `medium`, this recorder's by default); a tail's key (`tail_cache.tail_key`, no
        vLLM block) none."""
        if is_tail_key(h):
            return
        self._append(BlockRemoved(block_hashes=[self.wire(h)], medium=medium or self.medium, group_idx=0,
                                  locality=locality))

    def offloaded(self, h: bytes, medium: str, locality: str | None = None) -> None:
        """A block stored in an offload tier, known there by its hash alone: vLLM's offloading connector's
        placeholder BlockStored (no token ids, no parent, block_size 0); a tail's key none."""
        if is_tail_key(h):
            return
        self._append(BlockStored(block_hashes=[self.wire(h)], parent_block_hash=None, token_ids=[], block_size=0,
                                 lora_id=None, medium=medium, lora_name=None, group_idx=0, locality=locality))

    def cleared(self) -> None:
        self._append(AllBlocksCleared())

    def _append(self, event: KVCacheEvent) -> None:
        with self._lock:
            self.pending.append(event)

    def flush(self) -> None:
        """Publishes the events since the last flush as one batch (none: nothing)."""
        if not self.pending:
            return
        with self._lock:
            events, self.pending = self.pending, []
        if self.publisher is not None:
            self.publisher.publish(KVEventBatch(ts=time.time(), events=events))
