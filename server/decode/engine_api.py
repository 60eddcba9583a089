"""What a decode engine offers the worker around it, whatever computes the tokens: the native `DecodeEngine`
(`engine.py`), vLLM's engine behind `VllmEngine` (`vllm/engine.py`), and `FakeEngine` (`fake_engine.py`),
which computes nothing.

Life cycle of a request, as the worker's `DecodeService` and `KvReceiver` drive it:
1. `add(request, sink)` makes its Sequence (ValueError: bad or too long; QueueFull: no room, retry); once
   `seq.admitted` resolves it holds, or has been promised, the blocks for its prompt (`position` until then).
2. The prompt's KV arrives through the receiver (`write`), or the engine computes it (`prefill_locally`).
3. `start(seq, first_token)`: it decodes; its sink gets every new token, then the end.
4. `abort` ends it at any point: its sink gets the end, and what it holds is freed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from pdserve.kvcache.codec import KvPiece
from pdserve.kvcache.layout import KvLayout
from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.v1 import worker_pb2 as pb
from pdserve.server.hardware import Hardware
from pdserve.server.structured.grammars import Grammars
from pdserve.server.decode.sequence import Sequence, SeqState, TokenSink

__all__ = ["Engine", "TokenSink"]


class Engine(ABC):
    """The decode engine contract: what the worker's service, its KV receiver and its start-up call."""

    vocab_size: int
    """Token ids the model knows: [0, vocab_size)."""
    max_model_len: int
    """Prompt plus output tokens one request may reach here."""
    layout: KvLayout
    """The KV cache's layout: the handshake every KV stream is checked against."""
    hardware: Hardware | None = None
    grammars: Grammars | None = None
    """Compiles and caches the structured-output grammars of this model (None: structured requests refused)."""
    """The machine and the kernel paths the worker's start-up chose (`hardware.py`), for its info."""
    sequences: dict[str, Sequence]
    """The requests here, by id, until they end."""
    running: list[Sequence]
    """The sequences decoding now."""

    @property
    @abstractmethod
    def num_free_blocks(self) -> int: ...

    @property
    @abstractmethod
    def num_total_blocks(self) -> int: ...

    @abstractmethod
    def add(self, request: pb.DecodeRequest, sink: TokenSink | None = None) -> Sequence:
        """The request's Sequence, its output going to `sink` (None: a new asyncio.Queue, `seq.events`);
        raises ValueError (bad or too long) or QueueFull."""

    @abstractmethod
    def position(self, seq: Sequence) -> int:
        """The sequence's place in the queue for blocks (0: next, or not waiting)."""

    @abstractmethod
    def write(self, request_id: str, piece: KvPiece) -> None:
        """A piece of the request's prompt KV (the receiver's, in a worker thread); KeyError when the request
        holds no blocks here."""

    @abstractmethod
    async def prefill_locally(self, seq: Sequence) -> int:
        """No prefill worker is alive: the prompt's KV computed here; the first token."""

    @abstractmethod
    def start(self, seq: Sequence, first_token: int) -> None:
        """The KV is in place: the sequence decodes from the first token (nothing if it ended meanwhile)."""

    def abort(self, request_id: str, reason: int = gen_pb.FINISH_REASON_ABORT) -> bool:
        """Ends the request (its sink gets the end) and frees what it holds; False when it is not here."""
        seq = self.sequences.pop(request_id, None)
        if seq is None:
            return False
        if seq.state is not SeqState.FINISHED:
            seq.finish(reason)
            seq.events.put_nowait(None)
        if not seq.admitted.done():
            seq.admitted.set_result(None)  # a waiter wakes to find it finished
        self._free(seq)
        return True

    @abstractmethod
    def _free(self, seq: Sequence) -> None:
        """What the aborted sequence holds is freed: now, or once the step using it is done."""

    @abstractmethod
    def load(self) -> pb.WorkerLoad: ...

    @abstractmethod
    async def close(self) -> None: ...
