"""The sending side of the KV transfer: a KvTransport opens one KvSender per (request id, attempt).

Life of a send (SGLang's KVPoll states):
1. `await transport.open(address, header, layout)`: BOOTSTRAPPING. The header goes to the receiver
   (BeginKv); `open` returns once the receiver accepted it and the streams are open
   (WAITING_FOR_INPUT), or raises grpc.aio.AioRpcError with the refusal. The receiver's lease starts.
2. `await sender.send(kv)` for each layer group as the prefill finishes it: TRANSFERRING. Its pieces
   are spread over the streams; each stream encodes its next messages (in a thread, ENCODE_AHEAD of
   them) while grpcio sends the current one, so the sender buffers at most QUEUE_PIECES pieces and
   ENCODE_AHEAD messages per stream beyond its KvTensors.
3. `await sender.finish(first_token_id)`: KvEnd on every stream, then the receiver's answer: SUCCESS.
   A refusal on any stream: FAILED (the others are cut), and finish raises it.
   `await sender.abort(reason)` instead tells the receiver this attempt is dead, so it frees what it
   holds at once; `cancel()` drops the streams (the receiver fails the transfer at once too).

Two transports: gRPC (`kvcache.grpc_sender.GrpcKvTransport`, N streams over N connections) and
in-memory (`kvcache.local.LocalKvTransport`, the same KvReceiver state machine without sockets) for
tests and benchmarks. Both share `StreamSender` below; a transport only says how one stream is carried.
"""

from __future__ import annotations

import abc
import asyncio
import collections
import concurrent.futures
import contextlib
import enum
from collections.abc import AsyncIterator

import grpc

from pdserve.kvcache.codec import MAX_CHUNK_BYTES, Piece, plan_tensors
from pdserve.kvcache.layout import KvLayout
from pdserve.kvcache.tensors import KvTensors
from pdserve.kvcache.wire import PROTOCOL_VERSION, encode_piece_bytes, piece_bytes
from pdserve.v1 import worker_pb2 as pb

QUEUE_PIECES = 4
"""Pieces waiting per stream before send() waits: what the sender buffers beyond its KvTensors."""
ENCODE_AHEAD = 2
"""Messages per stream encoded (in a thread) ahead of the one grpcio sends: the sender's own copies."""
ENCODE_INLINE_BYTES = 256 * 2**10
"""Pieces smaller than this are encoded on the event loop: handing them to a thread costs more than the copy."""
ENCODE_THREADS = 4
_encoder: concurrent.futures.ThreadPoolExecutor | None = None


def _encode_pool() -> concurrent.futures.ThreadPoolExecutor:
    """The threads that copy KV into messages (numpy copies release the GIL: the event loop runs on)."""
    global _encoder
    if _encoder is None:
        _encoder = concurrent.futures.ThreadPoolExecutor(ENCODE_THREADS, thread_name_prefix="kv-encode")
    return _encoder


class KvPoll(enum.Enum):
    BOOTSTRAPPING = "bootstrapping"
    WAITING_FOR_INPUT = "waiting_for_input"
    TRANSFERRING = "transferring"
    SUCCESS = "success"
    FAILED = "failed"


def refusal(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """The error a sender raises for a refusal, whichever transport carried it."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class KvSender(abc.ABC):
    """The sending side of one transfer (one request id and attempt)."""

    @abc.abstractmethod
    def poll(self) -> KvPoll: ...

    @abc.abstractmethod
    async def send(self, kv: KvTensors) -> None:
        """Queues a layer group of the whole prompt (token_start 0); waits while the streams are full."""

    @abc.abstractmethod
    async def finish(self, first_token_id: int) -> pb.PushKvResponse:
        """Ends every stream; the receiver's answer once it holds all the KV."""

    @abc.abstractmethod
    async def abort(self, reason: str) -> None:
        """Tells the receiver this attempt is dead (it frees its blocks now); never raises."""

    @abc.abstractmethod
    def cancel(self) -> None:
        """Drops every stream at once."""


class KvTransport(abc.ABC):
    """Opens senders to decode workers' KV receivers, by address."""

    @abc.abstractmethod
    async def open(self, address: str, header: pb.KvHeader, layout: KvLayout) -> KvSender: ...

    async def close(self) -> None:
        """Releases connections; senders already open may fail afterwards."""

    async def send(
        self,
        address: str,
        header: pb.KvHeader,
        layout: KvLayout,
        k,  # [L, T, Hkv, D] layout.np_dtype, the true length T
        v,
        first_token_id: int,
        *,
        k_scales=None,  # [L, ceil(T / block_size), Hkv] float32
        v_scales=None,
    ) -> pb.PushKvResponse:
        """A whole prompt's KV in one go: header, blocks, end; raises grpc.aio.AioRpcError on refusal."""
        kv = KvTensors(0, 0, k, v, k_scales, v_scales)
        if header.num_tokens != kv.num_tokens:
            raise ValueError(f"header says {header.num_tokens} tokens but k holds {kv.num_tokens}")
        plan_tensors(layout, kv)  # checks the arrays before anything is sent
        sender = await self.open(address, header, layout)
        try:
            await sender.send(kv)
            return await sender.finish(first_token_id)
        except BaseException:
            sender.cancel()
            raise


def stream_header(header: pb.KvHeader, layout: KvLayout, index: int, count: int) -> pb.KvHeader:
    """The header of stream `index` of `count`, with the layout and protocol version filled in."""
    if header.HasField("layout") and KvLayout.from_proto(header.layout) != layout:
        raise ValueError(
            f"header layout [{KvLayout.from_proto(header.layout).describe()}] is not the "
            f"layout of the KV [{layout.describe()}]"
        )
    out = pb.KvHeader()
    out.CopyFrom(header)
    if not header.HasField("layout"):
        out.layout.CopyFrom(layout.to_proto())
    if not out.protocol_version:
        out.protocol_version = PROTOCOL_VERSION
    out.stream_index, out.num_streams = index, count
    return out


class Stream(abc.ABC):
    """One stream of KvChunks to a receiver: `call` consumes `chunks()`; `task` is its outcome."""

    def __init__(self, layout: KvLayout, header: pb.KvHeader) -> None:
        self.layout = layout
        self.queue: asyncio.Queue = asyncio.Queue(maxsize=QUEUE_PIECES)
        self.closed = False
        """`chunks()` handed the transport its end (all it queued, then the close): from now on the stream
        may end with the receiver's answer. Set here, before the receiver can see the end, not by finish()
        once its put of the None wakes: the receiver may answer before that (the issue 38 flake)."""
        self.task: asyncio.Future = asyncio.ensure_future(self.call(self.chunks(header)))
        """The receiver's PushKvResponse; raises grpc.aio.AioRpcError with its refusal."""

    async def chunks(self, header: pb.KvHeader) -> AsyncIterator[pb.KvChunk | bytes]:
        """The header, then each queued item as the transport asks for it: (kv, piece) is encoded
        straight from kv's arrays into the serialized chunk (kvcache.wire) in a thread, up to
        ENCODE_AHEAD messages ahead of the one grpcio is sending; None closes."""
        yield pb.KvChunk(header=header)
        loop = asyncio.get_running_loop()
        ahead: collections.deque[asyncio.Future] = collections.deque()
        closed = False
        while True:
            while not closed and len(ahead) < ENCODE_AHEAD and (not ahead or not self.queue.empty()):
                item = await self.queue.get()  # waits only when nothing is encoded or being encoded
                if item is None:
                    closed = True
                elif isinstance(item, tuple) and piece_bytes(*item) >= ENCODE_INLINE_BYTES:
                    ahead.append(loop.run_in_executor(_encode_pool(), encode_piece_bytes,
                                                      self.layout.block_size, *item))
                else:
                    done = loop.create_future()
                    done.set_result(encode_piece_bytes(self.layout.block_size, *item)
                                    if isinstance(item, tuple) else item)
                    ahead.append(done)
            if not ahead:  # (the None came, and every item before it went out)
                self.closed = True
                return
            yield await ahead.popleft()

    @abc.abstractmethod
    async def call(self, chunks: AsyncIterator[pb.KvChunk | bytes]) -> pb.PushKvResponse:
        """Carries the chunks to the receiver; its answer."""

    async def result(self) -> pb.PushKvResponse:
        return await asyncio.shield(self.task)

    def cancel(self) -> None:
        self.task.cancel()


class StreamSender(KvSender):
    """A transfer over parallel streams, pieces dealt round-robin; the state machine of both transports."""

    def __init__(self, layout: KvLayout, streams: list[Stream], max_chunk_bytes: int = MAX_CHUNK_BYTES,
                 skip_tokens: int = 0, stale_tokens: tuple[int, ...] = ()) -> None:
        """skip_tokens: the leading tokens the receiver holds (the header's cached_blocks); never sent.
        stale_tokens: per layer, the leading tokens behind its sliding window (`KvLayout.stale_tokens` of the
        prompt); never sent either."""
        self.layout = layout
        self.streams = streams
        self.skip_tokens = skip_tokens
        self.stale_tokens = stale_tokens
        self.max_chunk_bytes = max_chunk_bytes
        self.state = KvPoll.WAITING_FOR_INPUT  # the transport opens it once the receiver accepted the header
        self.failure: BaseException | None = None
        self._next = 0

    def poll(self) -> KvPoll:
        return self.state

    async def send(self, kv: KvTensors) -> None:
        pieces: list[Piece] = plan_tensors(self.layout, kv, self.max_chunk_bytes, self.skip_tokens, self.stale_tokens)
        self.state = KvPoll.TRANSFERRING
        for piece in pieces:
            stream = self.streams[self._next % len(self.streams)]
            self._next += 1
            await self._put(stream, (kv, piece))

    async def finish(self, first_token_id: int) -> pb.PushKvResponse:
        for stream in self.streams:
            await self._put(stream, pb.KvChunk(end=pb.KvEnd(first_token_id=first_token_id)))
            await self._put(stream, None)
        try:
            replies = await _all(s.result() for s in self.streams)
        except BaseException as e:
            self._fail(e)
            raise
        self.state = KvPoll.SUCCESS
        return replies[0]

    async def abort(self, reason: str) -> None:
        first = self.streams[0]
        while not first.queue.empty():  # the abort goes before anything still queued
            first.queue.get_nowait()
        with contextlib.suppress(Exception):  # the receiver answers ABORTED and cuts the other streams
            await asyncio.wait_for(first.queue.put(pb.KvChunk(abort=pb.KvAbort(reason=reason))), 1.0)
            await asyncio.wait_for(first.queue.put(None), 1.0)
            await asyncio.wait_for(first.result(), 5.0)
        for stream in self.streams:
            stream.cancel()
        self.state = KvPoll.FAILED

    def cancel(self) -> None:
        for stream in self.streams:
            stream.cancel()
        if self.state is not KvPoll.SUCCESS:
            self.state = KvPoll.FAILED

    async def _put(self, stream: Stream, item) -> None:
        """Queues item unless a stream already ended (then raises its refusal at once)."""
        self._check()
        if not stream.queue.full():
            stream.queue.put_nowait(item)
            return
        put = asyncio.ensure_future(stream.queue.put(item))
        await asyncio.wait([put, *(s.task for s in self.streams)], return_when=asyncio.FIRST_COMPLETED)
        if not put.done():
            put.cancel()
        self._check()  # (a put of the None may have woken after the receiver answered: the stream is closed)

    def _check(self) -> None:
        """Raises the first stream's refusal once one stream ended before finish() (none may succeed early):
        a stream whose call ended without an error is fine only once it was `closed`."""
        if self.failure is None:
            for s in self.streams:
                if s.task.done() and not (s.closed and not s.task.cancelled() and s.task.exception() is None):
                    error = None if s.task.cancelled() else s.task.exception()
                    self._fail(error or refusal(grpc.StatusCode.CANCELLED, "a KV stream ended before KvEnd"))
                    break
        if self.failure is not None:
            raise self.failure

    def _fail(self, error: BaseException) -> None:
        if self.failure is None:
            self.failure = error
        self.state = KvPoll.FAILED
        for stream in self.streams:
            stream.cancel()


async def _all(awaitables) -> list:
    """Every result, or the first error (the rest cancelled)."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
