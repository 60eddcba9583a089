"""Which workers take a request, and what this coordinator holds on each until the next load report.

1. Pick: a decode worker with room for the prompt's blocks, by the decode policy (policies.py); a
   prefill worker under `prefill_inflight_per_worker` calls from here, by the prefill policy. With the
   KV index (`kv`: the workers publish KV events), the prefix-aware decode policy and the prefill pick
   go by what each worker holds instead (kv_routing.py), the policies being the fallback. A choice
   of a request with n > 1 prefers where the leader's prompt KV is (shared_prompt.py). A LoRA adapter's request
   prefers the decode workers holding the adapter, in a device slot then in host memory (lora_routing.py; with
   the KV index, as a cost beside its prefix's). None with room:
   the request waits in that tier's queue (admission.py) until one has, or its deadline passes. Each
   pick is counted by its reason (`routing_decisions`).
2. Hold: the picked decode worker counts the request (in flight, its blocks reserved) and the prefill
   worker the prompt (in flight, its tokens and length pending) from the pick on, so requests routed
   before the next load report see them taken.
3. Release: the counts go back, and the queues' waiters look again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

from pdserve.server import metrics
from pdserve.server.coordinator.admission import Deadline, TierQueue
from pdserve.server.coordinator.kv_routing import KvRouting
from pdserve.server.coordinator.lora_routing import holders
from pdserve.server.coordinator.policies import DECODE_PICKERS, PREFILL_PICKERS, prefix_aware
from pdserve.server.coordinator.shared_prompt import Placement
from pdserve.server.coordinator.worker_pool import Tier, Worker, WorkerPool

if TYPE_CHECKING:
    from pdserve.server.coordinator.adapters import Adapter


class Router:
    def __init__(
        self,
        pool: WorkerPool,
        *,
        prefill_policy: str = "least-queued",
        decode_policy: str = "most-free-blocks",
        max_queue: int = 256,
        prefill_inflight_per_worker: int = 64,
        kv: KvRouting | None = None,
    ):
        self.pool = pool
        self.prefill_policy = PREFILL_PICKERS[prefill_policy]
        self.decode_policy = DECODE_PICKERS[decode_policy]
        self.prefill_policy_name, self.decode_policy_name = prefill_policy, decode_policy
        self.kv = kv
        """Routing by the KV index (None: the policies alone)."""
        self.prefill_inflight_per_worker = prefill_inflight_per_worker
        """A prefill worker with this many calls from this coordinator in flight takes no more for now."""
        self.decode_queue = TierQueue("decode", max_queue)
        self.prefill_queue = TierQueue("prefill", max_queue)

    # ---- 1. pick ----------------------------------------------------------------

    def pick_decode(self, tokens: int = 0, prompt: list[int] | None = None,
                    placement: Placement | None = None, adapter: Adapter | None = None) -> Worker | None:
        """A decode worker with room for a request whose KV holds `tokens`: the leader's when it has room
        for what is this choice's own, else by the KV index, else by the decode policy (for a LoRA adapter's
        request, among the workers holding it first)."""
        if placement is not None and placement.takes(tokens):
            return _counted("decode", placement.decode, "shared-prompt")
        workers = self.pool.ready("decode")
        if self.kv is not None and prompt and self.decode_policy is prefix_aware:
            picked = self.kv.pick_decode(workers, tokens, prompt, adapter)
            if picked is not None:
                return _counted("decode", *picked)
        reason = "rendezvous" if self.decode_policy is prefix_aware else self.decode_policy_name
        if adapter is not None and workers:
            workers, where = holders(workers, adapter, tokens)
            if where != "disk":
                reason = f"lora-{where}"
        return _counted("decode", self.decode_policy(workers, tokens, prompt=prompt), reason)

    def pick_prefill(self, placement: Placement | None = None, prompt: list[int] | None = None) -> Worker | None:
        """A prefill worker with a slot: the one that computed the leader's prompt (its prefix KV holds
        it) when it has one, else the least expected cost by the KV index, else by the prefill policy."""
        room = [w for w in self.pool.ready("prefill") if w.inflight < self.prefill_inflight_per_worker]
        if placement is not None and placement.prefill in room:
            return _counted("prefill", placement.prefill, "shared-prompt")
        if self.kv is not None and prompt:
            picked = self.kv.pick_prefill(room, prompt)
            if picked is not None:
                return _counted("prefill", *picked)
        return _counted("prefill", self.prefill_policy(room), self.prefill_policy_name)

    async def has_ready(self, role: Tier, deadline: Deadline) -> bool:
        """Whether the tier has a ready worker, after waiting (within the deadline) for the health check of
        one that a call marked dead."""
        if not self.pool.ready(role):
            await self.pool.recheck(role, min(deadline.check(), self.pool.recheck_seconds))
        return bool(self.pool.ready(role))

    async def decode(self, tokens: int, prompt: list[int], deadline: Deadline,
                     placement: Placement | None = None, adapter: Adapter | None = None) -> Worker:
        """A decode worker with room now, or after waiting in the decode queue; raises RequestFailed."""
        return await self.decode_queue.acquire(
            self.pool, lambda: self.pick_decode(tokens, prompt, placement, adapter), deadline)

    async def prefill(self, deadline: Deadline, placement: Placement | None = None,
                      prompt: list[int] | None = None) -> Worker | None:
        """A prefill worker with a slot now, or after waiting in the prefill queue; None when no prefill
        worker is ready (the decode worker then prefills the prompt itself). Raises RequestFailed."""
        if not self.pool.ready("prefill"):
            return None
        return await self.prefill_queue.acquire(self.pool, lambda: self.pick_prefill(placement, prompt), deadline)

    # ---- 2. hold, 3. release ----------------------------------------------------

    def hold_decode(self, worker: Worker, blocks: int) -> None:
        """The request counts on `worker` from its pick: in flight, holding `blocks` KV blocks."""
        worker.inflight += 1
        worker.reserved_blocks += blocks
        metrics.num_requests_running.inc()

    def release_decode(self, worker: Worker, blocks: int) -> None:
        metrics.num_requests_running.dec()
        worker.inflight -= 1
        worker.reserved_blocks -= blocks
        self.pool.poke()

    def refused(self, worker: Worker) -> None:
        """The decode worker refused a request for lack of room: full in this coordinator's view until its
        next load report."""
        worker.refused = True

    @contextlib.contextmanager
    def prefilling(self, worker: Worker, num_tokens: int) -> Iterator[None]:
        """A prompt of `num_tokens` counts on the prefill worker while its Prefill call runs."""
        worker.inflight += 1
        worker.pending_tokens += num_tokens
        worker.pending_lengths.append(num_tokens)
        worker.unreported_lengths.append(num_tokens)
        try:
            yield
        finally:
            worker.inflight -= 1
            worker.pending_tokens -= num_tokens
            worker.pending_lengths.remove(num_tokens)
            if num_tokens in worker.unreported_lengths:  # answered before the next report
                worker.unreported_lengths.remove(num_tokens)

    async def mark_failed(self, worker: Worker, reason: str) -> None:
        """A call found the worker unreachable or silent: no picks of it until its health check passes."""
        await self.pool.mark_failed(worker, reason)


def _counted(tier: Tier, worker: Worker | None, reason: str) -> Worker | None:
    """The pick, counted by tier and reason when there is one."""
    if worker is not None:
        metrics.routing_decisions.labels(tier, reason).inc()
    return worker
