"""Routing a LoRA adapter's requests to the decode workers that already hold it.

Each decode worker reports, with its load (`WorkerLoad.device_loras`, `host_loras`), the adapters in its device
slots and those packed in its host memory; any other it must read from disk (`decode/lora.py`'s LRUs). Where an
adapter is decides what its request costs there beyond its KV:
- with the KV index (kv_routing.py), `ADAPTER_LOAD_COST` blocks' worth of compute are added to the worker's expected
  cost, on top of the blocks its KV needs (an adapter's prefixes are found under its own block hashes);
- without it, the decode policy picks among the workers holding the adapter in a device slot, else in host memory
  (`holders`), each taking it while it fits and its in-flight requests stay within `LOAD_SLACK` of the pool's mean
  (plus one), so a hot adapter spills onto another worker, which then loads it; else among every worker.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal

from pdserve.server.coordinator.policies import LOAD_SLACK, _fits

if TYPE_CHECKING:
    from pdserve.server.coordinator.adapters import Adapter
    from pdserve.server.coordinator.worker_pool import Worker

Residency = Literal["device", "host", "disk"]

ADAPTER_LOAD_COST: dict[Residency, float] = {"device": 0.0, "host": 4.0, "disk": 64.0}
"""What making the adapter usable costs, in blocks' worth of compute (estimates: a rank-16 adapter of an 8B model
is ~40 MB; a host-to-device copy of it takes a few ms, a block's prefill about half of one on a GPU, and reading
and packing it from disk ~10x the copy)."""


def residency(worker: Worker, adapter: Adapter) -> Residency:
    """Where `worker` holds the adapter, as it last reported (the same name and path: a name re-pointed at other
    weights is another adapter)."""
    load = worker.info.load if worker.info else None
    if load is None:
        return "disk"
    if any(a.name == adapter.name and a.path == adapter.path for a in load.device_loras):
        return "device"
    if any(a.name == adapter.name and a.path == adapter.path for a in load.host_loras):
        return "host"
    return "disk"


def holders(workers: list[Worker], adapter: Adapter, tokens: int) -> tuple[list[Worker], Residency]:
    """The workers that can take the adapter's request of `tokens` cheapest: those holding it in a device slot,
    else in host memory, that fit and are within their share of the load; else every worker ("disk")."""
    bound = math.ceil(LOAD_SLACK * (sum(w.inflight for w in workers) + 1) / len(workers)) if workers else 0
    where = {w: residency(w, adapter) for w in workers}
    for tier in ("device", "host"):
        near = [w for w in workers if where[w] == tier and w.inflight + 1 <= bound and _fits(w, tokens)]
        if near:
            return near, tier  # type: ignore[return-value]
    return workers, "disk"
