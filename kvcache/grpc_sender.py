"""The prefill side of the KV transfer over gRPC: N parallel PushKv streams per (request id, attempt).

One Python process's grpcio tops out well below what the loopback or a NIC carries (benchmarks/README),
so a transfer spreads its pieces over `num_streams` calls, each on its own channel (its own TCP
connection), with ~1 MiB messages. See kvcache.sender for the life of a send.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from pdserve.kvcache.codec import MAX_CHUNK_BYTES
from pdserve.kvcache.layout import KvLayout
from pdserve.kvcache.sender import KvSender, KvTransport, Stream, StreamSender, stream_header
from pdserve.kvcache.wire import encode_chunk
from pdserve.v1 import worker_pb2 as pb
from pdserve.v1 import worker_pb2_grpc

MAX_MESSAGE_BYTES = 64 * 2**20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
PUSH_KV = "/pdserve.v1.KvTransfer/PushKv"


class GrpcStream(Stream):
    def __init__(self, channel: grpc.aio.Channel, layout: KvLayout, header: pb.KvHeader, timeout: float | None):
        self._push = channel.stream_unary(  # pieces come pre-serialized (kvcache.wire)
            PUSH_KV, request_serializer=encode_chunk, response_deserializer=pb.PushKvResponse.FromString
        )
        self._timeout = timeout
        super().__init__(layout, header)

    async def call(self, chunks: AsyncIterator[pb.KvChunk | bytes]) -> pb.PushKvResponse:
        return await self._push(chunks, timeout=self._timeout)


class GrpcKvTransport(KvTransport):
    """Streams KV to decode workers over `num_streams` cached grpc.aio channels per address."""

    def __init__(
        self,
        *,
        num_streams: int = 1,
        channel_options: list | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        max_chunk_bytes: int = MAX_CHUNK_BYTES,
        timeout: float | None = None,
        interceptors: list | None = None,
    ) -> None:
        """interceptors: client interceptors of every channel (the cluster credential)."""
        if num_streams < 1:
            raise ValueError(f"--kv-streams must be >= 1, got {num_streams}")
        self.num_streams = num_streams
        self._options = [*(CHANNEL_OPTIONS if channel_options is None else channel_options),
                         ("grpc.use_local_subchannel_pool", 1)]  # one TCP connection per channel
        self._credentials = credentials
        self._interceptors = interceptors
        self._max_chunk_bytes = max_chunk_bytes
        self._timeout = timeout
        self._channels: dict[tuple[str, int], grpc.aio.Channel] = {}

    async def open(self, address: str, header: pb.KvHeader, layout: KvLayout) -> KvSender:
        n = self.num_streams
        headers = [stream_header(header, layout, i, n) for i in range(n)]
        stub = worker_pb2_grpc.KvTransferStub(self._channel(address, 0))
        await stub.BeginKv(headers[0], timeout=self._timeout)  # raises the refusal
        streams: list[Stream] = [
            GrpcStream(self._channel(address, i), layout, h, self._timeout) for i, h in enumerate(headers)
        ]
        return StreamSender(layout, streams, self._max_chunk_bytes, header.cached_blocks * layout.block_size,
                            layout.stale_tokens(header.num_tokens))

    async def close(self) -> None:
        channels, self._channels = self._channels, {}
        for channel in channels.values():
            await channel.close()

    def _channel(self, address: str, index: int) -> grpc.aio.Channel:
        channel = self._channels.get((address, index))
        if channel is None:
            if self._credentials is None:
                channel = grpc.aio.insecure_channel(address, options=self._options, interceptors=self._interceptors)
            else:
                channel = grpc.aio.secure_channel(address, self._credentials, options=self._options,
                                                  interceptors=self._interceptors)
            self._channels[address, index] = channel
        return channel
