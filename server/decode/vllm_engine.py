"""vLLM's engine as a pdserve decode engine: the same surface the worker's service reads from the native one.

Life cycle of a request here:
1. `reserve` registers the sequence (WAITING_KV); the capacity it counts against is vLLM's free blocks,
   less the blocks of every sequence still waiting for its KV (`VllmBlocks`).
2. The PushKv stream's pieces are staged in host memory (`write`), checked by pdserve's receiver.
3. `start(seq, first_token)` hands vLLM a request whose prompt is the prompt plus the first token, with
   `kv_transfer_params` naming it. vLLM's scheduler asks the connector (`vllm_connector`), which says the
   prompt's KV is loadable; vLLM takes blocks for it, and the connector's worker side writes the staged
   pieces into them before the step that computes the first token's KV and samples the second.
4. Tokens stream back per step; pdserve's own stop rules (`Sequence.append`) decide the finish reason.
5. `release` aborts the vLLM request when it still runs, which frees its blocks inside vLLM.

vLLM runs in this process (its engine core in-process, uni-process executor), stepped by one thread, so
the connector reaches the staged pieces without another copy or socket. Calls from the event loop reach
that thread through a queue; its outputs come back with `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.kvcache.block_pool import OutOfBlocks
from pdserve.kvcache.codec import KvPiece
from pdserve.kvcache.layout import KvLayout
from pdserve.server.decode.sequence import Sequence, SeqState
from pdserve.server.model.config import ModelConfig
from pdserve.v1 import generation_pb2 as gen_pb

log = logging.getLogger("pdserve.decode.vllm")


RESERVED = -1
"""A block_table entry on this engine: vLLM owns the physical blocks, pdserve counts what it promised."""


class VllmBlocks:
    """vLLM's KV blocks as the worker reports them: free, total, less what waiting sequences will take."""

    def __init__(self, num_free: Callable[[], int], num_total: int, waiting: Callable[[], int]):
        self._num_free = num_free
        self._waiting = waiting
        self.num_total = num_total

    @property
    def num_free(self) -> int:
        return max(0, self._num_free() - self._waiting())

    def allocate(self, n: int) -> list[int]:
        """Promises n of vLLM's free blocks to a sequence waiting for its KV (all or nothing)."""
        if n > self.num_free:
            raise OutOfBlocks(n, self.num_free, self.num_total)
        return [RESERVED] * n


@dataclass(frozen=True)
class VllmModel:
    """What the worker's service reads of the model (`engine.model.config`); vLLM holds the weights."""

    config: ModelConfig


@dataclass
class _Add:
    vllm_id: str
    seq: Sequence
    prompt: list[int]
    pieces: list[KvPiece] | None
    """The staged prompt KV; None: vLLM computes the prompt itself (local prefill)."""


@dataclass
class _Abort:
    vllm_id: str


@dataclass
class _Stop:
    done: threading.Event = field(default_factory=threading.Event)


class VllmEngine:
    def __init__(self, llm_engine, model_config: ModelConfig, layout: KvLayout, max_running: int,
                 num_free_blocks: Callable[[], int], num_total_blocks: int,
                 sampling_params: Callable[[Sequence, int], object], staged: dict[str, list[KvPiece]],
                 params_key: str):
        """llm_engine: vLLM's LLMEngine (add_request, abort_request, step, has_unfinished_requests);
        staged / params_key: where the connector looks for a request's KV, and the kv_transfer_params key."""
        self.llm = llm_engine
        self.model = VllmModel(model_config)
        self.layout = layout
        self.max_running = max_running
        self.sequences: dict[str, Sequence] = {}
        self.running: list[Sequence] = []
        self.pool = VllmBlocks(num_free_blocks, num_total_blocks, self._waiting_blocks)
        self.steps = 0
        self._sampling_params = sampling_params
        self._connector_staged = staged
        self._params_key = params_key
        self._staged: dict[str, list[KvPiece]] = {}
        self._vllm_ids: dict[str, str] = {}  # pdserve request id -> its vLLM request id
        self._by_vllm_id: dict[str, Sequence] = {}  # only touched by the engine thread
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # ---- capacity ------------------------------------------------------------

    def blocks_needed(self, num_prompt_tokens: int, max_new_tokens: int, max_model_len: int) -> int:
        tokens = min(num_prompt_tokens + max_new_tokens - 1, max_model_len)
        return self.layout.num_blocks(max(tokens, num_prompt_tokens))

    def _waiting_blocks(self) -> int:
        return sum(len(s.block_table) for s in self.sequences.values() if s.state is SeqState.WAITING_KV)

    def reserve(self, seq: Sequence) -> None:
        """Registers the sequence; its block_table holds placeholders counting the blocks it will take."""
        self.sequences[seq.request_id] = seq
        self._staged[seq.request_id] = []

    # ---- the KV sink ------------------------------------------------------------

    def write(self, request_id: str, piece: KvPiece) -> None:
        seq = self.sequences.get(request_id)
        if seq is None or seq.state is not SeqState.WAITING_KV:
            raise KeyError(f"request {request_id} holds no blocks on this worker")
        self._staged[request_id].append(piece)

    # ---- running ----------------------------------------------------------------

    def start(self, seq: Sequence, first_token: int | None) -> None:
        """The KV is staged: vLLM decodes from the first token. first_token None: vLLM runs the prompt too."""
        pieces = self._staged.pop(seq.request_id, None)
        seq.state = SeqState.RUNNING
        prompt = list(seq.prompt_ids)
        if first_token is not None:
            seq.append(first_token)
            if seq.state is SeqState.FINISHED:
                seq.events.put_nowait(None)
                return
            prompt.append(first_token)
        else:
            pieces = None
        vllm_id = f"{seq.request_id}-{next(self._ids)}"
        self._vllm_ids[seq.request_id] = vllm_id
        self.running.append(seq)
        self._ensure_thread()
        self._inbox.put(_Add(vllm_id, seq, prompt, pieces))

    def abort(self, request_id: str, reason: int) -> bool:
        seq = self.sequences.get(request_id)
        if seq is None:
            return False
        if seq.state is not SeqState.FINISHED:
            seq.finish(reason)
            seq.events.put_nowait(None)
        self._stop_in_vllm(seq)
        return True

    def release(self, seq: Sequence) -> None:
        if self.sequences.get(seq.request_id) is seq:
            del self.sequences[seq.request_id]
        self._staged.pop(seq.request_id, None)
        self._stop_in_vllm(seq)
        seq.block_table = []

    def _stop_in_vllm(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        vllm_id = self._vllm_ids.pop(seq.request_id, None)
        if vllm_id is not None:
            self._inbox.put(_Abort(vllm_id))

    # ---- the engine thread ----------------------------------------------------------

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._loop = asyncio.get_running_loop()
            self._thread = threading.Thread(target=self._run, name="vllm-engine", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            busy = self.llm.has_unfinished_requests()
            try:
                command = self._inbox.get(block=not busy)
            except queue.Empty:
                command = None
            while command is not None:
                if isinstance(command, _Stop):
                    command.done.set()
                    return
                if isinstance(command, _Add):
                    self._add(command)
                else:
                    self._by_vllm_id.pop(command.vllm_id, None)
                    self.llm.abort_request([command.vllm_id])
                    self._connector_staged.pop(command.vllm_id, None)
                try:
                    command = self._inbox.get_nowait()
                except queue.Empty:
                    command = None
            if not self.llm.has_unfinished_requests():
                continue
            try:
                outputs = self.llm.step()
            except Exception:
                log.exception("vLLM step failed; failing its %d requests", len(self._by_vllm_id))
                failed = list(self._by_vllm_id.values())
                self._by_vllm_id.clear()
                self._loop.call_soon_threadsafe(self._fail, failed)
                continue
            self.steps += 1
            for out in outputs:
                seq = self._by_vllm_id.get(out.request_id)
                if seq is None:
                    continue
                if out.finished:
                    del self._by_vllm_id[out.request_id]
                ids = list(out.outputs[0].token_ids) if out.outputs else []
                self._loop.call_soon_threadsafe(self._deliver, seq, ids, out.finished)

    def _add(self, add: _Add) -> None:
        params = self._sampling_params(add.seq, len(add.prompt))
        if add.pieces is not None:
            self._connector_staged[add.vllm_id] = add.pieces
            params.extra_args = {"kv_transfer_params": {self._params_key: add.vllm_id}}
        self._by_vllm_id[add.vllm_id] = add.seq
        try:
            self.llm.add_request(add.vllm_id, {"prompt_token_ids": add.prompt}, params)  # a TokensPrompt
        except Exception:
            log.exception("vLLM refused request %s", add.seq.request_id)
            del self._by_vllm_id[add.vllm_id]
            self._connector_staged.pop(add.vllm_id, None)
            self._loop.call_soon_threadsafe(self._fail, [add.seq])

    def _deliver(self, seq: Sequence, ids: list[int], finished: bool) -> None:
        """On the event loop: pdserve's stop rules over vLLM's new tokens."""
        if seq.state is not SeqState.RUNNING:
            return
        sent = []
        for token in ids:
            seq.append(token)
            sent.append(token)
            if seq.state is SeqState.FINISHED:
                break
        if sent:
            seq.events.put_nowait(sent)
        if finished and seq.state is not SeqState.FINISHED:
            seq.finish(gen_pb.FINISH_REASON_LENGTH)
        if seq.state is SeqState.FINISHED:
            seq.events.put_nowait(None)
            if finished:
                self._forget(seq)
            else:
                self._stop_in_vllm(seq)

    def _forget(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        self._vllm_ids.pop(seq.request_id, None)

    def _fail(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            if seq.state is SeqState.RUNNING:
                seq.finish(gen_pb.FINISH_REASON_ERROR)
                seq.events.put_nowait(None)
            self._forget(seq)

    async def close(self) -> None:
        if self._thread is not None:
            stop = _Stop()
            self._inbox.put(stop)
            await asyncio.to_thread(stop.done.wait, 30)
