"""The decode loop: continuous batching over the paged KV cache, with a request API.

Life cycle of a request here:
1. `add(request, sink)` makes a Sequence and queues it; the scheduler admits it, in arrival order, once the
   blocks for its prompt fit (cached prefix blocks reused; with offload tiers, the blocks they hold loaded back
   first, `kv_offload.py`, while other sequences step): `seq.admitted` resolves.
2. Its prompt's KV arrives through the receiver, which writes it into those blocks (`write`), or the
   worker computes it itself (`prefill_locally`). With a draft model (draft_model speculation) the speculator
   computes the draft's prompt KV meanwhile, in a thread, into the same block ids of the draft's cache.
3. `start` puts the sequence, with the first token (sampled by prefill), into the running set.
4. Each step: admit, schedule (a block on demand for every sequence crossing a block boundary,
   preempting the most recently admitted when none is free; with LoRA adapters, the sequences of at most
   --max-loras adapters, `lora.py`), speculate (with a speculator, its `step` is
   the one seam: proposals, their look-ahead blocks reserved by the scheduler, a verifier for the run), run
   (re-prefilling resumed sequences first, from after any kept tail they took: `kvcache/tail_cache.py`), sample with the step's one `SamplingBatch` (`sampling.py`: penalties
   and min_tokens first, then the structured-output masks of the constrained sequences, one masked fill for the
   batch, none when no sequence is constrained; logprobs of the raw logits beside), postprocess (stream, advance
   each grammar, retire the finished; the scheduler trims the blocks of rejected look-ahead slots).
5. A finished or aborted sequence's blocks go back (full ones stay in the prefix cache), after the
   step or local (or draft) prefill that may still be using them.
"""

from __future__ import annotations

import asyncio
import logging

import torch

from pdserve.kvcache.adapter_key import AdapterKey
from pdserve.kvcache.block_hash import DEFAULT_HASHER, BlockHasher
from pdserve.kvcache.codec import KvPiece
from pdserve.kvcache.kv_events import KvEventRecorder
from pdserve.kvcache.layout import KvLayout
from pdserve.kvcache.tiered_store import TieredStore
from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.v1 import worker_pb2 as pb
from pdserve.server import metrics
from pdserve.server.decode.engine_api import Engine
from pdserve.server.decode.kv_cache import PagedKvCache
from pdserve.server.decode.kv_offload import KvOffload
from pdserve.server.decode.local_prefill_rule import LocalPrefillRule
from pdserve.server.decode.lora import LoraAdapter, LoraRows, LoraSlots
from pdserve.server.decode.model import DecoderModel
from pdserve.server.decode.model_runner import CudaGraphRunner, EagerRunner
from pdserve.server import logprobs
from pdserve.server.decode.sampler import token_logprobs
from pdserve.server.decode.sampling import SamplingBatch
from pdserve.server.decode.scheduler import QueueFull, Scheduler
from pdserve.server.decode.sequence import Sequence, SeqState, TokenSink, admissible
from pdserve.server.decode.spec.config import SpeculativeConfig
from pdserve.server.decode.spec.speculator import Speculator, StepOut, VerifyFn
from pdserve.server.model.config import resolve_max_model_len
from pdserve.server.structured.grammars import Grammars, request_constraint

log = logging.getLogger("pdserve.decode")

__all__ = ["DecodeEngine", "QueueFull"]


class DecodeEngine(Engine):
    def __init__(self, model: DecoderModel, layout: KvLayout, num_blocks: int, max_running: int, *,
                 max_queue: int = 256, enable_prefix_caching: bool = True, eos_ids: frozenset[int] = frozenset(),
                 max_model_len: int = 0, cuda_graphs: bool = False, grammars: Grammars | None = None,
                 speculative: SpeculativeConfig | None = None, draft_model: DecoderModel | None = None,
                 hasher: BlockHasher = DEFAULT_HASHER, kv_events: KvEventRecorder | None = None,
                 offload: TieredStore | None = None, lora: LoraSlots | None = None, idle_prefill_threads: int = 0):
        """max_model_len: 0 takes the model's, capped by what the cache holds. The cache lives on the model's
        device; cuda_graphs: replay the decode step from CUDA graphs (the cache gets one more block, their pad);
        grammars: the model's structured-output grammars (None: structured requests are refused);
        speculative: verify proposed tokens in each step (`spec/speculator.py`; the pad block too);
        draft_model: method draft_model's draft on the model's device (its KV cache gets as many blocks);
        hasher, kv_events: the prefix cache's block names and KV events (Scheduler), flushed once a step;
        offload: the tiers under the prefix cache (`kv_offload.py`; not with a draft model, whose KV they lack);
        lora: the LoRA adapters' slots (--enable-lora; None: a request naming an adapter is refused);
        idle_prefill_threads: torch threads of a step while no request waits on the prefill tier's KV, torch's
        threads at construction (--threads) while one does (`step_threads`); 0: the same threads always."""
        if lora is not None and speculative is not None:
            raise ValueError("--enable-lora does not combine with --speculative-config yet; drop one of them")
        self.lora = lora
        self.model = model
        self.grammars = grammars
        self.vocab_size = model.config.vocab_size
        self.layout = layout
        # A draft model's cache would lack a kept tail's KV: no tails with one.
        self.scheduler = Scheduler(num_blocks, layout.block_size, max_running, max_queue, enable_prefix_caching,
                                   windows=layout.windows, hasher=hasher, kv_events=kv_events,
                                   max_tails=0 if draft_model is not None else None)
        self.kv_events = kv_events
        self.pool = self.scheduler.pool
        device = model.embed.device
        # One block past the pool's: the pad of CUDA graphs and speculation, the null block of dropped entries.
        extra = cuda_graphs or speculative or self.scheduler.drops_blocks
        self.cache = PagedKvCache(layout, num_blocks + (1 if extra else 0), device=device)
        self.max_running = max_running
        self.eos_ids = eos_ids
        self.max_model_len = resolve_max_model_len(model.config.max_model_len, max_model_len,
                                                   capacity=num_blocks * layout.block_size)
        self.sequences: dict[str, Sequence] = {}
        self.threads = (torch.get_num_threads(), idle_prefill_threads) if idle_prefill_threads else None
        """(threads while a prompt prefills for this worker, threads while none does); None: torch's, always."""
        self._step_threads = 0
        self._busy: set[str] = set()
        """Request ids whose blocks a worker thread reads or writes now (the step, a local prefill)."""
        self._deferred: dict[str, tuple[Sequence, bool]] = {}
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.steps = 0
        self._copies: dict[str, list] = {}
        """Request id -> the CUDA events that follow its KV chunks' copies onto the device, until its first step
        (a list: a request's KV streams may write concurrently)."""
        self.runner: EagerRunner | CudaGraphRunner = EagerRunner(model, self.cache)
        if cuda_graphs:
            max_blocks = layout.num_blocks(self.max_model_len)
            verify_new = 1 + speculative.num_speculative_tokens if speculative else 0
            graphs = CudaGraphRunner(model, self.cache, max_running, max_blocks, pad_block=num_blocks,
                                     verify_new=verify_new)
            failed = graphs.capture()  # a bucket that cannot be captured runs eagerly, logged and counted
            if speculative:
                graphs.capture_verify()  # (bucket, new tokens) graphs: likewise
            if len(failed) < len(graphs.buckets):
                self.runner = graphs
        self.speculator = None if speculative is None else Speculator(
            speculative, model, self.cache, self.scheduler, pad_block=num_blocks, draft_model=draft_model,
            runner=self.runner, released=self._retire_deferred)
        self.draft = self.speculator.draft if self.speculator else None
        self.offload = None if offload is None else KvOffload(offload, self.cache)
        self._loads: set[asyncio.Future] = set()
        """Admitted sequences' loads from the offload tiers in flight."""
        if self.offload is not None and draft_model is None:
            self.scheduler.use_offload(self.offload)

    @property
    def running(self) -> list[Sequence]:
        return self.scheduler.running

    @property
    def num_free_blocks(self) -> int:
        return self.scheduler.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_total

    def position(self, seq: Sequence) -> int:
        """The sequence's place in the waiting queue (0: next, or not waiting)."""
        return self.scheduler.position(seq)

    def load(self) -> pb.WorkerLoad:
        scheduler = self.scheduler
        return pb.WorkerLoad(
            running_requests=len(scheduler.running),
            waiting_requests=len(scheduler.loading) + len(scheduler.waiting),  # for their KV or for blocks
            free_kv_blocks=scheduler.num_free_blocks,
            total_kv_blocks=self.pool.num_total,
            max_running_requests=self.max_running,
            max_waiting_requests=scheduler.max_queue,
            cached_kv_blocks=scheduler.cache.num_cached,
            **self._loras_held(),
        )

    def _loras_held(self) -> dict[str, list[pb.LoraAdapter]]:
        """The load report's adapters (--enable-lora): in device slots, and packed in host memory."""
        if self.lora is None:
            return {}
        device, host = self.lora.held()
        return {"device_loras": [pb.LoraAdapter(name=k.name, id=k.id, path=k.path) for k in device],
                "host_loras": [pb.LoraAdapter(name=k.name, id=k.id, path=k.path) for k in host]}

    # ---- requests ---------------------------------------------------------------

    def add(self, request: pb.DecodeRequest, sink: TokenSink | None = None) -> Sequence:
        """Queues the request; raises ValueError (bad or too long) or QueueFull."""
        rid, prompt = admissible(request, self.sequences, self.max_model_len)
        adapter = self._adapter(request)
        seq = Sequence(rid, prompt, request.sampling, self.eos_ids, self.max_model_len,
                       num_prior_outputs=request.num_output_tokens,
                       local_prefill=request.local_prefill,
                       local_prefill_rule=LocalPrefillRule.of(request),
                       events=asyncio.Queue() if sink is None else sink,
                       constraint=request_constraint(self.grammars, request), lora=adapter)
        admitted = self.scheduler.add(seq)
        self.sequences[rid] = seq
        if adapter is not None:
            metrics.lora_requests.labels(adapter.key.name).inc()
        self._admitted(admitted)
        return seq

    def _adapter(self, request: pb.DecodeRequest) -> LoraAdapter | None:
        """The request's LoRA adapter packed (loaded on a miss); None for the base model; ValueError if this worker
        serves no adapters or it cannot be loaded."""
        if not request.HasField("lora"):
            return None
        if self.lora is None:
            raise ValueError(f"LoRA adapter {request.lora.name!r}: this decode worker serves no LoRA adapters; "
                             f"start it with --enable-lora")
        return self.lora.adapter(AdapterKey(request.lora.id, request.lora.name, request.lora.path))

    def _free(self, seq: Sequence) -> None:
        self._retire(seq)

    # ---- the KV sink ------------------------------------------------------------

    def write(self, request_id: str, piece: KvPiece) -> None:
        seq = self.sequences.get(request_id)
        if seq is None or seq.state is not SeqState.WAITING_KV:
            raise KeyError(f"request {request_id} holds no blocks on this worker")
        copied = self.cache.write(seq.block_table, piece.layer_start, piece.token_start, piece.k, piece.v,
                                  piece.k_scales, piece.v_scales)
        if copied is not None:  # a copy onto the device in flight: the sequence's first step waits for it
            self._copies.setdefault(request_id, []).append(copied)

    async def prefill_locally(self, seq: Sequence) -> int:
        """The prompt's KV (past its cached prefix) computed here; the first token. Cancelled (the request
        ended), the thread computing it runs on: its blocks stay busy (an abort frees them) until it ends."""
        rid = seq.request_id
        self._busy.add(rid)
        work = asyncio.ensure_future(asyncio.to_thread(self._prefill, seq))
        work.add_done_callback(lambda done: self._prefilled(rid, done))
        return await asyncio.shield(work)

    def _prefilled(self, rid: str, done: asyncio.Future[int]) -> None:
        """A local prefill's thread ended: a sequence aborted meanwhile is retired now."""
        if not done.cancelled():
            done.exception()  # retrieved here too: a cancelled caller no longer awaits it
        self._busy.discard(rid)
        self._retire_deferred()

    def _prefill(self, seq: Sequence) -> int:
        """The first token; its logprob on seq.logprobs and the prompt's on seq.prompt_logprobs when asked
        (a sequence asking prompt logprobs reuses no cached prefix: every position's logits are computed)."""
        start = seq.num_cached_tokens
        logits = self.model.prefill(torch.tensor(seq.prompt_ids[start:], dtype=torch.int64), seq.block_table,
                                    self.cache, start_pos=start, lora=self._lora_of(seq))  # [S, V]
        metrics.prefill_computed_tokens.inc(len(seq.prompt_ids) - start)
        sampling = SamplingBatch.of([seq], self.vocab_size)
        token = sampling.sample(logits[-1:])
        p = seq.sampling
        if p.HasField("logprobs"):
            seq.logprobs.append(sampling.logprobs(logits[-1:], token)[0])
        if p.HasField("prompt_logprobs") and len(seq.prompt_ids) > 1:
            ids = torch.tensor(seq.prompt_ids[start + 1 :], dtype=torch.int64)
            top = min(p.prompt_logprobs, logits.shape[-1])
            chosen, top_ids, top_lps = token_logprobs(logits[:-1], ids, top)  # predicting tokens start+1..n-1
            seq.prompt_logprobs = [logprobs.token_logprob(t, c, i, lp, top) for t, c, i, lp in
                                   zip(ids.tolist(), chosen.tolist(), top_ids.tolist(), top_lps.tolist())]
        return int(token[0])

    # ---- running ----------------------------------------------------------------

    def start(self, seq: Sequence, first_token: int) -> None:
        """The KV is in place: the first token joins; the sequence decodes from the next step."""
        if seq.state is not SeqState.WAITING_KV:
            return  # aborted meanwhile: its stream has already ended
        self.scheduler.start(seq)
        seq.append(first_token)
        if seq.state is SeqState.FINISHED:
            seq.events.put_nowait(None)
            self._retire(seq)
            return
        self._wake()

    def _wake(self) -> None:
        self._wakeup.set()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._loop(), name="decode-loop")

    def _admit(self) -> None:
        self._admitted(self.scheduler.admit())

    def _admitted(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            if seq.tail_copy is not None:  # a kept tail's KV into its own block, before anything computes past it
                self.cache.copy_block(seq.tail_copy[0].block_id, seq.tail_copy[1])
                self.scheduler.tail_copied(seq)
            if seq.offload_loads or seq.offload_tail:
                self._busy.add(seq.request_id)  # an abort meanwhile frees its blocks after the load
                task = asyncio.ensure_future(self._load_offloaded(seq))
                self._loads.add(task)
                task.add_done_callback(self._loads.discard)
            else:
                self._announce(seq)
        if self.scheduler.running:
            self._wake()

    def _announce(self, seq: Sequence) -> None:
        """The sequence holds its blocks, their cached KV in place: its Decode call answers `reserved`."""
        metrics.prefix_cache_queries.inc(len(seq.prompt_ids) if not seq.output_ids else seq.num_tokens - 1)
        metrics.prefix_cache_hits.inc(seq.num_cached_tokens)
        if not seq.admitted.done():
            seq.admitted.set_result(None)
        if self.speculator is not None:
            self.speculator.admitted(seq)  # a draft model's prompt prefill starts

    async def _load_offloaded(self, seq: Sequence) -> None:
        """Loads the sequence's blocks the offload tiers hold, then announces it; a block that failed to load and
        those after it are no longer hits (the prefill tier sends them)."""
        loads, seq.offload_loads = seq.offload_loads, []
        tail, seq.offload_tail = seq.offload_tail, None
        tail_loaded = False
        try:
            loaded, copies = await self.offload.load(loads) if loads else (0, [])
            if tail is not None and loaded == len(loads):  # the tail's KV follows the full blocks' only
                tail_loaded, tail_copies = await self.offload.load_tail(*tail)
                copies = [*copies, *tail_copies]
        except Exception:
            log.exception("request %s: loading %d KV blocks from the offload tiers failed; computing them",
                          seq.request_id, len(loads) + (tail is not None))
            loaded, copies = 0, []
        finally:
            self._busy.discard(seq.request_id)
        if copies:
            self._copies.setdefault(seq.request_id, []).extend(copies)
        if seq.state is SeqState.WAITING_KV:
            if loaded < len(loads) or (tail is not None and not tail_loaded):
                seq.num_hit_blocks -= len(loads) - loaded
                seq.num_cached_tokens = min(seq.num_cached_tokens, seq.num_hit_blocks * self.layout.block_size)
            self._announce(seq)
        self._retire_deferred()

    def _in_use(self, rid: str) -> bool:
        """Whether a worker thread reads or writes the request's blocks now (a step, a local or draft prefill)."""
        return rid in self._busy or (self.speculator is not None and self.speculator.in_use(rid))

    def _retire(self, seq: Sequence, keep_kv: bool = True) -> None:
        """Drops the sequence and its blocks: now, or after the thread that is using them."""
        for copied in self._copies.pop(seq.request_id, ()):  # its blocks' next owner waits for them too
            torch.cuda.current_stream(self.cache.device).wait_event(copied)
        if self.sequences.get(seq.request_id) is seq:
            del self.sequences[seq.request_id]
        if self._in_use(seq.request_id):
            self._deferred[seq.request_id] = (seq, keep_kv)
            return
        self.scheduler.retire(seq, keep_kv)
        self._admit()

    def _retire_deferred(self) -> None:
        for rid in [rid for rid in self._deferred if not self._in_use(rid)]:
            seq, keep_kv = self._deferred.pop(rid)
            self.scheduler.retire(seq, keep_kv)
        self._admit()

    async def _loop(self) -> None:
        while True:
            self._admit()
            batch = self._schedule()
            if not batch:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            if self.speculator is None:
                tokens, token_lps = await self._run(batch)
            else:  # speculate: the step runs with the proposals' verifier, and is measured
                tokens, token_lps = await self.speculator.step(batch, self._run)
            self._postprocess(batch, tokens, token_lps)

    def _schedule(self) -> list[Sequence]:
        before = self.scheduler.num_preemptions
        batch = self.scheduler.schedule()
        if self.lora is not None:  # the sequences of at most --max-loras adapters; the rest wait a step
            batch = [s for s, fits in zip(batch, self.lora.fit([s.lora for s in batch])) if fits]
        metrics.num_preemptions.inc(self.scheduler.num_preemptions - before)
        if self.kv_events is not None:
            self.kv_events.flush()  # what the last step (and admissions, arrivals) stored and evicted
        return batch

    def step_threads(self) -> int:
        """The torch threads of the next step: --threads while a request here waits for its KV from the prefill
        tier (a prompt prefills for this worker now, or queues to), --threads-while-prefill-idle while none does;
        0 without --threads-while-prefill-idle (torch's, unchanged)."""
        if self.threads is None:
            return 0
        waiting = any(s.state is SeqState.WAITING_KV and not s.local_prefill for s in self.sequences.values())
        return self.threads[0] if waiting else self.threads[1]

    async def _run(self, batch: list[Sequence], verify: VerifyFn | None = None) -> StepOut:
        """The step in a worker thread (`_step`), its sequences' blocks busy meanwhile; when it fails, each
        sequence alone (`_step_each`)."""
        self._step_threads = self.step_threads()  # read here, on the event loop that changes the states
        ids = {s.request_id for s in batch}
        self._busy |= ids
        try:
            tokens, token_lps = await asyncio.to_thread(self._step, batch, verify)
        except Exception:
            log.exception("decode step of %d requests failed; running them one by one", len(batch))
            tokens, token_lps = await asyncio.to_thread(self._step_each, batch)
        finally:
            self._busy -= ids
            self._retire_deferred()
        self.steps += 1
        return tokens, token_lps

    def _step(self, batch: list[Sequence], verify: VerifyFn | None = None) -> StepOut:
        """The tokens every sequence in the batch emits, and their logprobs (runs in a worker thread): one
        each, or with a speculator's verifier, those its verify step accepts and the one after. The step's
        sampling batch is built once, for the verifier or (while a device runs the forward) for the logits."""
        if self._step_threads and torch.get_num_threads() != self._step_threads:
            torch.set_num_threads(self._step_threads)  # this thread's OpenMP team (`step_threads`)
        self._wait_for_copies(batch)
        self._resume(batch)
        if verify is not None:
            return verify(batch, SamplingBatch.of(batch, self.vocab_size))
        logits = self._decode(batch)  # [B, V]
        sampling = SamplingBatch.of(batch, self.vocab_size)
        next_ids = sampling.sample(logits)
        lps = sampling.logprobs(logits, next_ids)
        return [[t] for t in next_ids.tolist()], [[lp] for lp in lps]

    def _resume(self, batch: list[Sequence]) -> None:
        """The KV of preempted, readmitted sequences computed again, up to their last token."""
        for s in batch:
            if s.resume_from is not None and s.resume_from < s.num_tokens - 1:
                ids = torch.tensor(s.token_ids[s.resume_from : s.num_tokens - 1], dtype=torch.int64)
                self.model.prefill(ids, s.block_table, self.cache, start_pos=s.resume_from, lora=self._lora_of(s))

    def _decode(self, batch: list[Sequence]) -> torch.Tensor:
        """The logits [B, V] after each sequence's last token (the forward writes its KV)."""
        last = torch.tensor([s.token_ids[-1] for s in batch], dtype=torch.int64)  # [B]
        positions = torch.tensor([s.num_tokens - 1 for s in batch], dtype=torch.int64)  # [B]
        width = max(len(s.block_table) for s in batch)
        tables = torch.tensor(
            [s.block_table + [s.block_table[0]] * (width - len(s.block_table)) for s in batch],
            dtype=torch.int64,
        )  # [B, M]
        lora = None if self.lora is None else self.lora.rows([s.lora for s in batch])
        return self.runner.decode(last, positions, tables, positions + 1, lora)  # [B, V]

    def _lora_of(self, seq: Sequence) -> LoraRows | None:
        """One sequence's adapter for a forward of its own (a local prefill, a recompute)."""
        return None if seq.lora is None else seq.lora.rows(self.model.embed.device)

    def _wait_for_copies(self, batch: list[Sequence]) -> None:
        """The device's compute stream waits (on the device, not the host) for the batch's KV copies alone."""
        for s in batch:
            for copied in self._copies.pop(s.request_id, ()):
                torch.cuda.current_stream(self.cache.device).wait_event(copied)

    def _step_each(self, batch: list[Sequence]) -> tuple[list[list[int] | None], list]:
        """After a failed batched step: each sequence alone, so only those that fail alone fail (None).
        Rewriting a slot the failed step may have written puts the same values there."""
        tokens: list[list[int] | None] = []
        token_lps: list = []
        for seq in batch:
            try:
                ids, lps = self._step([seq])
                tokens.append(ids[0])
                token_lps.append(lps[0])
            except Exception as e:
                log.warning("request %s: its decode step fails on its own (%r); it ends with an error",
                            seq.request_id, e)
                tokens.append(None)
                token_lps.append(None)
        return tokens, token_lps

    def _postprocess(self, batch: list[Sequence], tokens: list[list[int] | None] | None,
                     token_lps: list[list] | None = None) -> None:
        """Each sequence's emitted tokens appended in order, the stop rule checked on each (a token after
        the one that finished it is dropped), then streamed."""
        for i, seq in enumerate(batch):
            if seq.state is not SeqState.RUNNING:
                continue  # aborted or released while the step ran
            if tokens is None or tokens[i] is None:
                seq.finish(gen_pb.FINISH_REASON_ERROR)
            else:
                lps = token_lps[i] if token_lps is not None and token_lps[i] is not None \
                    else [None] * len(tokens[i])
                emitted = []
                for token, lp in zip(tokens[i], lps):
                    if lp is not None:
                        seq.logprobs.append(lp)
                    self.scheduler.finished_step(seq)
                    seq.append(token)
                    emitted.append(token)
                    if seq.state is SeqState.FINISHED:
                        break
                if seq.state is SeqState.RUNNING:
                    self.scheduler.trim(seq)  # blocks past its next token's: rejected look-ahead slots
                seq.events.put_nowait(emitted)
            if seq.state is SeqState.FINISHED:
                seq.events.put_nowait(None)
                self._retire(seq, keep_kv=seq.finish_reason != gen_pb.FINISH_REASON_ERROR)

    async def close(self) -> None:
        if self.speculator is not None:
            self.speculator.close()
        if self.offload is not None:
            self.offload.close()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

