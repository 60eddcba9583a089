"""Batched streams to the coordinator: one `StepBatch` per decode step per coordinator connection.

Life cycle:
1. A coordinator opens `Steps(stream_id)` once per connection; the worker answers an empty batch (open).
2. A `Decode` call naming that stream adds its request with a `StepRelay` for its sink and gets its
   `reserved` as before; once the request's KV is in place the relay hands what the engine put meanwhile,
   and everything after, to a `StepSink` on the stream: the engines call `put_nowait(ids | None)` on
   every sink alike.
3. Every event lands in the stream's pending batch; the stream sends what is pending the next time the
   event loop runs it (and gRPC takes it: the coordinator's stream window is small). An engine step puts
   the tokens of all its sequences in one go, so one step makes one message; a coordinator slower than
   the steps gets several steps in one message, each request's tokens of them joined in one event.
4. The stream ends (the coordinator went away): every request riding it is aborted, its blocks freed.
5. A draining worker, once its requests have finished, ends each stream after its last batch (`end`):
   the coordinator reads every `finished` before the stream's OK, so nothing it routed here migrates.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.v1 import worker_pb2 as pb
from pdserve.server.decode.sequence import Sequence


class StepStream:
    """One coordinator connection's Steps stream: the pending events of every request riding it."""

    def __init__(self, stream_id: str):
        self.stream_id = stream_id
        self.pending: list[pb.SequenceEvent] = []
        self.riders: dict[str, StepSink] = {}
        self.closed = False
        self.ending = False
        """`end()` was called: the stream returns once nothing is pending."""
        self.batches_sent = 0
        """Batches taken from `pending` so far: the number of the pending one."""
        self._ready = asyncio.Event()

    def send(self, event: pb.SequenceEvent) -> None:
        self.pending.append(event)
        self._ready.set()

    async def batches(self) -> AsyncIterator[pb.StepBatch]:
        """An empty batch (the stream is open), then whatever is pending each time something is."""
        yield pb.StepBatch()
        while True:
            await self._ready.wait()
            self._ready.clear()
            events, self.pending = self.pending, []
            if events or not self.ending:
                self.batches_sent += 1
                yield pb.StepBatch(events=events)  # returns once gRPC has taken it (the window allows)
            if self.ending and not self.pending:
                return

    def end(self) -> None:
        """A draining worker is done with the stream: it sends what is pending, then ends (OK)."""
        self.ending = True
        self._ready.set()

    def close(self, abort: Callable[[str], object]) -> None:
        """The coordinator is gone: abort every request riding the stream (abort(request_id))."""
        self.closed = True
        for rid in list(self.riders):
            abort(rid)


class StepRelay:
    """The sink of a request that will ride a Steps stream: what the engine puts before it rides (vLLM's
    tokens after a local prefill's first; an abort's end) waits here, then goes, with all that follows,
    to its StepSink."""

    def __init__(self) -> None:
        self._held: list[list[int] | None] = []
        self.sink: StepSink | None = None

    def put_nowait(self, ids: list[int] | None) -> None:
        if self.sink is None:
            self._held.append(ids)
        else:
            self.sink.put_nowait(ids)

    def ride(self, sink: StepSink) -> None:
        """From now on the request's output goes to `sink`, what waited here first."""
        self.sink = sink
        held, self._held = self._held, []
        for ids in held:
            sink.put_nowait(ids)

    def pending_tokens(self) -> int:
        """Its tokens not yet taken by gRPC: those held here, or those in the stream's pending batch."""
        if self.sink is None:
            return sum(len(ids) for ids in self._held if ids is not None)
        return self.sink.pending_tokens()


class StepSink:
    """The sink of a request riding a StepStream: what the engine puts becomes events."""

    def __init__(self, stream: StepStream, seq: Sequence):
        self.stream = stream
        self.seq = seq
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        """Resolves once the request has ended (its `finished` event is out, unless the stream had closed)."""
        self.cut_off = False
        """The request ended after its stream closed: the coordinator never got `finished`."""
        self._tokens: tuple[int, pb.TokenEvent] | None = None
        """(batch number, event): this request's `tokens` in the pending batch, its last event there:
        further tokens join it."""
        stream.riders[seq.request_id] = self

    def put_nowait(self, ids: list[int] | None) -> None:
        """The engine's output: new token ids (their logprobs wait on seq.logprobs), or None at the end."""
        seq = self.seq
        if self.done.done():
            return
        stream = self.stream
        if ids is None:
            self.cut_off = stream.closed
            self.send(finished=seq.finished_event())
            stream.riders.pop(seq.request_id, None)
            self.done.set_result(None)
            return
        held = self._tokens
        if held is not None and held[0] == stream.batches_sent:  # still pending: join it
            tokens = held[1]
            tokens.token_ids.extend(ids)
        else:
            event = pb.SequenceEvent(request_id=seq.request_id, tokens=pb.TokenEvent(token_ids=ids))
            tokens = event.tokens
            stream.send(event)
            self._tokens = (stream.batches_sent, tokens)
        if seq.logprobs:
            tokens.logprobs.extend(seq.logprobs[: len(ids)])
            del seq.logprobs[: len(ids)]

    def pending_tokens(self) -> int:
        """This request's tokens in the stream's pending batch (not yet taken by gRPC)."""
        held = self._tokens
        return len(held[1].token_ids) if held is not None and held[0] == self.stream.batches_sent else 0

    def send(self, **event) -> None:
        """A service-side event for the request: `tokens=` (a local prefill's first) or `queued=`."""
        if not self.done.done():
            self._tokens = None  # what follows comes after this event
            self.stream.send(pb.SequenceEvent(request_id=self.seq.request_id, **event))

    def detach(self) -> None:
        self.stream.riders.pop(self.seq.request_id, None)
