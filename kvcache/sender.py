"""The prefill side of the KV transfer: one PushKv stream per (request id, attempt)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import grpc
import numpy as np

from pdserve.kvcache.codec import MAX_CHUNK_BYTES, encode_chunks
from pdserve.kvcache.layout import KvLayout
from pdserve.v1 import worker_pb2 as pb
from pdserve.v1 import worker_pb2_grpc

MAX_MESSAGE_BYTES = 64 * 2**20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


class KvSender:
    """Streams KV to decode workers over one cached grpc.aio channel per address."""

    def __init__(
        self,
        *,
        channel_options: list | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        max_chunk_bytes: int = MAX_CHUNK_BYTES,
        interceptors: list | None = None,
    ) -> None:
        """interceptors: client interceptors of every channel (the cluster credential)."""
        self._options = CHANNEL_OPTIONS if channel_options is None else channel_options
        self._credentials = credentials
        self._interceptors = interceptors
        self._max_chunk_bytes = max_chunk_bytes
        self._channels: dict[str, grpc.aio.Channel] = {}

    async def send(
        self,
        address: str,
        header: pb.KvHeader,
        layout: KvLayout,
        k: np.ndarray,  # [L, T, Hkv, D] layout.np_dtype, the true length T
        v: np.ndarray,
        first_token_id: int,
        *,
        k_scales: np.ndarray | None = None,  # [L, ceil(T / block_size), Hkv] float32
        v_scales: np.ndarray | None = None,
        timeout: float | None = None,
    ) -> pb.PushKvResponse:
        """Pushes header, blocks, end; raises grpc.aio.AioRpcError when the receiver refuses.

        k and v hold the whole prompt; the header's leading `cached_blocks` (the receiver holds them)
        are not sent.
        """
        if header.num_tokens != k.shape[1]:
            raise ValueError(f"header says {header.num_tokens} tokens but k holds {k.shape[1]}")
        if not header.HasField("layout"):
            header = pb.KvHeader.FromString(header.SerializeToString())
            header.layout.CopyFrom(layout.to_proto())
        elif KvLayout.from_proto(header.layout) != layout:
            raise ValueError(
                f"header layout [{KvLayout.from_proto(header.layout).describe()}] is not the "
                f"layout of k and v [{layout.describe()}]"
            )
        skip = header.cached_blocks * layout.block_size
        if skip > k.shape[1]:
            raise ValueError(
                f"header skips {header.cached_blocks} cached blocks of a {k.shape[1]}-token prompt"
            )
        if skip:
            k, v = k[:, skip:], v[:, skip:]
            if k_scales is not None and v_scales is not None:
                k_scales, v_scales = k_scales[:, header.cached_blocks :], v_scales[:, header.cached_blocks :]
        blocks = encode_chunks(  # checks the arrays now; encodes as the stream is consumed
            layout, k, v, k_scales=k_scales, v_scales=v_scales, max_chunk_bytes=self._max_chunk_bytes
        )
        if skip:
            blocks = _after(blocks, skip)
        chunks = _chunks(header, blocks, first_token_id)
        stub = worker_pb2_grpc.KvTransferStub(self._channel(address))
        return await stub.PushKv(chunks, timeout=timeout)

    async def close(self) -> None:
        channels, self._channels = self._channels, {}
        for channel in channels.values():
            await channel.close()

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            if self._credentials is None:
                channel = grpc.aio.insecure_channel(address, options=self._options, interceptors=self._interceptors)
            else:
                channel = grpc.aio.secure_channel(address, self._credentials, options=self._options,
                                                  interceptors=self._interceptors)
            self._channels[address] = channel
        return channel


def _after(blocks: Iterator[pb.KvChunk], skip: int) -> Iterator[pb.KvChunk]:
    """Pieces encoded from token `skip` on, placed where they belong in the prompt."""
    for chunk in blocks:
        chunk.blocks.token_start += skip
        yield chunk


async def _chunks(
    header: pb.KvHeader, blocks: Iterator[pb.KvChunk], first_token_id: int
) -> AsyncIterator[pb.KvChunk]:
    """One piece at a time, as gRPC's flow control asks for the next message."""
    yield pb.KvChunk(header=header)
    for chunk in blocks:
        yield chunk
    yield pb.KvChunk(end=pb.KvEnd(first_token_id=first_token_id))
