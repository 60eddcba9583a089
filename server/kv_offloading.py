"""The offload tiers' settings (vLLM's `--kv-offloading-*` flags and pdserve's disk and shared ones), shared by
both worker tiers, and the `TieredStore` they open.

Offloading is on when any tier is given: `--kv-offloading-size` (GiB of host memory, vLLM's flag and meaning),
`--kv-offloading-disk-path` (a local directory, bounded by `--kv-offloading-disk-size`) or
`--kv-offloading-shared-path` (a directory every worker of the deployment mounts, so a prefill worker loads what
a decode worker saved and the other way round).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pdserve.kvcache.block_bytes import layout_fingerprint
from pdserve.kvcache.block_store import BlockStore
from pdserve.kvcache.disk_store import DiskStore
from pdserve.kvcache.host_store import HostStore
from pdserve.kvcache.kv_events import KvEventRecorder
from pdserve.kvcache.layout import KvLayout
from pdserve.kvcache.tiered_store import TieredStore

KvOffloadingBackend = Literal["native"]
"""vLLM's `--kv-offloading-backend`: native (its own tiers; here pdserve's). vLLM's lmcache is not served."""
GIB = 1 << 30


@dataclass(frozen=True, kw_only=True)
class KvOffloadingConfig:
    kv_offloading_backend: KvOffloadingBackend = "native"
    """vLLM's flag: which offloading backend keeps the KV the prefix cache evicts (native: pdserve's tiers)."""
    kv_offloading_size: float | None = None
    """vLLM's flag: GiB of host memory that keep the KV blocks the prefix cache evicts, loaded back when a prompt
    needs them again (least recently used dropped past it). Default: no host tier."""
    kv_offloading_disk_path: str | None = None
    """A local directory under the host tier: evicted KV blocks, one checksummed file each (a corrupt or partial
    file is a miss). Default: no disk tier."""
    kv_offloading_disk_size: float = 16.0
    """GiB the disk tier may hold (its least recently used files deleted past it)."""
    kv_offloading_shared_path: str | None = None
    """A directory every worker of the deployment mounts (NFS, a shared volume): the last tier, where a worker
    finds the KV blocks another worker (of either tier) saved. Default: none."""
    kv_offloading_shared_size: float = 0.0
    """GiB this worker keeps in the shared directory (its own least recently used files deleted past it); 0: no
    bound from this worker (the filesystem's own: a full one costs misses, never errors)."""

    def check_offloading(self) -> None:
        """Refuses sizes and paths that cannot work, naming the flag."""
        if self.kv_offloading_backend != "native":
            raise ValueError(f"--kv-offloading-backend takes native, not {self.kv_offloading_backend!r}")
        if self.kv_offloading_size is not None and self.kv_offloading_size <= 0:
            raise ValueError(f"--kv-offloading-size must be > 0 GiB, got {self.kv_offloading_size}")
        if self.kv_offloading_disk_size <= 0:
            raise ValueError(f"--kv-offloading-disk-size must be > 0 GiB, got {self.kv_offloading_disk_size}")
        if self.kv_offloading_shared_size < 0:
            raise ValueError(f"--kv-offloading-shared-size must be >= 0 GiB (0: unbounded), got "
                             f"{self.kv_offloading_shared_size}")
        if self.kv_offloading_disk_path and self.kv_offloading_disk_path == self.kv_offloading_shared_path:
            raise ValueError("--kv-offloading-disk-path and --kv-offloading-shared-path name the same directory; "
                             "give the shared one alone")

    @property
    def offloading(self) -> bool:
        """Whether any offload tier is given."""
        return bool(self.kv_offloading_size or self.kv_offloading_disk_path or self.kv_offloading_shared_path)


def open_offload(config: KvOffloadingConfig, layout: KvLayout, model_fingerprint: str,
                 events: KvEventRecorder | None = None) -> TieredStore | None:
    """The tiers the config gives, keyed by the layout's fingerprint; None when it gives none."""
    if not config.offloading:
        return None
    fingerprint = layout_fingerprint(layout, model_fingerprint)
    tiers: list[BlockStore] = []
    if config.kv_offloading_size:
        tiers.append(HostStore(int(config.kv_offloading_size * GIB), events))
    if config.kv_offloading_disk_path:
        tiers.append(DiskStore(config.kv_offloading_disk_path, int(config.kv_offloading_disk_size * GIB), fingerprint,
                               name="disk", locality="LOCAL", events=events))
    if config.kv_offloading_shared_path:
        tiers.append(DiskStore(config.kv_offloading_shared_path, int(config.kv_offloading_shared_size * GIB),
                               fingerprint, name="shared", locality="REMOTE", events=events))
    return TieredStore(tiers)
