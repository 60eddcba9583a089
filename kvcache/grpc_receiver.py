"""The KV receiver served over gRPC as pdserve.v1.KvTransfer: a thin servicer over the state machine
(kvcache.receiver) that answers each Refusal with the status code of its name."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from pdserve.kvcache.receiver import KvReceiver, Refusal, Status
from pdserve.kvcache.wire import decode_chunk
from pdserve.v1 import worker_pb2 as pb
from pdserve.v1 import worker_pb2_grpc


def status_code(status: Status) -> grpc.StatusCode:
    """The gRPC status code a refusal of this status is answered with."""
    return grpc.StatusCode[status.name]


class KvTransferServicer(worker_pb2_grpc.KvTransferServicer):
    def __init__(self, receiver: KvReceiver) -> None:
        self.receiver = receiver

    async def BeginKv(self, request: pb.KvHeader, context: grpc.aio.ServicerContext) -> pb.BeginKvResponse:
        try:
            self.receiver.begin(request)
        except Refusal as refusal:
            await context.abort(status_code(refusal.status), refusal.message)
        return pb.BeginKvResponse()

    async def PushKv(self, request_iterator: AsyncIterator[pb.KvChunk],
                     context: grpc.aio.ServicerContext) -> pb.PushKvResponse:
        try:
            return await self.receiver.receive(request_iterator)
        except Refusal as refusal:
            await context.abort(status_code(refusal.status), refusal.message)


def add_receiver_to_server(receiver: KvReceiver, server: grpc.aio.Server) -> None:
    """Serves the receiver as pdserve.v1.KvTransfer, reading KV pieces as views on the received bytes
    (kvcache.wire) instead of through the generated parser."""
    servicer = KvTransferServicer(receiver)
    handlers = {
        "BeginKv": grpc.unary_unary_rpc_method_handler(
            servicer.BeginKv,
            request_deserializer=pb.KvHeader.FromString,
            response_serializer=pb.BeginKvResponse.SerializeToString,
        ),
        "PushKv": grpc.stream_unary_rpc_method_handler(
            servicer.PushKv,
            request_deserializer=decode_chunk,
            response_serializer=pb.PushKvResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("pdserve.v1.KvTransfer", handlers),))
