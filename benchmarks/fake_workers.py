"""A prefill worker and a decode worker that compute nothing and generate tokens as fast as asked.

For measuring what the coordinator costs per token (`benchmarks/coordinator.py`). The decode worker is
pdserve's own `DecodeService` (so both wires, per-request and batched `Steps`, are the real ones) over a
`FakeEngine`: every step appends one token (always `token`) to every running sequence, and a step runs
every `step_ms` (0: as soon as the previous step's output has been handed to gRPC: never more than a
couple of steps ahead of the coordinator). The prefill worker answers the first token at once and hands
the "KV" to the decode worker in the same process (no bytes move).

    python -m pdserve.benchmarks.fake_workers --prefill-port P --decode-port D [--step-ms 0] [--token 42]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib

import grpc

from pdserve.kvcache.codec import KvPiece
from pdserve.kvcache.layout import KvLayout
from pdserve.v1 import worker_pb2 as pb
from pdserve.v1 import worker_pb2_grpc
from pdserve.server.decode.engine_api import Engine
from pdserve.server.decode.sequence import Sequence, SeqState, TokenSink
from pdserve.server.decode.service import DecodeService
from pdserve.server.serving import new_server

FINGERPRINT = "fake-workers"
BACKLOG_STEPS = 16
"""The engine steps again only while no stream holds more than this many steps not yet sent."""


class FakeEngine(Engine):
    """A decode engine (`engine_api.Engine`) that computes nothing: every step, `token` for every sequence."""

    def __init__(self, vocab_size: int, token: int, step_s: float):
        self.vocab_size = vocab_size
        self.layout = KvLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_size=16, dtype="float32")
        self.max_model_len = 1 << 20
        self.token = token
        self.step_s = step_s
        self.sequences: dict[str, Sequence] = {}
        self.running: list[Sequence] = []
        self.steps = 0
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return 1 << 20

    @property
    def num_total_blocks(self) -> int:
        return 1 << 20

    def add(self, request: pb.DecodeRequest, sink: TokenSink | None = None) -> Sequence:
        seq = Sequence(request.request_id, list(request.prompt_token_ids), request.sampling, frozenset(),
                       self.max_model_len, block_table=[0], num_prior_outputs=request.num_output_tokens,
                       events=asyncio.Queue() if sink is None else sink)
        seq.state = SeqState.WAITING_KV
        seq.admitted.set_result(None)
        self.sequences[seq.request_id] = seq
        return seq

    def position(self, seq: Sequence) -> int:
        return 0

    def write(self, request_id: str, piece: KvPiece) -> None:
        """No KV moves: the fake prefill worker hands the first token over in this process."""

    async def prefill_locally(self, seq: Sequence) -> int:
        return self.token

    def start(self, seq: Sequence, first_token: int) -> None:
        if seq.state is not SeqState.WAITING_KV:
            return
        seq.state = SeqState.RUNNING
        seq.append(first_token)
        if seq.state is SeqState.FINISHED:
            seq.events.put_nowait(None)
            self.sequences.pop(seq.request_id, None)
            return
        self.running.append(seq)
        self._wakeup.set()
        if self._task is None:
            self._task = asyncio.create_task(self._loop())

    def _free(self, seq: Sequence) -> None:
        with contextlib.suppress(ValueError):
            self.running.remove(seq)

    def load(self) -> pb.WorkerLoad:
        return pb.WorkerLoad(running_requests=len(self.running), free_kv_blocks=1 << 20, total_kv_blocks=1 << 20,
                             max_waiting_requests=1 << 16)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def _backlog(self) -> int:
        """The most steps any stream holds that gRPC has not taken yet."""
        most = 0
        for seq in self.running:
            events = seq.events
            if isinstance(events, asyncio.Queue):
                most = max(most, events.qsize())
            else:  # a StepRelay: its tokens waiting in the stream's pending batch, one per step
                most = max(most, events.pending_tokens())
        return most

    async def _loop(self) -> None:
        while True:
            if not self.running:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            if self.step_s:
                await asyncio.sleep(self.step_s)
            while self._backlog() > BACKLOG_STEPS:
                await asyncio.sleep(0.001)
            self.steps += 1
            for seq in list(self.running):
                if seq.state is not SeqState.RUNNING:
                    continue
                seq.append(self.token)
                seq.events.put_nowait([self.token])
                if seq.state is SeqState.FINISHED:
                    seq.events.put_nowait(None)
                    self.running.remove(seq)
                    self.sequences.pop(seq.request_id, None)
            await asyncio.sleep(0)


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

    def expect(self, request_id: str, attempt: int, token: bytes, num_tokens: int, cached_blocks: int = 0):
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
