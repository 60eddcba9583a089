"""vLLM's engine as a pdserve decode engine (`engine_api.Engine`): one DecodeService serves it and the native.

Life cycle of a request here:
1. `add(request, sink)` admits it at once when vLLM's free blocks, less the blocks promised to every request
   still waiting for its KV, hold its prompt (`seq.admitted` resolves); otherwise QueueFull (vLLM keeps
   its own queue of running requests; pdserve keeps none in front of it).
2. The PushKv stream's pieces are staged (`write`), checked by pdserve's receiver: in host memory, or
   with --tensor-parallel-size > 1 in a shared-memory file every rank reads (`staging.py`).
3. `start(seq, first_token)` hands vLLM a request whose prompt is the prompt plus the first token, with
   `kv_transfer_params` naming it. vLLM's scheduler asks the connector (`connector.py`), which says the
   prompt's KV is loadable; vLLM takes blocks for it, and the connector's worker side writes the staged
   pieces into them before the step that computes the first token's KV and samples the second.
   With no prefill worker alive, `prefill_locally` hands vLLM the bare prompt and returns its first token.
4. Tokens stream back per step; pdserve's own stop rules (`Sequence.append`) decide the finish reason.
5. `abort` ends the sequence and aborts the vLLM request when it still runs, which frees its blocks
   inside vLLM.

vLLM's engine core runs in this process, stepped by one thread; its model too with one rank (the
connector reaches the staged pieces without another copy), in vLLM's rank processes with more. Calls
from the event loop reach that thread through a queue; its outputs come back with `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.kvcache.codec import KvPiece
from pdserve.kvcache.layout import KvLayout
from pdserve.server import logprobs
from pdserve.server.decode.engine_api import Engine
from pdserve.server.decode.scheduler import QueueFull
from pdserve.server.decode.sequence import Sequence, SeqState, TokenSink, admissible
from pdserve.server.decode.vllm.staging import KvStaging, Stage, Staged
from pdserve.server.kv_events_source import EventStream
from pdserve.server.model.config import ModelConfig, resolve_max_model_len
from pdserve.server.structured.grammars import Grammars, request_constraint
from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.v1 import worker_pb2 as pb

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


@dataclass
class _Add:
    vllm_id: str
    seq: Sequence
    prompt: list[int]
    staged: Staged | None
    """The sealed stage of the prompt's KV; None: vLLM computes the prompt itself (local prefill)."""


@dataclass
class _Abort:
    vllm_id: str


@dataclass
class _Stop:
    done: threading.Event = field(default_factory=threading.Event)


class VllmEngine(Engine):
    def __init__(self, llm_engine, model_config: ModelConfig, layout: KvLayout, max_running: int,
                 num_free_blocks: Callable[[], int], num_total_blocks: int,
                 sampling_params: Callable[[Sequence, int], object], staged: dict[str, Staged],
                 params_key: str, *, eos_ids: frozenset[int] = frozenset(), max_model_len: int = 0,
                 staging: KvStaging | None = None, grammars: Grammars | None = None,
                 blocks_for: Callable[[int], int] | None = None, grammar_refusal: str | None = None):
        """llm_engine: vLLM's LLMEngine (add_request, abort_request, step, has_unfinished_requests);
        staged / params_key: where the connector looks for a request's KV, and the kv_transfer_params key;
        max_model_len: 0 takes the model's, capped by what vLLM's cache holds; staging: where received KV
        waits (default: in memory, for one rank); grammars: structured output's (the stop when a grammar
        completes; vLLM's sampler masks by `grammar_processor.py`), None: structured requests refused;
        blocks_for: vLLM's blocks an n-token prompt takes (`CacheGroups.blocks_for`: a table per KV cache
        group, less a window's null blocks), default the layout's blocks of n tokens; grammar_refusal: why
        this vLLM cannot take structured requests (its sampler runs no grammar processor), None: it can."""
        self.llm = llm_engine
        self.grammars = grammars
        self.vocab_size = model_config.vocab_size
        self.layout = layout
        self.max_running = max_running
        self.eos_ids = eos_ids
        self.max_model_len = max_model_len or resolve_max_model_len(
            model_config.max_model_len, capacity=num_total_blocks * layout.block_size)
        self.sequences: dict[str, Sequence] = {}
        self.running: list[Sequence] = []
        self.pool = VllmBlocks(num_free_blocks, num_total_blocks, self._waiting_blocks)
        self.steps = 0
        self._blocks_for = blocks_for or layout.num_blocks
        self.grammar_refusal = grammar_refusal
        self.kv_event_stream: EventStream | None = None
        """Where vLLM's engine core publishes its KV events (--kv-events-config; set by `worker.py`), or None."""
        self._sampling_params = sampling_params
        self._connector_staged = staged
        self._params_key = params_key
        self._staging = staging or KvStaging(shared=False)
        self._staged: dict[str, Stage] = {}  # requests receiving their KV
        self._vllm_ids: dict[str, str] = {}  # pdserve request id -> its vLLM request id
        self._first: dict[str, asyncio.Future] = {}  # local prefills awaiting vLLM's first token
        self._by_vllm_id: dict[str, Sequence] = {}  # only touched by the engine thread
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # ---- capacity ------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_total

    def _waiting_blocks(self) -> int:
        return sum(len(s.block_table) for s in self.sequences.values() if s.state is SeqState.WAITING_KV)

    def position(self, seq: Sequence) -> int:
        """Its place in pdserve's waiting queue: always 0 here (vLLM queues what it runs)."""
        return 0

    def load(self) -> pb.WorkerLoad:
        waiting = sum(1 for s in self.sequences.values() if s.state is SeqState.WAITING_KV)
        return pb.WorkerLoad(running_requests=len(self.running), waiting_requests=waiting,
                             free_kv_blocks=self.num_free_blocks, total_kv_blocks=self.pool.num_total,
                             max_running_requests=self.max_running)

    # ---- requests ---------------------------------------------------------------

    def add(self, request: pb.DecodeRequest, sink: TokenSink | None = None) -> Sequence:
        """Admits the request now, its prompt's blocks promised; raises ValueError (bad or too long) or
        QueueFull (the running cap, or vLLM's free blocks less those promised, cannot take it)."""
        rid, prompt = admissible(request, self.sequences, self.max_model_len)
        if self.grammar_refusal and request.sampling.structured.WhichOneof("kind"):
            raise ValueError(f"sampling.structured: {self.grammar_refusal}")
        constraint = request_constraint(self.grammars, request)
        if len(self.sequences) >= self.max_running:
            raise QueueFull(f"decode worker runs its maximum of {self.max_running} requests")
        need = self._blocks_for(len(prompt))  # blocks on demand: the prompt's in every KV cache group
        free = self.num_free_blocks
        if need > free:
            raise QueueFull(f"KV cache full: {need} blocks needed, {free} of {self.pool.num_total} free")
        seq = Sequence(rid, prompt, request.sampling, self.eos_ids, self.max_model_len,
                       block_table=[RESERVED] * need, num_prior_outputs=request.num_output_tokens,
                       events=asyncio.Queue() if sink is None else sink, constraint=constraint)
        seq.state = SeqState.WAITING_KV
        seq.admitted.set_result(None)
        self.sequences[rid] = seq
        self._staged[rid] = self._staging.new(rid)
        return seq

    def _free(self, seq: Sequence) -> None:
        """What it holds here and in vLLM: a local prefill's wait, its stage, the vLLM request."""
        first = self._first.pop(seq.request_id, None)
        if first is not None and not first.done():
            first.cancel()
        self._discard_stage(seq.request_id)
        self._stop_in_vllm(seq)
        seq.block_table = []

    # ---- the KV sink ------------------------------------------------------------

    def write(self, request_id: str, piece: KvPiece) -> None:
        seq = self.sequences.get(request_id)
        if seq is None or seq.state is not SeqState.WAITING_KV:
            raise KeyError(f"request {request_id} holds no blocks on this worker")
        self._staged[request_id].append(piece)

    # ---- running ----------------------------------------------------------------

    def start(self, seq: Sequence, first_token: int) -> None:
        """The KV is staged: vLLM decodes from the first token."""
        if seq.state is not SeqState.WAITING_KV:
            return  # aborted meanwhile, or vLLM ran the prompt itself (prefill_locally)
        seq.append(first_token)
        if seq.state is SeqState.FINISHED:
            seq.events.put_nowait(None)
            self.abort(seq.request_id)
            return
        stage = self._staged.pop(seq.request_id, None)
        self._submit(seq, [*seq.prompt_ids, first_token], stage.seal() if stage is not None else None)

    async def prefill_locally(self, seq: Sequence) -> int:
        """No prefill worker is alive: vLLM runs the prompt itself; its first token."""
        first = asyncio.get_running_loop().create_future()
        self._first[seq.request_id] = first
        self._discard_stage(seq.request_id)
        self._submit(seq, list(seq.prompt_ids), None)
        return await first

    def _discard_stage(self, request_id: str) -> None:
        stage = self._staged.pop(request_id, None)
        if stage is not None:
            stage.discard()

    def _submit(self, seq: Sequence, prompt: list[int], staged: Staged | None) -> None:
        seq.state = SeqState.RUNNING
        vllm_id = f"{seq.request_id}-{next(self._ids)}"
        self._vllm_ids[seq.request_id] = vllm_id
        self.running.append(seq)
        self._ensure_thread()
        self._inbox.put(_Add(vllm_id, seq, prompt, staged))

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
                    self._release_staged(command.vllm_id)
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
            step = []
            for out in outputs:
                seq = self._by_vllm_id.get(out.request_id)
                if seq is None:
                    continue
                if out.finished:
                    del self._by_vllm_id[out.request_id]
                ids = list(out.outputs[0].token_ids) if out.outputs else []
                lps = _token_logprobs(seq, ids, out.outputs[0]) if out.outputs else None
                step.append((seq, ids, out.finished, lps))
            if step:  # one callback per step: its outputs reach the Steps streams as one message
                self._loop.call_soon_threadsafe(self._deliver_step, step)

    def _add(self, add: _Add) -> None:
        params = self._sampling_params(add.seq, len(add.prompt))
        if add.staged is not None:
            self._connector_staged[add.vllm_id] = add.staged
            params.extra_args = {**(params.extra_args or {}), "kv_transfer_params": {self._params_key: add.vllm_id}}
        self._by_vllm_id[add.vllm_id] = add.seq
        try:
            self.llm.add_request(add.vllm_id, {"prompt_token_ids": add.prompt}, params)  # a TokensPrompt
        except Exception:
            log.exception("vLLM refused request %s", add.seq.request_id)
            del self._by_vllm_id[add.vllm_id]
            self._release_staged(add.vllm_id)
            self._loop.call_soon_threadsafe(self._fail, [add.seq])

    def _release_staged(self, vllm_id: str) -> None:
        """A request vLLM will not load (aborted, refused): its stage goes (the connector may have taken it)."""
        staged = self._connector_staged.pop(vllm_id, None)
        if staged is not None:
            staged.release()

    def _deliver_step(self, step: list[tuple[Sequence, list[int], bool, list[gen_pb.TokenLogprob] | None]]) -> None:
        for seq, ids, finished, lps in step:
            self._deliver(seq, ids, finished, lps)

    def _deliver(self, seq: Sequence, ids: list[int], finished: bool,
                 lps: list[gen_pb.TokenLogprob] | None = None) -> None:
        """On the event loop: pdserve's stop rules over vLLM's new tokens (and their logprobs, when asked)."""
        if seq.state is not SeqState.RUNNING:
            return
        sent = []
        for i, token in enumerate(ids):
            seq.append(token)
            sent.append(token)
            if lps is not None:
                seq.logprobs.append(lps[i])
            if seq.state is SeqState.FINISHED:
                break
        first = self._first.pop(seq.request_id, None) if sent else None
        if first is not None and not first.done():
            first.set_result(sent.pop(0))  # a local prefill's first token: the service sends it
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
            first = self._first.pop(seq.request_id, None)
            if first is not None and not first.done():
                first.set_exception(RuntimeError("vLLM failed the request"))
            self._forget(seq)

    async def close(self) -> None:
        if self._thread is not None:
            stop = _Stop()
            self._inbox.put(stop)
            await asyncio.to_thread(stop.done.wait, 30)
        for request_id in list(self._staged):
            self._discard_stage(request_id)
        for vllm_id in list(self._connector_staged):
            self._release_staged(vllm_id)
        self._staging.close()


def _token_logprobs(seq: Sequence, ids: list[int], output) -> list[gen_pb.TokenLogprob] | None:
    """vLLM's per-token {token id: Logprob} (the raw logits' top ones plus the chosen) as TokenLogprobs."""
    if not seq.sampling.HasField("logprobs"):
        return None
    vllm_logprobs = output.logprobs
    if not vllm_logprobs:
        return None
    out = []
    for token, alternatives in zip(ids, vllm_logprobs[-len(ids):] if ids else []):
        ranked = sorted(alternatives.items(), key=lambda kv: kv[1].rank)
        top = [(t, lp) for t, lp in ranked if lp.rank <= seq.sampling.logprobs]
        out.append(logprobs.token_logprob(token, alternatives[token].logprob, [t for t, _ in top],
                                          [lp.logprob for _, lp in top], seq.sampling.logprobs))
    return out if len(out) == len(ids) else None
