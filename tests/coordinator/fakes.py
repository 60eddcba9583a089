"""Scripted prefill and decode workers, served in-process, for driving the coordinator.

FakePrefill answers a scripted first token and "pushes the KV" by telling the FakeDecode registered
under the target address (checking the transfer token). FakeDecode sends `reserved`, waits for that
KV under the lease (or, asked to prefill locally, "computes" the prompt and sends its first token), then
sends the scripted token events and `finished` (or hangs until cancelled).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import grpc

from pdserve.v1 import generation_pb2, worker_pb2, worker_pb2_grpc

FinishReason = generation_pb2.FinishReason

LAYOUT = worker_pb2.KvLayout(
    num_layers=2, num_kv_heads=2, head_dim=32, block_size=16, dtype="float32", scale_granularity="none"
)


def worker_info(role: str, address: str, digest: str = "abc", free: int = 100, layout=LAYOUT,
                **load) -> worker_pb2.WorkerInfo:
    """A worker's GetInfo / Register report (prefill workers have no KV layout)."""
    return worker_pb2.WorkerInfo(
        role=role, address=address,
        fingerprint=worker_pb2.ModelFingerprint(digest=digest, description="tiny llama"),
        kv_layout=layout if role == "decode" else None,
        load=worker_pb2.WorkerLoad(free_kv_blocks=free, total_kv_blocks=100, **load),
    )


def fake_logprob(token_id: int, num_top: int) -> generation_pb2.TokenLogprob:
    """What the fakes return when asked for logprobs: token i has logprob -i/100 and is the most likely."""
    return generation_pb2.TokenLogprob(token_id=token_id, logprob=-token_id / 100,
                                       top_token_ids=[token_id][:num_top], top_logprobs=[-token_id / 100][:num_top])


class FakeControl(worker_pb2_grpc.ControlServicer):
    def __init__(self, role: str):
        self.role = role
        self.address = ""
        self.healthy = True
        self.delay = 0.0
        """Seconds GetInfo takes to answer (a worker starved of CPU)."""
        self.load = worker_pb2.WorkerLoad(free_kv_blocks=100, total_kv_blocks=100)
        self.prefill_order = ""

    async def GetInfo(self, request, context):
        if self.delay:
            await asyncio.sleep(self.delay)
        if not self.healthy:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "fake worker is down")
        return worker_pb2.WorkerInfo(
            role=self.role, address=self.address, kv_layout=LAYOUT, load=self.load, max_model_len=512,
            prefill_order=self.prefill_order, prefill_deadlines=self.role == "prefill",
        )

    def add_to(self, server: grpc.aio.Server) -> None:
        worker_pb2_grpc.add_ControlServicer_to_server(self, server)


class FakeDecode(worker_pb2_grpc.DecodeServicer):
    def __init__(self) -> None:
        self.events: list[list[int]] = []
        """Token events sent after the KV arrives (the ids after the first token)."""
        self.finish: int | None = FinishReason.FINISH_REASON_LENGTH
        """The `finished` reason sent after the events; None: hang until cancelled."""
        self.finish_message = ""
        self.refuse: grpc.StatusCode | None = None
        """Refuse the call with this code before `reserved`."""
        self.refuse_calls: int | None = None
        """Refuse only this many calls, then serve (None: every call while `refuse` is set)."""
        self.queued = 0
        """`queued` events sent before `reserved` and before every token event (a request waiting for blocks)."""
        self.kv_wait_limit: float | None = None
        """How long the KV may take to arrive (None: the request's lease); longer stands for a transfer
        whose chunks keep arriving, each restarting the lease."""
        self.local_first_token = 0
        """A local prefill's (DecodeRequest.local_prefill: no prefill worker) first token."""
        self.local_prefill: asyncio.Event | None = None
        """A local prefill computes until this is set (None: it ends at once)."""
        self.cached_blocks = 0
        """The prompt blocks `reserved` says its prefix cache held."""
        self.chooses_local = False
        """Offered conditional disaggregation (DecodeRequest.local_prefill_max_uncached), it prefills locally."""
        self.die_after: int | None = None
        """After this many events the worker dies (its server stops at once)."""
        self.server: grpc.aio.Server | None = None
        self.death: asyncio.Task[None] | None = None
        self.requests: list[worker_pb2.DecodeRequest] = []
        self.cancelled = asyncio.Event()
        self.completed = asyncio.Event()
        self.aborted: list[str] = []
        self.kv_pushes: list[worker_pb2.PrefillRequest] = []
        self.steps = False
        """Serve `Steps` (else UNIMPLEMENTED): a request riding the stream gets all its token events and
        its `finished` in ONE StepBatch, as a worker sends the steps that piled up while the coordinator
        was behind."""
        self.step_streams: dict[str, asyncio.Queue[worker_pb2.StepBatch]] = {}
        self._kv: dict[str, asyncio.Event] = {}
        self._tokens: dict[str, bytes] = {}

    def push_kv(self, request: worker_pb2.PrefillRequest) -> None:
        self.kv_pushes.append(request)
        if self._tokens.get(request.request_id) == request.transfer_token:
            self._kv[request.request_id].set()

    async def Decode(self, request, context):
        # The handler sees a client's cancel as CancelledError (context.cancelled() stays False).
        self.requests.append(request)
        try:
            async for response in self._decode(request, context):
                yield response
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        self.completed.set()

    async def _decode(self, request, context):
        if self.refuse is not None and self.refuse_calls != 0:
            if self.refuse_calls is not None:
                self.refuse_calls -= 1
            await context.send_initial_metadata((("retry-after-ms", "250"),))
            await context.abort(self.refuse, "fake decode: 0 free KV blocks; you may retry")
        self._kv[request.request_id] = asyncio.Event()
        self._tokens[request.request_id] = request.transfer_token
        for i in range(self.queued):
            yield worker_pb2.DecodeResponse(queued=worker_pb2.Queued(position=self.queued - 1 - i))
        local = request.local_prefill or (self.chooses_local and request.local_prefill_max_uncached > 0)
        yield worker_pb2.DecodeResponse(reserved=worker_pb2.Reserved(num_blocks=2, cached_blocks=self.cached_blocks,
                                                                     local_prefill=local))
        first: list[worker_pb2.TokenEvent] = []
        if local:
            if self.local_prefill is not None:
                await self.local_prefill.wait()
            first.append(worker_pb2.TokenEvent(token_ids=[self.local_first_token]))
        else:
            try:
                limit = self.kv_wait_limit or request.lease_seconds
                await asyncio.wait_for(self._kv[request.request_id].wait(), limit)
            except TimeoutError:
                yield worker_pb2.DecodeResponse(
                    finished=worker_pb2.Finished(
                        reason=FinishReason.FINISH_REASON_ERROR, message="KV lease expired"
                    )
                )
                return
        stream = self.step_streams.get(request.steps_stream_id)
        if stream is not None:
            await self._send_on_stream(request, stream, first)
            return
        for event in first:
            yield worker_pb2.DecodeResponse(tokens=event)
        for n, ids in enumerate(self.events):
            if n == self.die_after:
                await self._die()
            for i in range(self.queued):  # preempted, waiting for blocks again
                yield worker_pb2.DecodeResponse(queued=worker_pb2.Queued(position=i))
            logprobs = ([fake_logprob(i, request.sampling.logprobs) for i in ids]
                        if request.sampling.HasField("logprobs") else [])
            yield worker_pb2.DecodeResponse(tokens=worker_pb2.TokenEvent(token_ids=ids, logprobs=logprobs))
        if self.die_after is not None:
            await self._die()
        if self.finish is None:
            await asyncio.Event().wait()
        yield worker_pb2.DecodeResponse(
            finished=worker_pb2.Finished(reason=self.finish, message=self.finish_message)  # type: ignore[arg-type]
        )

    async def Steps(self, request, context):
        if not self.steps:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "fake decode: no Steps stream")
        stream = self.step_streams[request.stream_id] = asyncio.Queue()
        yield worker_pb2.StepBatch()
        while True:
            yield await stream.get()

    async def _send_on_stream(self, request, stream: asyncio.Queue,
                              first: list[worker_pb2.TokenEvent]) -> None:
        """Every token event (`first`: a local prefill's first token), then `finished`, in one StepBatch
        (the Decode call then ends OK)."""
        def event(**kw) -> worker_pb2.SequenceEvent:
            return worker_pb2.SequenceEvent(request_id=request.request_id, **kw)

        batch = worker_pb2.StepBatch(events=[event(tokens=tokens) for tokens in first])
        for ids in self.events:
            logprobs = ([fake_logprob(i, request.sampling.logprobs) for i in ids]
                        if request.sampling.HasField("logprobs") else [])
            batch.events.append(event(tokens=worker_pb2.TokenEvent(token_ids=ids, logprobs=logprobs)))
        if self.finish is not None:
            batch.events.append(event(finished=worker_pb2.Finished(reason=self.finish, message=self.finish_message)))
        stream.put_nowait(batch)
        if self.finish is None:
            await asyncio.Event().wait()

    async def _die(self) -> None:
        # Stopped from its own task: stopping the server cancels this handler.
        assert self.server is not None
        self.death = asyncio.create_task(self.server.stop(0))
        await asyncio.Event().wait()

    async def Abort(self, request, context):
        self.aborted.append(request.request_id)
        return worker_pb2.AbortResponse(found=request.request_id in self._kv)

    def add_to(self, server: grpc.aio.Server) -> None:
        worker_pb2_grpc.add_DecodeServicer_to_server(self, server)


class FakePrefill(worker_pb2_grpc.PrefillServicer):
    def __init__(self) -> None:
        self.first_token_id = 0
        self.fail: grpc.StatusCode | None = None
        self.hang = False
        """Never answer: the call stays pending until cancelled."""
        self.push_after: asyncio.Event | None = None
        """The first token is answered at once, the KV reaches the decode worker once this is set (a KV
        still leaving the prefill worker); None: at once."""
        self._pushes: set[asyncio.Task[None]] = set()
        self.decoders: dict[str, FakeDecode] = {}
        """Decode workers by address: where the "KV" goes."""
        self.requests: list[worker_pb2.PrefillRequest] = []
        self.cancelled = asyncio.Event()

    async def Prefill(self, request, context):
        self.requests.append(request)
        if self.fail is not None:
            await context.abort(self.fail, "fake prefill failed")
        if self.hang:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        target = self.decoders.get(request.target.address)
        if target is not None and self.push_after is None:
            target.push_kv(request)
        elif target is not None:
            push = asyncio.create_task(self._push_later(target, request, self.push_after))
            self._pushes.add(push)
            push.add_done_callback(self._pushes.discard)
        response = worker_pb2.PrefillResponse(first_token_id=self.first_token_id, prefill_seconds=0.001)
        if request.sampling.HasField("logprobs"):
            response.first_token_logprob.CopyFrom(fake_logprob(self.first_token_id, request.sampling.logprobs))
        return response

    @staticmethod
    async def _push_later(target: FakeDecode, request: worker_pb2.PrefillRequest,
                          after: asyncio.Event) -> None:
        await after.wait()
        target.push_kv(request)

    def add_to(self, server: grpc.aio.Server) -> None:
        worker_pb2_grpc.add_PrefillServicer_to_server(self, server)


@dataclass
class FakeWorker:
    """One in-process worker server: Control plus Prefill or Decode."""

    server: grpc.aio.Server
    address: str
    control: FakeControl
    service: FakePrefill | FakeDecode

    @classmethod
    async def start(cls, role: str, service: FakePrefill | FakeDecode) -> FakeWorker:
        server = grpc.aio.server()
        control = FakeControl(role)
        control.add_to(server)
        service.add_to(server)
        port = server.add_insecure_port("127.0.0.1:0")
        control.address = f"127.0.0.1:{port}"
        if isinstance(service, FakeDecode):
            service.server = server
        await server.start()
        return cls(server, control.address, control, service)

    async def stop(self) -> None:
        if isinstance(self.service, FakeDecode) and self.service.death is not None:
            await self.service.death
        else:
            await self.server.stop(0)


async def wait_for(event: asyncio.Event, timeout: float = 5.0) -> bool:
    try:
        await asyncio.wait_for(event.wait(), timeout)
    except TimeoutError:
        return False
    return True


@dataclass
class FakePools:
    """A real coordinator in front of one fake prefill and one fake decode worker."""

    coordinator: object  # pdserve.server.coordinator.main.Coordinator
    prefill: FakePrefill
    decode: FakeDecode
    prefill_worker: FakeWorker
    decode_worker: FakeWorker

    async def stop(self) -> None:
        await self.coordinator.stop(0)
        await self.prefill_worker.stop()
        await self.decode_worker.stop()


async def start_fake_pools(model_dir, **config) -> FakePools:
    """Starts both fakes and a coordinator routing to them (extra CoordinatorConfig fields in config)."""
    from pdserve.server.coordinator.config import CoordinatorConfig
    from pdserve.server.coordinator.main import start

    decode, prefill = FakeDecode(), FakePrefill()
    decode_worker = await FakeWorker.start("decode", decode)
    prefill_worker = await FakeWorker.start("prefill", prefill)
    prefill.decoders[decode_worker.address] = decode
    coordinator = await start(CoordinatorConfig(
        model_dir, port=0, prefill_addresses=[prefill_worker.address],
        decode_addresses=[decode_worker.address], **{"refresh_seconds": 0.1, "lease_seconds": 5, **config},
    ))
    for _ in range(100):
        if coordinator.pool.ready("prefill") and coordinator.pool.ready("decode"):
            break
        await asyncio.sleep(0.05)
    return FakePools(coordinator, prefill, decode, prefill_worker, decode_worker)
