"""KvRouting: the workers to take a prompt, by the expected cost the KV index (kv_index.py) says each would pay.

The coordinator hashes the prompt's full blocks as the workers do (vLLM's `BlockHasher`, the same
--prefix-caching-hash-algo and PYTHONHASHSEED), asks the index how long a prefix each candidate holds and on
which medium, and picks the least cost, as Dynamo's KV router does (`overlap_score_weight` x blocks to prefill +
active blocks):
- Decode: `weight x (blocks to compute + blocks to load) + active blocks`. Blocks to compute are the prompt's blocks
  past the worker's longest held prefix (the prefill tier computes and sends them, or, under conditional
  disaggregation, the worker computes them): they are also the blocks the prefill tier transfers. A held block
  costs its medium's share of a compute (`MEDIUM_LOAD_COST`: 0 on the worker's own device cache, more from host
  memory or disk, an unknown medium the most), and active blocks are the KV blocks in use there (the decode load).
  A LoRA adapter's request looks its prefix up under the adapter's block hashes (vLLM's extra key, as the workers
  hash and publish its blocks) and adds what making the adapter usable there costs (lora_routing.py: nothing in a
  device slot, a few blocks from host memory, more from disk).
- Prefill: `weight x tokens to compute + queued prefill tokens`, the tokens past the worker's held prefix (its host
  prefix KV's events) against its queue.
Ties go to the prompt's rendezvous order (policies.prefix_aware's), so every replica places a cold prompt alike.

Only workers the index has a view of count: when none of the candidates has one (events off, or not read yet),
`pick_*` return None and the router falls back to its policy (rendezvous hashing for decode). A pick where a
candidate's view is partial, syncing or missing says so in its reason (`kv-index-partial`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.kvcache.adapter_key import AdapterKey
from pdserve.kvcache.block_hash import BlockHasher
from pdserve.server.coordinator.kv_index import KvIndex
from pdserve.server.coordinator.lora_routing import ADAPTER_LOAD_COST, residency
from pdserve.server.coordinator.policies import _fits, _rank, _shortest_queue, route_key

if TYPE_CHECKING:
    from pdserve.server.coordinator.adapters import Adapter
    from pdserve.server.coordinator.worker_pool import Worker

MEDIUM_LOAD_COST: dict[str, float] = {"GPU": 0.0, "CPU": 0.1, "STORAGE": 0.3, "DISK": 0.3}
"""The share of computing a block that loading it from this medium into the worker's cache costs: estimates (a
host-to-device copy is ~10x cheaper than the block's prefill; a local disk read a few times dearer)."""
UNKNOWN_MEDIUM_COST = 0.5
"""A medium not named above (a shared filesystem, an object store): half a compute."""
OWN_MEDIUM = {"decode": "GPU", "prefill": "CPU"}
"""Each tier's own cache: free to use (the prefill tier's prefix KV lives in host memory)."""


@dataclass(frozen=True)
class Estimate:
    """What routing the prompt to `worker` is expected to cost."""

    worker: Worker
    cached_blocks: int
    """The prompt's leading blocks the worker holds on some medium."""
    compute_blocks: int
    """The prompt's blocks past them (its last, partial block included): computed, and sent when disaggregated."""
    load_blocks: float
    """The held blocks' loads, in blocks' worth of compute (0 when all are in the tier's own cache)."""
    queue: float
    """Decode: the worker's KV blocks in use; prefill: its queued prompt tokens."""
    cost: float
    adapter: str = ""
    """Decode, a LoRA adapter's request: where the worker holds it (device | host | disk); "" for the base model."""


def medium_cost(media: tuple[str, ...], tier: str) -> float:
    """The cheapest medium holding a block, as a share of computing it."""
    own = OWN_MEDIUM.get(tier)
    return min(0.0 if m == own else MEDIUM_LOAD_COST.get(m, UNKNOWN_MEDIUM_COST) for m in media)


class KvRouting:
    def __init__(self, index: KvIndex, hasher: BlockHasher, overlap_weight: float = 1.0) -> None:
        self.index = index
        self.hasher = hasher
        self.overlap_weight = overlap_weight
        """Dynamo's `overlap_score_weight`: a block to compute against a block of load."""

    def known(self, worker: Worker) -> bool:
        """The index has a view of the worker (its snapshot read: live or partial)."""
        return self.index.state(worker.address) in ("live", "partial")

    def estimate(self, worker: Worker, prompt: list[int], hashes: dict[int, list[bytes]],
                 adapter: Adapter | None = None) -> Estimate:
        """The prompt's cost on `worker` (for `adapter`'s request: its blocks' hashes, and its load there);
        `hashes` caches the prompt's block hashes per block size."""
        tier = worker.role
        view = self.index.views.get(worker.address)
        block_size = view.block_size if view is not None else worker.block_size()
        if block_size not in hashes:  # the last token is always computed: its block is never looked up
            extra = None if adapter is None else AdapterKey(adapter.id, adapter.name, adapter.path).extra_keys
            hashes[block_size] = self.hasher.hashes(prompt, block_size, limit=(len(prompt) - 1) // block_size,
                                                    extra_keys=extra)
        cached, media = self.index.longest_prefix(worker.address, hashes[block_size])
        compute = -(-len(prompt) // block_size) - cached
        load = sum(medium_cost(m, tier) for m in media)
        where = ""
        if tier == "decode":
            queue = float(worker.info.load.total_kv_blocks - worker.free_kv_blocks()) if worker.info else 0.0
            lora = 0.0
            if adapter is not None:
                where = residency(worker, adapter)
                lora = ADAPTER_LOAD_COST[where]
            cost = self.overlap_weight * (compute + load + lora) + queue
        else:
            queue = float(worker.queued_prefill_tokens())
            cost = self.overlap_weight * max(len(prompt) - (cached - load) * block_size, 0) + queue
        return Estimate(worker, cached, compute, load, queue, cost, where)

    def _least(self, workers: list[Worker], prompt: list[int], adapter: Adapter | None = None
               ) -> tuple[Estimate, str]:
        hashes: dict[int, list[bytes]] = {}
        estimates = [self.estimate(w, prompt, hashes, adapter) for w in workers]
        key = route_key(prompt, workers[0].block_size())
        rank = (lambda e: _rank(key, e.worker)) if key is not None else (lambda e: e.worker.address.encode())
        best = min(estimates, key=lambda e: (e.cost, tuple(-b for b in rank(e))))
        exact = all(self.index.state(e.worker.address) == "live" for e in estimates)
        reason = "kv-index" if best.cached_blocks else f"lora-{best.adapter}" if best.adapter in ("device", "host") \
            else "kv-load"
        return best, reason if exact else "kv-index-partial"

    def pick_decode(self, workers: list[Worker], tokens: int, prompt: list[int], adapter: Adapter | None = None
                    ) -> tuple[Worker | None, str] | None:
        """The decode worker of least expected cost among those with room for `tokens` (for `adapter`'s request:
        its prefix and its load), and why; None when the index knows none of `workers` (the caller's policy
        decides)."""
        if not prompt or not any(self.known(w) for w in workers):
            return None
        fitting = [w for w in workers if _fits(w, tokens)]
        if not fitting:
            return _shortest_queue(workers), "queue"
        best, reason = self._least(fitting, prompt, adapter)
        return best.worker, reason

    def pick_prefill(self, workers: list[Worker], prompt: list[int]) -> tuple[Worker, str] | None:
        """The prefill worker (of those with a slot) of least expected cost, and why; None when the index knows
        none of them."""
        if not prompt or not workers or not any(self.known(w) for w in workers):
            return None
        best, reason = self._least(workers, prompt)
        return best.worker, reason
