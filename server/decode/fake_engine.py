"""A decode engine that computes nothing: the `Engine` contract (`engine_api.py`) with outputs checkable by hand.

Every step appends `token` to every running sequence (its first token is whatever `start` is given, the
prefill tier's); a step runs every `step_s` seconds (0: as soon as the streams have taken the last step's
tokens: never more than BACKLOG_STEPS ahead of the slowest). It holds no KV (`write` drops it) and never runs
out of blocks, so what it measures is everything around an engine: the worker's service, its two wires
(per-request and batched `Steps`), the coordinator (`benchmarks/load/fake_workers.py`, `benchmarks/load/coordinator.py`).
"""

from __future__ import annotations

import asyncio
import contextlib

from pdserve.kvcache.codec import KvPiece
from pdserve.kvcache.layout import KvLayout
from pdserve.v1 import worker_pb2 as pb
from pdserve.server.decode.engine_api import Engine
from pdserve.server.decode.sequence import Sequence, SeqState, TokenSink

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
