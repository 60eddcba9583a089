"""A prefill worker and a decode worker that compute nothing and generate tokens as fast as asked.

For measuring what the coordinator costs per token (`benchmarks/load/coordinator.py`). The decode worker is
pdserve's own `DecodeService` (so both wires, per-request and batched `Steps`, are the real ones) over the
decode tier's `FakeEngine` (server/decode/fake_engine.py): every step appends one token (always `token`) to
every running sequence, and a step runs every `step_ms` (0: as soon as the previous step's output has been
handed to gRPC: never more than a couple of steps ahead of the coordinator). The prefill worker answers the
first token at once and hands the "KV" to the decode worker in the same process (no bytes move).

    python -m pdserve.benchmarks.load.fake_workers --prefill-port P --decode-port D [--step-ms 0] [--token 42]
"""

from __future__ import annotations

import argparse
import asyncio

import grpc

from pdserve.kvcache.layout import KvLayout
from pdserve.v1 import worker_pb2 as pb
from pdserve.v1 import worker_pb2_grpc
from pdserve.server.decode.fake_engine import FakeEngine
from pdserve.server.decode.service import DecodeService
from pdserve.server.serving import new_server

FINGERPRINT = "fake-workers"


class FakeTransfer:
    def __init__(self) -> None:
        self.first: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.bytes_received = 0
        self.seconds = 0.0

    async def wait(self, lease: float) -> int:
        return await self.first


class FakeReceiver:
    """The KvReceiver API DecodeService calls; the fake prefill worker completes the transfers."""

    def __init__(self, layout: KvLayout) -> None:
        self.layout = layout
        self.transfers: dict[str, FakeTransfer] = {}

    def expect(self, request_id: str, attempt: int, token: bytes, num_tokens: int, cached_blocks: int = 0,
               lora_name: str = ""):
        transfer = self.transfers[request_id] = FakeTransfer()
        return transfer

    def cancel(self, request_id: str) -> None:
        self.transfers.pop(request_id, None)

    async def settle(self, request_id: str) -> None:
        pass


class FakePrefill(worker_pb2_grpc.PrefillServicer, worker_pb2_grpc.ControlServicer):
    def __init__(self, receiver: FakeReceiver, token: int, address: str):
        self.receiver = receiver
        self.token = token
        self.address = address

    async def Prefill(self, request: pb.PrefillRequest, context) -> pb.PrefillResponse:
        transfer = self.receiver.transfers.get(request.request_id)
        if transfer is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"no decode transfer for {request.request_id}")
        if not transfer.first.done():
            transfer.first.set_result(self.token)
        return pb.PrefillResponse(first_token_id=self.token)

    async def GetInfo(self, request, context) -> pb.WorkerInfo:
        return pb.WorkerInfo(role="prefill", address=self.address,
                             fingerprint=pb.ModelFingerprint(digest=FINGERPRINT, description="fake"),
                             load=pb.WorkerLoad())


async def serve(prefill_port: int, decode_port: int, vocab_size: int, token: int, step_ms: float,
                host: str = "127.0.0.1") -> None:
    engine = FakeEngine(vocab_size, token, step_ms / 1000)
    receiver = FakeReceiver(engine.layout)
    decode = DecodeService(engine, receiver, fingerprint=FINGERPRINT, description="fake",  # type: ignore[arg-type]
                           address=f"{host}:{decode_port}")
    decode_server, _, _ = new_server([], decode_port, host)
    worker_pb2_grpc.add_DecodeServicer_to_server(decode, decode_server)
    worker_pb2_grpc.add_ControlServicer_to_server(decode, decode_server)
    prefill = FakePrefill(receiver, token, f"{host}:{prefill_port}")
    prefill_server, _, _ = new_server([], prefill_port, host)
    worker_pb2_grpc.add_PrefillServicer_to_server(prefill, prefill_server)
    worker_pb2_grpc.add_ControlServicer_to_server(prefill, prefill_server)
    await decode_server.start()
    await prefill_server.start()
    print(f"fake workers: prefill {host}:{prefill_port}, decode {host}:{decode_port}", flush=True)
    await decode_server.wait_for_termination()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prefill-port", type=int, required=True)
    p.add_argument("--decode-port", type=int, required=True)
    p.add_argument("--vocab-size", type=int, required=True, help="the model's (the coordinator checks token ids)")
    p.add_argument("--token", type=int, required=True, help="the token id every step generates")
    p.add_argument("--step-ms", type=float, default=0.0, help="time between steps (0: as fast as sent)")
    args = p.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(serve(args.prefill_port, args.decode_port, args.vocab_size, args.token, args.step_ms))


if __name__ == "__main__":
    main()
