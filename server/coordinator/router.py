"""The known prefill and decode workers, their load, and which one takes the next request.

A refresher calls `Control.GetInfo` on every worker each `refresh_seconds`: a worker that answers is
ready and its `info` (load, KV layout) is kept; one that does not is unready until it answers again.
Workers come from flags today; `add` / `remove` are the seam for live registration.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal

import grpc

from pdserve.v1 import worker_pb2, worker_pb2_grpc
from server.serving import channel

log = logging.getLogger("pdserve.coordinator")

Role = Literal["prefill", "decode"]


@dataclass
class Worker:
    address: str
    role: Role
    info: worker_pb2.WorkerInfo | None = None
    """The last GetInfo answer: load, KV layout, fingerprint."""
    inflight: int = 0
    """Requests this coordinator has routed to the worker and not yet finished."""
    ready: bool = False
    channel: grpc.aio.Channel | None = field(default=None, repr=False, compare=False)
    reserved_blocks: int = 0
    """KV blocks held by requests this coordinator routed here (known before the next GetInfo)."""
    pending_tokens: int = 0
    """Prompt tokens this coordinator has sent here and not yet seen prefilled."""

    def free_kv_blocks(self) -> int:
        if not self.info:
            return 0
        load = self.info.load
        used = max(load.total_kv_blocks - load.free_kv_blocks, self.reserved_blocks)
        return max(load.total_kv_blocks - used, 0)

    def blocks_for(self, num_tokens: int) -> int:
        block_size = self.info.kv_layout.block_size if self.info and self.info.kv_layout.block_size else 1
        return -(-num_tokens // block_size)

    def queued_prefill_tokens(self) -> int:
        reported = self.info.load.queued_prefill_tokens if self.info else 0
        return max(reported, self.pending_tokens)


class WorkerPool:
    def __init__(
        self,
        refresh_seconds: float = 0.5,
        on_change: Callable[[bool], Awaitable[None]] | None = None,
    ):
        """on_change(serving) is awaited whenever `serving` (a ready prefill and decode worker) flips."""
        self.refresh_seconds = refresh_seconds
        self.on_change = on_change
        self.workers: dict[str, Worker] = {}
        self._serving: bool | None = None
        self._task: asyncio.Task[None] | None = None

    # ---- membership ------------------------------------------------------------

    def add(self, worker: Worker) -> Worker:
        if worker.address in self.workers:
            raise ValueError(f"worker {worker.address} is already known")
        if worker.channel is None:
            worker.channel = channel(worker.address)
        self.workers[worker.address] = worker
        return worker

    async def remove(self, address: str) -> None:
        worker = self.workers.pop(address, None)
        if worker is not None and worker.channel is not None:
            await worker.channel.close()
        await self._notify()

    # ---- routing ---------------------------------------------------------------

    def ready(self, role: Role) -> list[Worker]:
        return [w for w in self.workers.values() if w.role == role and w.ready]

    def pick_decode(self) -> Worker | None:
        """Most free KV blocks, then fewest in-flight requests."""
        return min(self.ready("decode"), key=lambda w: (-w.free_kv_blocks(), w.inflight), default=None)

    def pick_prefill(self) -> Worker | None:
        """Fewest queued prefill tokens, then fewest in-flight requests."""
        return min(self.ready("prefill"), key=lambda w: (w.queued_prefill_tokens(), w.inflight), default=None)

    @property
    def serving(self) -> bool:
        return bool(self.ready("prefill")) and bool(self.ready("decode"))

    async def mark_failed(self, worker: Worker, reason: str) -> None:
        """A call to the worker found it unreachable: route around it until GetInfo succeeds again."""
        if worker.ready:
            log.warning("%s worker %s is unready: %s", worker.role, worker.address, reason)
            worker.ready = False
            await self._notify()

    # ---- refresh ---------------------------------------------------------------

    async def refresh(self) -> None:
        """One GetInfo round over every worker, then a health update."""
        await asyncio.gather(*(self._refresh_one(w) for w in list(self.workers.values())))
        await self._notify()

    async def _refresh_one(self, worker: Worker) -> None:
        assert worker.channel is not None
        stub = worker_pb2_grpc.ControlStub(worker.channel)
        try:
            info = await stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=max(1.0, 2 * self.refresh_seconds))
        except grpc.aio.AioRpcError as e:
            if worker.ready:
                log.warning(
                    "%s worker %s is unready: %s %s", worker.role, worker.address, e.code().name, e.details()
                )
            worker.ready = False
            return
        if info.role and info.role != worker.role:
            if worker.ready or worker.info is None:
                log.error(
                    "worker %s was given as %s but says it is %s", worker.address, worker.role, info.role
                )
            worker.info, worker.ready = info, False
            return
        if worker.role == "decode" and not info.HasField("kv_layout"):
            if worker.ready or worker.info is None:
                log.error("decode worker %s reports no KV layout: cannot route to it", worker.address)
            worker.info, worker.ready = info, False
            return
        if not worker.ready:
            log.info("%s worker %s is ready", worker.role, worker.address)
        worker.info, worker.ready = info, True

    async def _notify(self) -> None:
        serving = self.serving
        if serving != self._serving:
            self._serving = serving
            if self.on_change is not None:
                await self.on_change(serving)

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_seconds)
            try:
                await self.refresh()
            except Exception:  # never let one bad round end the refresher
                log.exception("worker refresh failed")

    async def start(self) -> None:
        """Refreshes once (so a fresh coordinator knows its workers), then every refresh_seconds."""
        await self.refresh()
        self._task = asyncio.create_task(self._refresh_forever(), name="worker-refresher")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for worker in self.workers.values():
            if worker.channel is not None:
                await worker.channel.close()
