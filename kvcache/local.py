"""The in-memory KV transport: senders feed KvReceivers of this process directly, no sockets.

The chunks go through the receiver's own PushKv state machine (handshake, token, coverage, lease),
with a small stand-in for the gRPC servicer context; refusals reach the sender as the same
grpc.aio.AioRpcError the gRPC transport raises. Used by tests and benchmarks.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from pdserve.kvcache.codec import MAX_CHUNK_BYTES
from pdserve.kvcache.layout import KvLayout
from pdserve.kvcache.receiver import KvReceiver
from pdserve.kvcache.transfer import KvSender, KvTransport, Stream, StreamSender, refusal, stream_header
from pdserve.kvcache.wire import decode_chunk, encode_chunk
from pdserve.v1 import worker_pb2 as pb


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class _Context:
    """What KvReceiver uses of a grpc.aio.ServicerContext."""

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise _Aborted(code, details)


class LocalStream(Stream):
    def __init__(self, receiver: KvReceiver, layout: KvLayout, header: pb.KvHeader) -> None:
        self._receiver = receiver
        self._context = _Context()
        super().__init__(layout, header)

    async def call(self, chunks: AsyncIterator[pb.KvChunk]) -> pb.PushKvResponse:
        try:
            return await self._receiver.PushKv(_copies(chunks), self._context)
        except _Aborted as e:
            raise refusal(e.code, e.details) from None


async def _copies(chunks: AsyncIterator[pb.KvChunk | bytes]) -> AsyncIterator:
    """Each chunk serialized and parsed as the gRPC transport does (its own bytes, not the sender's arrays)."""
    async for chunk in chunks:
        yield decode_chunk(encode_chunk(chunk))


class LocalKvTransport(KvTransport):
    """Senders to the receivers registered here, by address."""

    def __init__(self, receivers: dict[str, KvReceiver] | None = None, *, num_streams: int = 1,
                 max_chunk_bytes: int = MAX_CHUNK_BYTES) -> None:
        self.receivers = dict(receivers or {})
        self.num_streams = num_streams
        self.max_chunk_bytes = max_chunk_bytes

    async def open(self, address: str, header: pb.KvHeader, layout: KvLayout) -> KvSender:
        receiver = self.receivers.get(address)
        if receiver is None:
            raise refusal(grpc.StatusCode.UNAVAILABLE, f"no KV receiver at {address!r} in this process")
        n = self.num_streams
        headers = [stream_header(header, layout, i, n) for i in range(n)]
        try:
            await receiver.BeginKv(headers[0], _Context())
        except _Aborted as e:
            raise refusal(e.code, e.details) from None
        streams: list[Stream] = [LocalStream(receiver, layout, h) for h in headers]
        return StreamSender(layout, streams, self.max_chunk_bytes, header.cached_blocks * layout.block_size)
