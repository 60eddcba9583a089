"""The decode worker's gRPC face: Decode (stream), Abort, KV push, worker info.

It serves any engine through the decode engine contract (`engine_api.Engine`): the native `DecodeEngine`,
the vLLM adapter `VllmEngine`, the benchmarks' fake."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from pdserve.kvcache.receiver import KvReceiver
from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.v1 import worker_pb2 as pb
from pdserve.v1 import worker_pb2_grpc
from pdserve.server import logs, metrics, request_checks, serving
from pdserve.server.decode.engine_api import Engine
from pdserve.server.decode.scheduler import QueueFull
from pdserve.server.decode.sequence import Sequence, SeqState
from pdserve.server.decode.steps_stream import StepRelay, StepSink, StepStream
from pdserve.server.structured.spec import SpecError

log = logging.getLogger("pdserve.decode")

QUEUED_EVERY_S = 1.0
"""While a request waits for blocks (queued, or preempted), a `queued` event this often: the worker is alive."""


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
        """SIGTERM: new Decode calls are refused (UNAVAILABLE), in-flight ones finish."""
        self.vocab_size = engine.vocab_size
        self.step_streams: dict[str, StepStream] = {}
        """Open Steps streams by id: one per coordinator connection."""
        self._stream_ends: dict[str, asyncio.Future[None]] = {}
        """Each open Steps call's end (its status sent), by stream id."""

    def _request_problem(self, request: pb.DecodeRequest) -> str | None:
        """What is wrong with a DecodeRequest, whoever sent it (INVALID_ARGUMENT), or None."""
        remaining = request.sampling.max_tokens - request.num_output_tokens
        return (request_checks.identity_problem(request.request_id, request.transfer_token)
                or request_checks.ids_problem("prompt_token_ids", request.prompt_token_ids, self.vocab_size)
                or request_checks.sampling_problem(request.sampling, self.vocab_size)
                or (f"num_output_tokens {request.num_output_tokens} must be below sampling.max_tokens "
                    f"{request.sampling.max_tokens}" if remaining <= 0 else None)
                # max_tokens is a limit, not a reservation: the prompt must leave room for one token
                or request_checks.length_problem("prompt_token_ids", len(request.prompt_token_ids), 1,
                                                 self.engine.max_model_len)
                or request_checks.lease_problem(request.lease_seconds))

    def _stream_problem(self, stream_id: str) -> str | None:
        if stream_id and stream_id not in self.step_streams:
            return f"no Steps stream {stream_id!r} is open here: open it (Steps) before naming it"
        return None

    async def Decode(self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.DecodeResponse]:
        engine = self.engine
        rid = request.request_id
        logs.request_id.set(rid)  # every line logged for this request names it
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "decode worker is draining; pick another")
        if rid in engine.sequences:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request {rid} is already decoding here")
        problem = self._request_problem(request) or self._stream_problem(request.steps_stream_id)
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        # its output: for this call, or (on a Steps stream) in a relay until it rides the stream
        relay = StepRelay() if request.steps_stream_id else None
        events: asyncio.Queue[list[int] | None] = asyncio.Queue()
        if request.sampling.structured.WhichOneof("kind") and engine.grammars is not None:
            try:  # compiled off the loop, in bounded time; `add` takes it from the cache
                await engine.grammars.prepare(request.sampling.structured)
            except SpecError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            seq = engine.add(request, events if relay is None else relay)
        except QueueFull as e:
            await context.send_initial_metadata(serving.retry_hint())
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{e}; you may retry")
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            while not seq.admitted.done():  # waits in the engine's queue; the call's deadline bounds the wait
                yield pb.DecodeResponse(queued=pb.Queued(position=engine.position(seq)))
                await asyncio.wait([seq.admitted], timeout=QUEUED_EVERY_S)
            if seq.state is SeqState.FINISHED:  # aborted while it waited
                yield pb.DecodeResponse(finished=pb.Finished(reason=seq.finish_reason))
                return
            first_event = None
            reserved = pb.Reserved(num_blocks=len(seq.block_table), cached_blocks=seq.num_hit_blocks)
            if request.local_prefill:  # no prefill worker is alive: run the prompt here
                yield pb.DecodeResponse(reserved=reserved)
                try:
                    first_token = await engine.prefill_locally(seq)
                except Exception as e:
                    log.exception("request %s: local prefill failed", rid)
                    await context.abort(grpc.StatusCode.INTERNAL, f"local prefill of {rid} failed: {e!r}")
                metrics.local_prefill_fallbacks.inc()
                first_event = pb.TokenEvent(token_ids=[first_token], logprobs=seq.logprobs[:1],
                                            prompt_logprobs=seq.prompt_logprobs)
                del seq.logprobs[:1]  # the first token's (vLLM may have sampled more already)
            else:
                transfer = self.receiver.expect(rid, request.attempt, request.transfer_token, len(seq.prompt_ids),
                                                cached_blocks=seq.num_hit_blocks)
                yield pb.DecodeResponse(reserved=reserved)
                lease = request.lease_seconds or 30.0
                try:  # the lease runs from the prefill worker's header, restarting with every chunk
                    first_token = await transfer.wait(lease)
                except TimeoutError:
                    metrics.kv_transfer_failures.inc()
                    log.warning("request %s: KV stalled for the %.1f s lease; blocks freed", rid, lease)
                    await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"KV for {rid} did not arrive within {lease:.1f} s")
                except Exception as e:  # the transfer failed: say why
                    if isinstance(e, asyncio.CancelledError):
                        raise
                    metrics.kv_transfer_failures.inc()
                    await context.abort(grpc.StatusCode.ABORTED, f"KV transfer for {rid} failed: {e}")
                if not 0 <= first_token < self.vocab_size:
                    await context.abort(grpc.StatusCode.ABORTED,
                                        f"KV transfer for {rid} failed: KvEnd.first_token_id {first_token} lies "
                                        f"outside the vocabulary [0, {self.vocab_size})")
                layout = self.receiver.layout
                seq.num_stale_blocks = max(layout.stale_tokens(len(seq.prompt_ids))) // layout.block_size
                metrics.kv_transfer_bytes.inc(transfer.bytes_received)
                metrics.kv_transfer_seconds.observe(transfer.seconds)
            if relay is not None:
                sink = self._ride(request.steps_stream_id, seq, relay, first_event)
                await self._ride_until_finished(engine, seq, sink, first_token, context)
                return
            if request.local_prefill:
                yield pb.DecodeResponse(tokens=first_event)
            engine.start(seq, first_token)
            while True:
                try:
                    ids = await asyncio.wait_for(events.get(), QUEUED_EVERY_S)
                except TimeoutError:
                    if seq.state is SeqState.WAITING:  # preempted: it waits for blocks again
                        yield pb.DecodeResponse(queued=pb.Queued(position=engine.position(seq)))
                    continue
                if ids is None:
                    break
                sent_logprobs = seq.logprobs[: len(ids)]
                del seq.logprobs[: len(ids)]
                yield pb.DecodeResponse(tokens=pb.TokenEvent(token_ids=ids, logprobs=sent_logprobs))
            message = "decode step failed" if seq.finish_reason == gen_pb.FINISH_REASON_ERROR else ""
            yield pb.DecodeResponse(finished=pb.Finished(reason=seq.finish_reason, message=message))
        finally:
            self.receiver.cancel(rid)
            await self.receiver.settle(rid)  # a piece being written in its thread lands before the free
            engine.abort(rid, gen_pb.FINISH_REASON_ABORT)  # frees its blocks, now or after the step using them

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

    def _ride(self, stream_id: str, seq: Sequence, relay: StepRelay, first: pb.TokenEvent | None) -> StepSink:
        """The request's events from now on go to the Steps stream `stream_id`. `first`: a local prefill's
        first token, sent ahead of what the engine has put meanwhile."""
        stream = self.step_streams.get(stream_id)
        if stream is None:  # it closed since the call came in
            stream = StepStream(stream_id)
            stream.closed = True
        sink = StepSink(stream, seq)
        if first is not None:
            sink.send(tokens=first)
        relay.ride(sink)  # vLLM's tokens after a local prefill's first; an abort's end
        return sink

    async def _ride_until_finished(self, engine: Engine, seq: Sequence, sink: StepSink, first_token: int,
                                   context) -> None:
        """Starts the sequence; its events go to the stream. The call ends (OK) once `finished` is out;
        UNAVAILABLE if the stream closes first."""
        engine.start(seq, first_token)
        while not sink.done.done():
            await asyncio.wait([sink.done], timeout=QUEUED_EVERY_S)
            if sink.stream.closed:
                break
            if not sink.done.done() and seq.state is SeqState.WAITING:  # preempted: it waits for blocks again
                sink.send(queued=pb.Queued(position=engine.position(seq)))
        if sink.stream.closed and (sink.cut_off or not sink.done.done()):
            sink.detach()
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"the Steps stream {sink.stream.stream_id} closed; open a new one and retry")

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
        )

