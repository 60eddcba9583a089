"""The live prefill and decode pools: who is there and in what state (router.py picks among them).

Workers join two ways: from flags (`--prefill/--decode`, static) or by calling `Registry.Register`
(`--coordinator` on the worker), after which they heartbeat their load. A refresher also calls
`Control.GetInfo` on every worker each `refresh_seconds`, so a killed process is noticed within one
round. A worker's state:
- ready: answers, and (when registered) heartbeats within `heartbeat_timeout`; takes traffic.
- draining: said so (SIGTERM) in a heartbeat or GetInfo; takes no new work, ever again.
- dead: GetInfo failed (refused; or timed out with nothing heard for `heartbeat_timeout`: a worker starved
  of CPU for a moment stays ready), a call found it unreachable, or heartbeats stopped; takes no traffic until it
  answers again. A registered worker dead for `forget_seconds` is dropped from the pool.
A worker marked dead by a call (unreachable, or its stream silent for --stall-timeout) rather than by its
health check is back at the next GetInfo round (or heartbeat) if it answers; until that check, a request
that finds its tier with no ready worker waits for it (`recheck`) instead of being refused at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal

import grpc
from pdserve.kvcache.layout import blocks_behind_windows
from pdserve.server.coordinator.steps_stream import DECODE_CHANNEL_OPTIONS
from pdserve.server.serving import channel
from pdserve.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger("pdserve.coordinator")

Tier = Literal["prefill", "decode"]
State = Literal["ready", "draining", "dead"]


class RegistrationRefused(Exception):
    """The worker may not join: its model or KV layout differs from the pool's."""


@dataclass(eq=False)
class Worker:
    address: str
    role: Tier
    info: worker_pb2.WorkerInfo | None = None
    """The last GetInfo or heartbeat: load, KV layout, fingerprint."""
    inflight: int = 0
    """Requests this coordinator has routed to the worker and not yet finished."""
    ready: bool = False
    """The worker answered its last GetInfo (and, when registered, heartbeats on time)."""
    channel: grpc.aio.Channel | None = field(default=None, repr=False, compare=False)
    reserved_blocks: int = 0
    """KV blocks held by requests this coordinator routed here (known before the next GetInfo)."""
    pending_tokens: int = 0
    """Prompt tokens this coordinator has sent here and not yet seen prefilled."""
    pending_lengths: list[int] = field(default_factory=list)
    """The lengths of those prompts (for the expected wait, prefill_estimate.py)."""
    unreported_lengths: list[int] = field(default_factory=list)
    """Of those, the ones sent since the worker's last load report (which does not count them yet)."""
    registered: bool = False
    draining: bool = False
    """Sticky: a draining worker never takes new work again (it exits when done)."""
    last_heartbeat: float = 0.0
    last_seen: float = 0.0
    """time.monotonic() of the last answer (GetInfo, Register or Heartbeat)."""
    dead_since: float | None = None
    failed_by_call: bool = False
    """Marked dead by a call (unreachable, or silent for --stall-timeout), its health not checked since."""
    refused: bool = False
    """It refused a request for lack of room (another coordinator took its blocks first): no room in this
    coordinator's view until its next load report."""
    lost: asyncio.Event = field(default_factory=asyncio.Event, repr=False, compare=False)
    """Set when the worker stops answering; requests waiting on it give up on it at once."""

    def reported(self, info: worker_pb2.WorkerInfo, now: float) -> None:
        """A load report (GetInfo, Register or Heartbeat) answered at `now`: it counts what was sent before,
        shows the room it has now, and is a health check passed."""
        self.info, self.last_seen = info, now
        self.unreported_lengths.clear()
        self.refused = False
        self.failed_by_call = False

    @property
    def state(self) -> State:
        if not self.ready:
            return "dead"
        return "draining" if self.draining else "ready"

    @property
    def routable(self) -> bool:
        return self.ready and not self.draining

    @property
    def kv_address(self) -> str:
        """Where prefill workers push this decode worker's KV (its --kv-port server, when it has one)."""
        return (self.info.kv_address if self.info else "") or self.address

    def free_kv_blocks(self) -> int:
        if not self.info or self.refused:
            return 0
        load = self.info.load
        used = max(load.total_kv_blocks - load.free_kv_blocks, self.reserved_blocks)
        return max(load.total_kv_blocks - used, 0)

    def block_size(self) -> int:
        return self.info.kv_layout.block_size if self.info and self.info.kv_layout.block_size else 1

    def blocks_for(self, num_tokens: int, shared: int = 0) -> int:
        """The blocks a prompt of num_tokens takes here beyond `shared` leading ones it holds already: none
        behind every layer's sliding window, as the decode scheduler admits it (`blocks_behind_windows`)."""
        windows = tuple(self.info.kv_layout.layer_windows) if self.info else ()
        behind = blocks_behind_windows(windows, self.block_size(), num_tokens)
        return -(-num_tokens // self.block_size()) - max(shared, behind)

    def queued(self) -> int:
        """Requests waiting in the worker's own queue (as last reported)."""
        return self.info.load.waiting_requests if self.info else 0

    def has_queue_room(self) -> bool:
        """The worker's own waiting queue can take one more (counting this coordinator's picks)."""
        if not self.info or not self.info.load.max_waiting_requests or self.refused:
            return False
        load = self.info.load
        taken = max(load.running_requests + load.waiting_requests, self.inflight)
        return taken < (load.max_running_requests or taken + 1) + load.max_waiting_requests

    def under_running_cap(self) -> bool:
        cap = self.info.load.max_running_requests if self.info else 0
        if not cap:
            return True
        load = self.info.load  # type: ignore[union-attr]
        return max(load.running_requests + load.waiting_requests, self.inflight) < cap

    def queued_prefill_tokens(self) -> int:
        reported = self.info.load.queued_prefill_tokens if self.info else 0
        return max(reported, self.pending_tokens)

    def set_ready(self, ready: bool, reason: str = "") -> bool:
        """Returns whether the state changed."""
        if ready == self.ready:
            return False
        self.ready = ready
        if ready:
            self.dead_since = None
            self.lost = asyncio.Event()
            log.info("%s worker %s is ready", self.role, self.address)
            if self.role == "prefill" and self.info is not None and not self.info.prefill_deadlines:
                log.warning("prefill worker %s predates TTFT-budget scheduling: --ttft-budget still refuses "
                            "requests by expected wait there, but later short prompts may delay admitted ones "
                            "past it; upgrade the worker", self.address)
        else:
            self.dead_since = time.monotonic()
            self.lost.set()
            log.warning("%s worker %s is dead: %s", self.role, self.address, reason)
        return True


def _describe(info: worker_pb2.WorkerInfo) -> str:
    return f"{info.fingerprint.digest[:12]} ({info.fingerprint.description or 'no description'})"


def _layout(layout: worker_pb2.KvLayout) -> str:
    return (f"layers={layout.num_layers} kv_heads={layout.num_kv_heads} head_dim={layout.head_dim} "
            f"block_size={layout.block_size} dtype={layout.dtype}")


class WorkerPool:
    def __init__(
        self,
        refresh_seconds: float = 0.5,
        on_change: Callable[[bool], Awaitable[None]] | None = None,
        *,
        heartbeat_timeout: float = 3.0,
        forget_seconds: float = 60.0,
    ):
        """on_change(serving) is awaited whenever `serving` (a routable decode worker) flips."""
        self.refresh_seconds = refresh_seconds
        self.on_change = on_change
        self.heartbeat_timeout = heartbeat_timeout
        self.forget_seconds = forget_seconds
        self.workers: dict[str, Worker] = {}
        self._serving: bool | None = None
        self._task: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()
        self.watchers: list[Callable[[dict[str, Worker]], None]] = []
        """Called with the workers after every change of membership, state or load (the KV index's sources)."""

    # ---- membership ------------------------------------------------------------

    def add(self, worker: Worker) -> Worker:
        if worker.address in self.workers:
            raise ValueError(f"worker {worker.address} is already known")
        if worker.channel is None:
            worker.channel = channel(worker.address, DECODE_CHANNEL_OPTIONS if worker.role == "decode" else ())
        self.workers[worker.address] = worker
        return worker

    async def remove(self, address: str) -> None:
        worker = self.workers.pop(address, None)
        if worker is not None:
            worker.set_ready(False, "removed from the pool")
            if worker.channel is not None:
                await worker.channel.close()
        await self._notify()

    def check_joins(self, info: worker_pb2.WorkerInfo) -> None:
        """Raises RegistrationRefused when the worker's model or KV layout differs from the pool's."""
        if info.role not in ("prefill", "decode"):
            raise RegistrationRefused(f"role must be prefill or decode, got {info.role!r}")
        if not info.address:
            raise RegistrationRefused("the worker sent no address to reach it at")
        if info.role == "decode" and not info.HasField("kv_layout"):
            raise RegistrationRefused(f"decode worker {info.address} sent no KV layout")
        for other in self.workers.values():
            if other.address == info.address or other.info is None or not other.info.fingerprint.digest:
                continue
            if other.info.fingerprint.digest != info.fingerprint.digest:
                raise RegistrationRefused(
                    f"{info.role} worker {info.address} serves model {_describe(info)} but the pool serves "
                    f"{_describe(other.info)} ({other.role} worker {other.address}): every worker must "
                    f"serve the same checkpoint"
                )
            if info.role == "decode" and other.role == "decode" and other.info.kv_layout != info.kv_layout:
                raise RegistrationRefused(
                    f"decode worker {info.address} has KV layout [{_layout(info.kv_layout)}] but the pool has "
                    f"[{_layout(other.info.kv_layout)}] (decode worker {other.address})"
                )

    async def register(self, info: worker_pb2.WorkerInfo) -> Worker:
        """Adds (or revives) a worker that called Register; raises RegistrationRefused."""
        self.check_joins(info)
        worker = self.workers.get(info.address)
        if worker is not None and worker.role != info.role:
            await self.remove(info.address)
            worker = None
        if worker is None:
            worker = self.add(Worker(info.address, info.role))  # type: ignore[arg-type]
        now = time.monotonic()
        worker.registered = True
        worker.reported(info, now)
        worker.last_heartbeat = now
        worker.draining = info.draining
        worker.set_ready(True)
        log.info("%s worker %s registered: model %s", info.role, info.address, _describe(info))
        await self._notify()
        return worker

    async def heartbeat(self, info: worker_pb2.WorkerInfo) -> bool:
        """False when the worker is unknown (this coordinator restarted): it must register again."""
        worker = self.workers.get(info.address)
        if worker is None or not worker.registered or worker.role != info.role:
            return False
        now = time.monotonic()
        worker.reported(info, now)
        worker.last_heartbeat = now
        if info.draining and not worker.draining:
            log.info("%s worker %s is draining", worker.role, worker.address)
        worker.draining = worker.draining or info.draining
        if not worker.ready:
            worker.set_ready(True)
        await self._notify()
        return True

    # ---- health ----------------------------------------------------------------

    def ready(self, role: Tier) -> list[Worker]:
        """The workers of a tier that take new work (ready, not draining)."""
        return [w for w in self.workers.values() if w.role == role and w.routable]

    @property
    def serving(self) -> bool:
        """A decode worker takes work (without a prefill worker, it prefills locally)."""
        return bool(self.ready("decode"))

    async def mark_failed(self, worker: Worker, reason: str) -> None:
        """A call to the worker found it unreachable or silent: route around it until its health check (the
        next GetInfo round, or heartbeat) finds it answering."""
        if worker.set_ready(False, reason):
            worker.failed_by_call = True
            await self._notify()

    def awaiting_recheck(self, role: Tier) -> bool:
        """A worker of the tier was marked dead by a call and its health has not been checked since."""
        return any(w.role == role and w.failed_by_call and not w.draining for w in self.workers.values())

    @property
    def recheck_seconds(self) -> float:
        """How long the health check of a worker marked dead by a call may take: two rounds."""
        return 2 * self.refresh_seconds + self.get_info_timeout

    @property
    def get_info_timeout(self) -> float:
        return max(1.0, 2 * self.refresh_seconds)

    async def recheck(self, role: Tier, timeout: float) -> None:
        """Returns once the tier has a ready worker or none awaits its health check (that worker is back,
        or dead), or after `timeout` seconds."""
        end = time.monotonic() + timeout
        while not self.ready(role) and self.awaiting_recheck(role) and (left := end - time.monotonic()) > 0:
            await self.changed(left)

    async def changed(self, timeout: float) -> None:
        """Returns when the pool's state or load changes, or after `timeout` seconds."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._changed.wait()), timeout)

    def poke(self) -> None:
        """Wakes everyone waiting in `changed` (a request finished, so capacity freed)."""
        self._changed.set()
        self._changed = asyncio.Event()

    # ---- refresh ---------------------------------------------------------------

    async def refresh(self) -> None:
        """One GetInfo round over every worker, the heartbeat deadlines, then a health update."""
        await asyncio.gather(*(self._refresh_one(w) for w in list(self.workers.values())))
        now = time.monotonic()
        for worker in list(self.workers.values()):
            if worker.registered and worker.dead_since is not None and now - worker.dead_since > self.forget_seconds:
                log.info("%s worker %s forgotten after %.0f s dead", worker.role, worker.address, self.forget_seconds)
                await self.remove(worker.address)
        await self._notify()

    async def _refresh_one(self, worker: Worker) -> None:
        assert worker.channel is not None
        stub = worker_pb2_grpc.ControlStub(worker.channel)
        try:
            info = await stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=self.get_info_timeout)
        except grpc.aio.AioRpcError as e:
            silent = time.monotonic() - worker.last_seen
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and worker.ready and silent < self.heartbeat_timeout:
                # slow, not gone: a worker starved of CPU for a moment keeps its streams (a dead one refuses
                # connections at once; a hung one is dead once silent for heartbeat_timeout)
                log.info("%s worker %s slow to answer GetInfo (%.1f s since its last answer)", worker.role,
                         worker.address, silent)
                return
            worker.set_ready(False, f"GetInfo: {e.code().name} {e.details()}" +
                             (f" (silent for {silent:.1f} s)" if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED else ""))
            return
        finally:
            worker.failed_by_call = False  # its health is checked: what follows says ready or dead
        if info.role and info.role != worker.role:
            if worker.ready or worker.info is None:
                log.error("worker %s was given as %s but says it is %s", worker.address, worker.role, info.role)
            worker.info = info
            worker.set_ready(False, f"it says it is a {info.role} worker")
            return
        if worker.role == "decode" and not info.HasField("kv_layout"):
            worker.info = info
            worker.set_ready(False, "it reports no KV layout: cannot route to it")
            return
        now = time.monotonic()
        if worker.registered and now - worker.last_heartbeat > self.heartbeat_timeout:
            worker.set_ready(False, f"no heartbeat for {now - worker.last_heartbeat:.1f} s")
            return
        if info.draining and not worker.draining:
            log.info("%s worker %s is draining", worker.role, worker.address)
        worker.draining = worker.draining or info.draining
        worker.reported(info, now)
        worker.set_ready(True)

    async def _notify(self) -> None:
        self.poke()
        for watch in self.watchers:
            watch(self.workers)
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
