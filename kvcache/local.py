"""The in-memory KV transport: senders feed KvReceivers of this process directly, no sockets.

Each stream's chunks go through the receiver's state machine (handshake, token, coverage, lease)
serialized and parsed as the gRPC transport carries them; a Refusal reaches the sender as the same
grpc.aio.AioRpcError the gRPC transport raises, with the status code the servicer
(kvcache.grpc_receiver) answers. Used by tests and benchmarks.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from pdserve.kvcache.codec import MAX_CHUNK_BYTES
from pdserve.kvcache.grpc_receiver import status_code
from pdserve.kvcache.layout import KvLayout
from pdserve.kvcache.receiver import KvReceiver, Refusal
from pdserve.kvcache.sender import KvSender, KvTransport, Stream, StreamSender, refusal, stream_header
from pdserve.kvcache.wire import decode_chunk, encode_chunk
from pdserve.v1 import worker_pb2 as pb


class LocalStream(Stream):
    def __init__(self, receiver: KvReceiver, layout: KvLayout, header: pb.KvHeader) -> None:
        self._receiver = receiver
        super().__init__(layout, header)

    async def call(self, chunks: AsyncIterator[pb.KvChunk]) -> pb.PushKvResponse:
        try:
            return await self._receiver.receive(_copies(chunks))
        except Refusal as refused:
            raise _as_sent(refused) from None


async def _copies(chunks: AsyncIterator[pb.KvChunk | bytes]) -> AsyncIterator:
    """Each chunk serialized and parsed as the gRPC transport does (its own bytes, not the sender's arrays)."""
    async for chunk in chunks:
        yield decode_chunk(encode_chunk(chunk))


def _as_sent(refused: Refusal) -> grpc.aio.AioRpcError:
    """The receiver's refusal as the sender sees it over gRPC."""
    return refusal(status_code(refused.status), refused.message)


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
            receiver.begin(headers[0])
        except Refusal as refused:
            raise _as_sent(refused) from None
        streams: list[Stream] = [LocalStream(receiver, layout, h) for h in headers]
        return StreamSender(layout, streams, self.max_chunk_bytes, header.cached_blocks * layout.block_size,
                            layout.stale_tokens(header.num_tokens))
