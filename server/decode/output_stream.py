"""A Decode call's output once its first token is in: on the call itself (`stream_tokens`), or on the Steps
stream the request named (`ride_steps`).

Both start the sequence in the engine and send a `queued` event every QUEUED_EVERY_S while it is preempted (it
waits for blocks again). On the call, its tokens are the call's responses, then `finished`; on a Steps stream the
call ends (OK) once `finished` is out on the stream, UNAVAILABLE when the stream closes first.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping

import grpc

from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.v1 import worker_pb2 as pb
from pdserve.server.decode.admission import QUEUED_EVERY_S
from pdserve.server.decode.engine_api import Engine
from pdserve.server.decode.sequence import Sequence, SeqState
from pdserve.server.decode.steps_stream import StepRelay, StepSink, StepStream


async def stream_tokens(engine: Engine, seq: Sequence, events: asyncio.Queue[list[int] | None], first_token: int,
                        first_event: pb.TokenEvent | None) -> AsyncIterator[pb.DecodeResponse]:
    """Starts the sequence; its tokens (with their logprobs) as they come, then `finished`. first_event: a local
    prefill's first token, sent first."""
    if first_event is not None:
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
    yield pb.DecodeResponse(finished=seq.finished_event())


async def ride_steps(streams: Mapping[str, StepStream], stream_id: str, engine: Engine, seq: Sequence,
                     relay: StepRelay, first_token: int, first_event: pb.TokenEvent | None,
                     context: grpc.aio.ServicerContext) -> None:
    """The request's events from now on go to the Steps stream `stream_id` (first_event, a local prefill's first
    token, ahead of what the engine has put meanwhile); starts the sequence; returns once `finished` is out,
    aborts the call (UNAVAILABLE) if the stream closes first."""
    sink = _ride(streams, stream_id, seq, relay, first_event)
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


def _ride(streams: Mapping[str, StepStream], stream_id: str, seq: Sequence, relay: StepRelay,
          first: pb.TokenEvent | None) -> StepSink:
    stream = streams.get(stream_id)
    if stream is None:  # it closed since the call came in
        stream = StepStream(stream_id)
        stream.closed = True
    sink = StepSink(stream, seq)
    if first is not None:
        sink.send(tokens=first)
    relay.ride(sink)  # vLLM's tokens after a local prefill's first; an abort's end
    return sink
