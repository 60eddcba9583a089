"""BlockStore: one offload tier under a prefix cache, KV blocks as bytes keyed by their block hash.

A tier holds the bytes of blocks the worker's prefix cache evicted (`block_bytes.py`), named by vLLM's block hash
(`block_hash.py`: identical on every worker for the same tokens), inside a namespace, the layout fingerprint, fixed
when the tier is opened. Every call is safe from any thread and never raises for what a tier may meet in service
(a full disk, a corrupt or vanished file): those are misses, counted in `stats`. `TieredStore` chains the tiers:
host memory (`HostStore`), a local disk and a shared directory (`DiskStore`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, fields


@dataclass
class TierStats:
    """What one tier did since it opened (the worker's metrics read them)."""

    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    saves: int = 0
    evictions: int = 0
    rejected: int = 0
    """Blocks that failed their check when read (corrupt, truncated, another layout's): dropped, a miss."""
    save_errors: int = 0
    """Saves the tier could not write (a full disk, an I/O error): a miss later, never an error."""

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class BlockStore(ABC):
    name: str
    """host, disk or shared: how logs and metrics name the tier."""
    medium: str
    """The KV events' medium: "CPU" (host memory) or "STORAGE" (a directory)."""
    locality: str | None = None
    """The KV events' locality: "LOCAL" (this worker's disk), "REMOTE" (a directory every worker mounts)."""
    capacity_bytes: int
    stats: TierStats

    @abstractmethod
    def get(self, key: bytes) -> bytes | None:
        """The block's bytes, checked; None when the tier lacks them or they fail their check."""

    @abstractmethod
    def put(self, key: bytes, data: bytes) -> bool:
        """Stores the block (evicting the least recently used past the capacity); False when it was not stored."""

    @abstractmethod
    def contains(self, key: bytes) -> bool:
        """Whether the tier holds the block (a later `get` may still miss: it checks the bytes)."""

    @abstractmethod
    def evict(self, key: bytes) -> bool:
        """Drops the block; False when the tier did not hold it."""

    @property
    @abstractmethod
    def used_bytes(self) -> int:
        """Bytes the tier holds (that this worker knows of, for a shared directory)."""
