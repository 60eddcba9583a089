"""What the KV-transfer benchmarks share: a real KvReceiver writing a PagedKvCache, served on 127.0.0.1."""

from __future__ import annotations

import grpc

from pdserve.kvcache.grpc_receiver import add_receiver_to_server
from pdserve.kvcache.grpc_sender import CHANNEL_OPTIONS
from pdserve.kvcache.layout import KvLayout
from pdserve.kvcache.receiver import KvReceiver
from pdserve.v1 import worker_pb2 as pb


class CacheSink:
    """What the decode engine does with a received piece: write it into the paged cache."""

    def __init__(self, cache, block_table: list[int]) -> None:
        self.cache, self.block_table = cache, block_table

    def write(self, request_id: str, piece) -> None:
        self.cache.write(self.block_table, piece.layer_start, piece.token_start, piece.k, piece.v)


async def serve_receiver(receiver: KvReceiver) -> tuple[grpc.aio.Server, str]:
    """The receiver on a started in-process server, and its address."""
    server = grpc.aio.server(options=CHANNEL_OPTIONS)
    add_receiver_to_server(receiver, server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    return server, address


def header(request_id: str, token: bytes, digest: str, layout: KvLayout, num_tokens: int) -> pb.KvHeader:
    return pb.KvHeader(request_id=request_id, attempt=0, transfer_token=token,
                       fingerprint=pb.ModelFingerprint(digest=digest), layout=layout.to_proto(),
                       num_tokens=num_tokens)
