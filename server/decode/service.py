"""The decode worker's gRPC face: Decode (stream), Abort, KV push, worker info.

It serves any engine through the decode engine contract (`engine_api.Engine`): the native `DecodeEngine`,
the vLLM adapter `VllmEngine`, `FakeEngine` (`fake_engine.py`). A Decode call: admission (`admission.py`: the checks, the
engine's queue, the wait for blocks), its first token (`first_token.py`: the prefill worker's KV, or a local
prefill), its output (`output_stream.py`: on the call, or riding a Steps stream)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from pdserve.kvcache.receiver import KvReceiver
from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.v1 import worker_pb2 as pb
from pdserve.v1 import worker_pb2_grpc
from pdserve.server import logs
from pdserve.server.decode.admission import admit, reserved, until_admitted
from pdserve.server.decode.engine_api import Engine
from pdserve.server.decode.first_token import KvArrival, LocalPrefill
from pdserve.server.decode.output_stream import ride_steps, stream_tokens
from pdserve.server.decode.sequence import SeqState
from pdserve.server.decode.steps_stream import StepRelay, StepStream

log = logging.getLogger("pdserve.decode")


class DecodeService(worker_pb2_grpc.DecodeServicer, worker_pb2_grpc.ControlServicer):
    def __init__(self, engine: Engine, receiver: KvReceiver, *, fingerprint: str, description: str,
                 address: str = "", kv_address: str = ""):
        self.engine = engine
        self.receiver = receiver
        self.fingerprint = fingerprint
        self.description = description
        self.address = address
        self.kv_address = kv_address
        self.draining = False
        self.kv_events: pb.KvEventsSource | None = None
        """Where its KV events can be read (--kv-events-config), for the coordinator's index; None: off."""
        """SIGTERM: new Decode calls are refused (UNAVAILABLE), in-flight ones finish."""
        self.vocab_size = engine.vocab_size
        self.step_streams: dict[str, StepStream] = {}
        """Open Steps streams by id: one per coordinator connection."""
        self._stream_ends: dict[str, asyncio.Future[None]] = {}
        """Each open Steps call's end (its status sent), by stream id."""

    async def Decode(self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.DecodeResponse]:
        rid = request.request_id
        logs.request_id.set(rid)  # every line logged for this request names it
        # its output: for this call, or (on a Steps stream) in a relay until it rides the stream
        relay = StepRelay() if request.steps_stream_id else None
        events: asyncio.Queue[list[int] | None] = asyncio.Queue()
        seq = await admit(self.engine, request, events if relay is None else relay, context,
                          draining=self.draining, open_streams=self.step_streams)
        try:
            async for queued in until_admitted(self.engine, seq):
                yield queued
            if seq.state is SeqState.FINISHED:  # aborted while it waited
                yield pb.DecodeResponse(finished=pb.Finished(reason=seq.finish_reason))
                return
            # computed here (no prefill worker alive, or this worker holds all but a short suffix), or its KV
            # expected from now on
            local = request.local_prefill or seq.local_prefill
            first = LocalPrefill(self.engine, seq, fallback=request.local_prefill) if local \
                else KvArrival(self.receiver, seq, request, self.vocab_size)
            yield reserved(seq, local)
            first_token, first_event = await first.first_token(context)
            if relay is not None:
                await ride_steps(self.step_streams, request.steps_stream_id, self.engine, seq, relay, first_token,
                                 first_event, context)
                return
            async for response in stream_tokens(self.engine, seq, events, first_token, first_event):
                yield response
        finally:
            self.receiver.cancel(rid)
            await self.receiver.settle(rid)  # a piece being written in its thread lands before the free
            self.engine.abort(rid, gen_pb.FINISH_REASON_ABORT)  # frees its blocks, now or after the step using them

    async def Steps(self, request: pb.StepsRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.StepBatch]:
        if not request.stream_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "stream_id must not be empty")
        if request.stream_id in self.step_streams:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                f"Steps stream {request.stream_id} is already open; pick a fresh stream_id")
        stream = self.step_streams[request.stream_id] = StepStream(request.stream_id)
        ended = self._stream_ends[request.stream_id] = asyncio.get_running_loop().create_future()

        def done(_) -> None:  # the call is over, its status sent
            self._stream_ends.pop(request.stream_id, None)
            if not ended.done():
                ended.set_result(None)

        context.add_done_callback(done)
        try:
            async for batch in stream.batches():
                yield batch
        finally:
            del self.step_streams[request.stream_id]
            stream.close(lambda rid: self.engine.abort(rid, gen_pb.FINISH_REASON_ABORT))

    async def end_streams(self, seconds: float) -> None:
        """Draining, its requests done: each Steps stream sends its last batch and ends; waits up to
        `seconds` for the coordinators to have read them (a slow one holds the last batch back)."""
        for stream in list(self.step_streams.values()):
            stream.end()
        ends = [f for f in self._stream_ends.values() if not f.done()]
        if ends:
            _, late = await asyncio.wait(ends, timeout=seconds)
            if late:
                log.warning("drain: %d Steps stream(s) still sending after %.0f s; closing them", len(late), seconds)

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        return pb.AbortResponse(found=self.engine.abort(request.request_id, gen_pb.FINISH_REASON_ABORT))

    async def GetInfo(self, request: pb.GetInfoRequest, context) -> pb.WorkerInfo:
        return self.info()

    def info(self) -> pb.WorkerInfo:
        engine = self.engine
        return pb.WorkerInfo(
            role="decode",
            address=self.address,
            fingerprint=pb.ModelFingerprint(digest=self.fingerprint, description=self.description),
            kv_layout=engine.layout.to_proto(),
            load=engine.load(),
            max_model_len=engine.max_model_len,
            draining=self.draining,
            kv_address=self.kv_address,
            hardware=engine.hardware.to_proto() if engine.hardware is not None else None,
            kv_events=self.kv_events,
        )

