"""The coordinator's side of batched decode streams: one `Steps` stream per decode worker, fanned out.

1. The first request routed to a decode worker opens `Steps(stream_id)` on it and waits for the empty
   batch that says it is open; requests then name the stream in `DecodeRequest.steps_stream_id`.
2. Each request registers a `Route` under its worker request id before its Decode call goes out. The
   stream's reader puts every `SequenceEvent` of every batch on its request's route, in order.
3. The stream ends (the worker died, or closed it): every route gets `StreamBroken` (the attempt is lost
   and migrates); the next request opens a fresh stream.
4. A worker without `Steps` (UNIMPLEMENTED, an older build) is served per request, one message per token.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections import deque

import grpc

from pdserve.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger("pdserve.coordinator")

DECODE_CHANNEL_OPTIONS = [("grpc.http2.bdp_probe", 0)]
"""The channel to a decode worker keeps HTTP/2's fixed 64 KiB stream window (no BDP probing, which grows
it to megabytes): a coordinator that falls behind then holds back the worker's next StepBatch, the
worker puts every step that piles up meanwhile into it, and each request's tokens of those steps reach
its client as one response. Coalescing at the source, in proportion to the lag; with a large window a
lagging coordinator would read a backlog of one-step batches instead (nothing merged, latency growing)."""
OPEN_TIMEOUT_S = 5.0
"""How long opening a Steps stream may take before the request falls back to its own stream."""
REOPEN_AFTER_S = 5.0
"""After a failed open, requests go per request this long before the next try."""


class StreamBroken(Exception):
    """The Steps stream carrying a request's events ended before the request did."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None):
        super().__init__(message)
        self.code = code
        """The stream's status (UNAVAILABLE: the worker is gone), None when it ended otherwise."""


DecodeEvent = worker_pb2.SequenceEvent | worker_pb2.DecodeResponse
"""One event of a decode stream: `tokens`, `finished` or `queued` (a batch's, or a per-request call's)."""


class Route:
    """One attempt's events, as they arrive: taken all at once, so a slow reader gets several together.

    A wait for events may be limited (`take(timeout)`, the stall limit): one timer per route, re-armed
    only when it fires early, rather than a timer per event (the per-token path sets none)."""

    def __init__(self) -> None:
        self.items: deque[DecodeEvent | Exception] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._since = 0.0
        """When the current wait began (the loop's clock)."""
        self._limit: float | None = None
        self._timer: asyncio.TimerHandle | None = None

    def put(self, item: DecodeEvent | Exception) -> None:
        self.items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take(self, timeout: float | None) -> list[DecodeEvent | Exception]:
        """Everything that arrived, waiting up to `timeout` for something; raises TimeoutError."""
        if not self.items:
            loop = asyncio.get_running_loop()
            self._waiter = waiter = loop.create_future()
            self._limit = timeout
            if timeout is not None:
                self._since = loop.time()
                ends = self._since + timeout
                if self._timer is None or self._timer.when() > ends:
                    if self._timer is not None:
                        self._timer.cancel()
                    self._timer = loop.call_at(ends, self._expire)
            try:
                await waiter
            finally:
                self._waiter = None
        items = list(self.items)
        self.items.clear()
        return items

    def _expire(self) -> None:
        """The timer: a wait older than its limit ends in TimeoutError; else the timer waits for it."""
        self._timer = None
        waiter, limit = self._waiter, self._limit
        if waiter is None or waiter.done() or limit is None:
            return  # no limited wait now: the next one arms the timer
        loop = asyncio.get_running_loop()
        if loop.time() - self._since >= limit:
            waiter.set_exception(TimeoutError())
        else:
            self._timer = loop.call_at(self._since + limit, self._expire)

    def close(self) -> None:
        """The attempt is over: its timer goes."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class StepsClient:
    """One decode worker's Steps stream from this coordinator, and the routes of the requests on it."""

    def __init__(self, channel: grpc.aio.Channel, address: str):
        self.channel = channel
        self.address = address
        self.stream_id = ""
        self.routes: dict[str, Route] = {}
        self.supported = True
        """False once the worker answered UNIMPLEMENTED: it only streams per request."""
        self._opening: asyncio.Future[bool] | None = None
        self._reader: asyncio.Task[None] | None = None
        self._failed_at = -REOPEN_AFTER_S

    @property
    def open(self) -> bool:
        return self._reader is not None and not self._reader.done()

    async def ensure_open(self) -> bool:
        """Whether requests may ride the stream now (opening it if needed)."""
        if not self.supported:
            return False
        if self.open:
            return True
        if time.monotonic() - self._failed_at < REOPEN_AFTER_S and (self._opening is None or self._opening.done()):
            return False
        if self._opening is None or self._opening.done():
            self._opening = asyncio.ensure_future(self._open())
        return await asyncio.shield(self._opening)

    async def _open(self) -> bool:
        stream_id = secrets.token_hex(8)
        call = worker_pb2_grpc.DecodeStub(self.channel).Steps(worker_pb2.StepsRequest(stream_id=stream_id))
        try:
            first = await asyncio.wait_for(call.read(), OPEN_TIMEOUT_S)
        except (grpc.aio.AioRpcError, TimeoutError) as e:
            call.cancel()
            self._failed_at = time.monotonic()
            if isinstance(e, grpc.aio.AioRpcError) and e.code() == grpc.StatusCode.UNIMPLEMENTED:
                self.supported = False
                log.info("decode worker %s has no Steps stream (an older build): one message per token", self.address)
            return False
        if first is grpc.aio.EOF:
            self._failed_at = time.monotonic()
            return False
        self.stream_id = stream_id
        self._reader = asyncio.create_task(self._read(call), name=f"steps-{self.address}")
        return True

    def route(self, request_id: str) -> Route:
        route = self.routes[request_id] = Route()
        return route

    def unroute(self, request_id: str) -> None:
        self.routes.pop(request_id, None)

    async def _read(self, call: grpc.aio.UnaryStreamCall) -> None:
        why, code = "it ended", None
        try:
            while (batch := await call.read()) is not grpc.aio.EOF:  # read(), as _open began (not async for)
                routes = self.routes
                for event in batch.events:
                    route = routes.get(event.request_id)
                    if route is not None:  # else: an attempt already given up
                        route.put(event)
        except grpc.aio.AioRpcError as e:
            why, code = f"{e.code().name}: {e.details()}", e.code()
        except asyncio.CancelledError:
            why = "the coordinator closed it"
            raise
        except Exception as e:  # a bug: say so, and fail the requests riding it over to another attempt
            why = repr(e)
            log.exception("decode worker %s's Steps stream reader failed", self.address)
        finally:
            broken = StreamBroken(f"decode worker {self.address}'s Steps stream broke ({why})", code)
            for route in self.routes.values():
                route.put(broken)
            call.cancel()

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader


class StepsClients:
    """A StepsClient per decode worker (by identity: a worker that rejoins gets a fresh one)."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._clients: dict[int, tuple[object, StepsClient]] = {}

    async def for_worker(self, worker) -> StepsClient | None:
        """The worker's open Steps stream, or None: stream this request on its own call."""
        if not self.enabled or worker.channel is None:
            return None
        held = self._clients.get(id(worker))
        if held is None or held[0] is not worker:
            held = self._clients[id(worker)] = (worker, StepsClient(worker.channel, worker.address))
        client = held[1]
        return client if await client.ensure_open() else None

    async def close(self) -> None:
        for _, client in self._clients.values():
            await client.close()
        self._clients.clear()
