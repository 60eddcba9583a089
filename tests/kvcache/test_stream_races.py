"""The KV transfer's races (issue 38), each forced into its bad ordering by events, not met by luck."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from pdserve.kvcache.layout import KvLayout
from pdserve.kvcache.local import LocalKvTransport
from pdserve.kvcache.receiver import KvReceiver
from pdserve.kvcache.sender import QUEUE_PIECES, KvPoll, Stream, StreamSender, stream_header
from pdserve.kvcache.tensors import KvTensors
from pdserve.v1 import worker_pb2 as pb

from .test_codec import random_kv
from .test_receiver import FINGERPRINT, LAYOUT, NUM_TOKENS, SMALL_CHUNKS, TOKEN, RecordingSink, make_header


class HeldStream(Stream):
    """A receiver that reads nothing until `go` is set, then reads every chunk at once and answers."""

    def __init__(self, layout: KvLayout, header: pb.KvHeader) -> None:
        self.go = asyncio.Event()
        self.read: list[pb.KvChunk | bytes] = []
        super().__init__(layout, header)

    async def call(self, chunks) -> pb.PushKvResponse:
        await self.go.wait()
        async for chunk in chunks:
            self.read.append(chunk)
        return pb.PushKvResponse(tokens_received=NUM_TOKENS)


async def finish_on_a_full_queue(kind: type[HeldStream]) -> tuple[HeldStream, StreamSender, asyncio.Task]:
    """A one-stream sender whose receiver has read nothing yet: 3 pieces and KvEnd fill the stream's queue,
    and finish() waits to queue the closing None; its receiver is then let go."""
    header = make_header(request_id="r1", transfer_token=TOKEN, num_tokens=NUM_TOKENS)
    stream = kind(LAYOUT, stream_header(header, LAYOUT, 0, 1))
    sender = StreamSender(LAYOUT, [stream], SMALL_CHUNKS)
    k, v, _, _ = random_kv(LAYOUT, NUM_TOKENS)
    await sender.send(KvTensors(0, 0, k[:1], v[:1]))  # layer 0: blocks of 4, 4 and 2 tokens, 3 pieces
    finishing = asyncio.ensure_future(sender.finish(first_token_id=7))
    for _ in range(5):
        await asyncio.sleep(0)
    assert stream.queue.qsize() == QUEUE_PIECES and not finishing.done() and not stream.task.done()
    stream.go.set()
    return stream, sender, finishing


async def test_a_stream_answered_before_finish_wakes_is_a_success_not_an_early_end():
    """The flake of tests/kvcache/test_streams.py [local] ("a KV stream ended before KvEnd", issue 38): the
    closing None waits on a full queue; the receiver reads it, and every chunk before it, and answers within
    the loop turns finish() takes to wake from its wait. That answer came after the stream's end: SUCCESS."""
    stream, sender, finishing = await finish_on_a_full_queue(HeldStream)
    reply = await asyncio.wait_for(finishing, 10)
    assert (reply.tokens_received, sender.poll()) == (NUM_TOKENS, KvPoll.SUCCESS)
    header, *pieces, end = stream.read  # the pieces come serialized (kvcache.wire), the rest as messages
    assert (header.header.request_id, len(pieces), end.end.first_token_id) == ("r1", 3, 7)


class EarlyAnswer(HeldStream):
    """A receiver that answers after the header, before the pieces, KvEnd and the close reach it."""

    async def call(self, chunks) -> pb.PushKvResponse:
        await self.go.wait()
        self.read.append(await anext(aiter(chunks)))
        return pb.PushKvResponse(tokens_received=NUM_TOKENS)


async def test_a_stream_that_answers_without_reading_its_end_fails_the_sender():
    """What the fix above must not weaken: an answer before the stream's end reached the receiver is no
    success (that receiver did not get the KV); the sender fails the transfer, so the request is retried."""
    _, sender, finishing = await finish_on_a_full_queue(EarlyAnswer)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await asyncio.wait_for(finishing, 10)
    assert err.value.code() == grpc.StatusCode.CANCELLED
    assert err.value.details() == "a KV stream ended before KvEnd"
    assert sender.poll() is KvPoll.FAILED


class HeldPops(dict):
    """The receiver's map of running writes, forcing the interleaving that lost one: a writing thread that
    drops a request's emptied set waits until the event loop's next `setdefault` found that set, and that
    `setdefault` returns only after the drop (then the loop adds its new write to a set nobody holds)."""

    def __init__(self) -> None:
        super().__init__()
        self.loop_thread = threading.current_thread()
        self.waiting = threading.Event()
        self.found = threading.Event()
        self.dropped = threading.Event()

    def pop(self, key, *default):
        if threading.current_thread() is not self.loop_thread:
            self.waiting.set()
            self.found.wait(5)
            try:
                return super().pop(key, *default)
            finally:
                self.dropped.set()
        return super().pop(key, *default)

    def setdefault(self, key, default=None):
        value = super().setdefault(key, default)
        if self.waiting.is_set() and not self.found.is_set():
            self.found.set()
            self.dropped.wait(5)
        return value


class OneGatePerWrite(RecordingSink):
    """Write i waits for gates[i]; `running` counts the writes under way."""

    def __init__(self, count: int) -> None:
        super().__init__()
        self.gates = [threading.Event() for _ in range(count)]
        self.running = 0
        self._lock = threading.Lock()

    def write(self, request_id, piece) -> None:
        with self._lock:
            gate = self.gates[len(self.writes) + self.running]
            self.running += 1
        gate.wait(10)
        with self._lock:
            self.running -= 1
            self.writes.append((request_id, piece))


async def test_settle_waits_for_a_write_submitted_while_a_thread_forgot_the_last_one():
    """A cancelled request's blocks are freed once `settle` returns: it must not return while a piece is still
    being copied into them. The thread that finished the request's only running write used to drop its
    (emptied) set while the loop added the next write to it; that write was then invisible to `settle`."""
    sink = OneGatePerWrite(2)
    receiver = KvReceiver(LAYOUT, FINGERPRINT, sink)
    receiver._writes = pops = HeldPops()
    transport = LocalKvTransport({"decode-0": receiver})
    receiver.expect("r1", 0, TOKEN, NUM_TOKENS)
    k, v, _, _ = random_kv(LAYOUT, NUM_TOKENS)
    header = make_header(request_id="r1", transfer_token=TOKEN, num_tokens=NUM_TOKENS)
    sender = await transport.open("decode-0", header, LAYOUT)
    try:
        await sender.send(KvTensors(0, 0, k[:1], v[:1]))  # layer 0, one piece: write 0
        await asyncio.wait_for(_until(lambda: sink.running == 1), 10)
        sink.gates[0].set()  # write 0 ends; its thread (before the fix) waits to drop the emptied set
        await asyncio.wait_for(_until(lambda: pops.waiting.is_set() or "r1" not in pops), 10)
        await sender.send(KvTensors(1, 0, k[1:2], v[1:2]))  # layer 1: write 1, held at its gate
        await asyncio.wait_for(_until(lambda: sink.running == 1 and len(sink.writes) == 1), 10)
        receiver.cancel("r1")  # the decode worker gives the request up: settle, then free its blocks
        settling = asyncio.ensure_future(receiver.settle("r1"))
        await asyncio.sleep(0.2)
        assert not settling.done(), "settle returned while write 1 still copied into the request's blocks"
        sink.gates[1].set()
        await asyncio.wait_for(settling, 10)
        assert sink.running == 0 and len(sink.writes) == 2
    finally:
        for gate in sink.gates:
            gate.set()
        sender.cancel()


async def _until(predicate) -> None:
    while not predicate():
        await asyncio.sleep(0.01)
