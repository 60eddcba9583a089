"""A worker's membership in a coordinator's pool (`--coordinator`): Register, then Heartbeat.

1. `start()` registers (waiting up to `connect_seconds` for the coordinator to come up). A refusal
   (FAILED_PRECONDITION: another model or KV layout) raises SystemExit with the coordinator's message.
2. A background task heartbeats the worker's info (load, draining) every `heartbeat_seconds`; when
   the coordinator answers `known=False` (it restarted) the worker registers again.
3. On SIGTERM the worker sets draining and calls `beat()` at once, so no new work is routed to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import grpc

from pdserve.v1 import worker_pb2 as pb
from pdserve.v1 import worker_pb2_grpc
from pdserve.server.serving import channel

log = logging.getLogger("pdserve.registration")


class Registration:
    def __init__(self, coordinator: str, info: Callable[[], pb.WorkerInfo], *, connect_seconds: float = 60.0):
        self.coordinator = coordinator
        self.info = info
        self.connect_seconds = connect_seconds
        self.heartbeat_seconds = 0.5
        self._channel = channel(coordinator)
        self._stub = worker_pb2_grpc.RegistryStub(self._channel)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self._register(wait=True)
        self._task = asyncio.create_task(self._beat_forever(), name="heartbeat")

    async def _register(self, wait: bool) -> None:
        info = self.info()
        try:
            reply = await self._stub.Register(
                pb.RegisterRequest(info=info), timeout=self.connect_seconds if wait else 5.0, wait_for_ready=wait
            )
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise SystemExit(f"the coordinator at {self.coordinator} refused this worker: {e.details()}") from e
            if wait:
                raise SystemExit(
                    f"cannot register with the coordinator at {self.coordinator}: {e.code().name} {e.details()}"
                ) from e
            raise
        if reply.heartbeat_seconds > 0:
            self.heartbeat_seconds = reply.heartbeat_seconds
        log.info("registered as %s worker %s with the coordinator at %s", info.role, info.address, self.coordinator)

    async def beat(self) -> None:
        """One heartbeat now (registers again when the coordinator does not know this worker)."""
        reply = await self._stub.Heartbeat(pb.HeartbeatRequest(info=self.info()), timeout=2.0)
        if not reply.known:
            log.warning("the coordinator at %s does not know this worker; registering again", self.coordinator)
            await self._register(wait=False)

    async def _beat_forever(self) -> None:
        failing = False
        while True:
            await asyncio.sleep(self.heartbeat_seconds)
            try:
                await self.beat()
                if failing:
                    log.info("heartbeats reach the coordinator at %s again", self.coordinator)
                failing = False
            except SystemExit as e:  # refused on re-registration: a new pool with another model
                log.error("%s", e)
                raise
            except grpc.aio.AioRpcError as e:
                if not failing:
                    log.warning("heartbeat to %s failed: %s %s", self.coordinator, e.code().name, e.details())
                failing = True

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, SystemExit):
                await self._task
        await self._channel.close()


async def join(worker, coordinator: str, info: Callable[[], pb.WorkerInfo]) -> None:
    """Registers a started worker (`worker.registration`); a refusal stops it and exits non-zero."""
    worker.registration = Registration(coordinator, info)
    try:
        await worker.registration.start()
    except SystemExit:
        await worker.stop(0)
        raise


async def serve_until_signal(worker, role: str, drain_seconds: float) -> None:
    """Serves until SIGINT or SIGTERM, then drains (in-flight work finishes) and stops."""
    from pdserve.server.serving import wait_for_signal

    await wait_for_signal()
    log.info("%s worker draining", role)
    await worker.drain(drain_seconds)
    log.info("%s worker stopping", role)
    await worker.stop()
