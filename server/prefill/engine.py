"""The prefill loop: pack waiting prompts (or chunks of them) into a token buffer, run it layer group by group.

Life cycle of a prompt here:
1. `enqueue` looks its prefix up in the prefix KV (prefix_kv.py: full blocks computed for earlier
   prompts); a hit is not computed again (the job starts at `computed` > 0). It queues as a
   PrefillJob in the scheduler (scheduler.py: fifo or shortest-first, within the due times of the TTFT
   budgets the coordinator admitted the prompts under); `submit` does that and
   collects the whole result.
2. The loop takes the scheduler's next step: segments of one or more prompts, packed end to end into
   one token buffer of a static size (a power-of-two token bucket up to --max-num-batched-tokens), each
   token with its position and segment id (ragged, no padding to the longest prompt). A prompt
   longer than --max-prefill-chunk, or than what is left of the budget, runs over several steps
   (chunked prefill); a segment's context, the KV of its prompt's earlier tokens, goes beside the
   buffer (its own static bucket), and attention (attention.py) reads it. Every (tokens, context)
   shape is one of `shapes()`, and a step packs only into one already compiled (`compiled`): a serving
   worker compiles the rarer ones while it serves (warmup.py), and meanwhile a prompt is cut into the
   chunks a compiled shape holds, its context padded to a compiled bucket, so no step waits for a
   compile (step_compiles.py counts any that does: `pdserve_prefill_compile_waits`).
   Each step's speed is measured for the coordinator's expected-wait admission (rates.py).
   `job.started` resolves at the first segment: the prompt's KV stream opens now, and the decode
   worker's lease with it.
3. In a worker thread the step becomes host arrays (`StepInputs`, packed by step_packing.py) and the
   model runner's `dispatch` runs them (model_runner.py; on a slice
   of several processes, process 0 sends them to the others first, which run the same: replay.py):
   `kv_layer_groups` jitted layer groups, dispatched back to
   back, then the head for the prompts whose last segment this is: their first token is sampled on
   the device, from the logits with the prompt's penalties and min_tokens applied; their prompt
   logprobs, when asked, come from every segment's final hidden state. Only then is each group's KV
   converted to the wire dtype on the device (fp8_e4m3/int8 quantized with per-block, per-kv-head
   scales; segments start on block boundaries, so the blocks are the prompt's) and copied to the host
   asynchronously, so a first token never waits behind KV on its way out.
4. First tokens go to `job.first_token` (the logprob and the prompt's logprobs on the job beside
   it) before any KV of the step; then, as each group's host copy lands, every segment gets its
   KvTensors (the group's layers, the segment's tokens) on `job.kv`, so a long prompt's KV leaves
   chunk by chunk while the next chunk computes; after its last segment, None. A finished prompt's
   full blocks go into the prefix KV.

With --enable-lora, a prompt may name a LoRA adapter (lora.py): its blocks hash the adapter's extra key in the prefix
KV (a prefix cached under one adapter is never another's, nor the base model's), a step packs the prompts of at most
--max-loras adapters beside base ones, and each token's adapter slot goes into the step (lora_rows.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import jax
import jax.numpy as jnp
import numpy as np

from pdserve.kvcache import quant as host_quant
from pdserve.kvcache.adapter_key import AdapterKey
from pdserve.kvcache.block_hash import BlockHasher
from pdserve.kvcache.kv_events import MEDIUM_CPU, KvEventRecorder
from pdserve.kvcache.layout import NUMPY_DTYPES, QUANTIZED, KvLayout, LayoutKind
from pdserve.kvcache.tensors import KvTensors
from pdserve.kvcache.tiered_store import TieredStore
from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.server import logprobs, metrics
from pdserve.server.kv_offloading import open_offload
from pdserve.server.model.fingerprint import fingerprint
from pdserve.server.model.config import ModelConfig, resolve_max_model_len
from pdserve.server.prefill.config import PrefillConfig
from pdserve.server.prefill.executables import ExecutableCache
from pdserve.server.prefill.lora import PrefillAdapter, PrefillLoras
from pdserve.server.prefill.model import group_sizes
from pdserve.server.prefill.kernels import Kernels
from pdserve.server.prefill.matmul import Matmul, xla_matmul
from pdserve.server.prefill.model_runner import ModelRunner, StepOutputs
from pdserve.server.prefill.prefix_kv import BLOCK_SIZE, Fetched, PrefixKv
from pdserve.server.prefill.rates import PrefillRates
from pdserve.server.prefill.replay import SliceLeader
from pdserve.server.prefill.scheduler import PrefillScheduler, Segment, packed_tokens
from pdserve.server.prefill.step_inputs import StepInputs
from pdserve.server.prefill.shapes import (CompiledShapes, StepShape, bucket_length, context_buckets, padded, pow2,
                                           prompt_shapes, token_buckets)
from pdserve.server.prefill.step_compiles import watch
from pdserve.server.prefill.step_packing import step_inputs
from pdserve.server.prefill.warmup import Warmup, cores
from pdserve.server.structured.constraint import Constraint
from pdserve.server.structured.grammars import Grammars

log = logging.getLogger("pdserve.prefill")


@dataclass
class PrefillResult:
    first_token: int
    k: np.ndarray  # [L, T, Hkv, D] in the wire dtype
    v: np.ndarray  # [L, T, Hkv, D]
    k_scales: np.ndarray | None = None  # [L, ceil(T / block_size), Hkv] float32 for fp8_e4m3/int8
    v_scales: np.ndarray | None = None
    first_logprob: gen_pb.TokenLogprob | None = None
    """When sampling.logprobs is set."""
    prompt_logprobs: list[gen_pb.TokenLogprob] = field(default_factory=list)
    """When sampling.prompt_logprobs is set: one per prompt token after the first."""


@dataclass
class PrefillJob:
    token_ids: list[int]
    sampling: gen_pb.SamplingParams
    sample_index: int
    kv_dtype: str
    block_size: int
    started: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    """Resolves when the engine takes the job's first segment into a step: its prefill begins."""
    first_token: asyncio.Future[int] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    kv: asyncio.Queue = field(default_factory=asyncio.Queue)
    """KvTensors (a layer group of a token range, block-aligned) as they are computed, then None; or the
    exception that ended the prefill."""
    first_logprob: gen_pb.TokenLogprob | None = None
    """The first token's logprob when sampling.logprobs is set; set before `first_token` resolves."""
    prompt_logprobs: list[gen_pb.TokenLogprob] = field(default_factory=list)
    """When sampling.prompt_logprobs is set: one per prompt token after the first; set before
    `first_token` resolves."""
    computed: int = 0
    """Leading tokens whose KV exists (a cached prefix, then each finished segment)."""
    sent: int = 0
    """Leading tokens whose KV went to `kv`."""
    context: np.ndarray | None = None
    """[2, L, T, Hkv, D] in the compute dtype: k and v of tokens [0, computed), for later segments and
    the prefix KV (an MLA model's latent entries in k; its v, [.., :0], holds nothing); None while neither
    needs it."""
    prompt_lp: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    """When prompt logprobs are asked: chosen [T], top ids and logprobs [T, top], filled segment by segment."""
    constraint: Constraint | None = None
    """sampling.structured's matcher after the outputs so far (a migration's): the first token's mask."""
    adapter: PrefillAdapter | None = None
    """The LoRA adapter it prefills with (packed on the host, held for the job's life); None: the base model."""

    @property
    def adapter_key(self) -> AdapterKey | None:
        """What the scheduler counts against --max-loras, and the prefix KV hashes into its blocks."""
        return None if self.adapter is None else self.adapter.key

    def cancel(self) -> None:
        """Drops the job if it is still queued; a running step finishes without it."""
        self.first_token.cancel()
        self.started.cancel()

    @property
    def dropped(self) -> bool:
        return self.first_token.cancelled()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def cancelled(self) -> bool:
        return self.dropped


class PrefillEngine:
    def __init__(self, model_config: ModelConfig, params, config: PrefillConfig, grammars: Grammars | None = None,
                 matmul: Matmul | Kernels = xla_matmul, executables: ExecutableCache | None = None):
        """grammars: the model's structured-output grammars (None: structured requests are refused);
        executables: where the programs' executables are loaded from and stored (executables.py; None: none)."""
        self.model_config = model_config
        self.grammars = grammars
        self.config = config
        self.max_model_len = resolve_max_model_len(model_config.max_model_len, config.max_model_len or 0)
        self.max_len = pow2(self.max_model_len)
        self.matmul_path = "xla"
        """The layers' matmul path, as the start-up log names it (main.py sets it)."""
        self.attention_path = "xla"
        """Where attention runs ("host (...)" beside onednn-bf16: host_attention.py), as main.py logs it."""
        groups = group_sizes(model_config.num_layers, config.kv_layer_groups)
        self.lora = self._lora_slots(model_config, config, groups, params["embed"].dtype)
        """The LoRA adapters' host LRU and device slots (--enable-lora; None: a prompt naming one is refused)."""
        self.runner = ModelRunner(model_config, params, groups, config.max_batch_size, matmul, self.lora,
                                  executables)
        """The device programs (model_runner.py)."""
        self.token_buckets = token_buckets(config.max_batch_tokens, config.max_batch_size, self.max_len,
                                           config.min_bucket)
        """The packed buffer's sizes, powers of two: few and static, so every one is compiled at start."""
        chunked = min(config.max_prefill_chunk or config.max_batch_tokens, config.max_batch_tokens) < self.max_model_len
        self.context_buckets = context_buckets(self.max_len, chunked or bool(config.prefix_cache_bytes))
        """Context sizes a step compiles for (shapes.py): only 0 when no step reads earlier KV."""
        self.dtype = self.runner.dtype
        self.vocab_size = self.runner.vocab_size
        self.layout_kind: LayoutKind = "heads" if model_config.mla is None else "mla_latent"
        """What a token's KV is: K and V heads, or (DeepSeek) one MLA latent entry with no V."""
        self.value_dim = 0 if model_config.mla is not None else model_config.head_dim
        """The width of a token's V (0: a latent's): the columns of a job's context[1] that hold it."""
        self.replay: SliceLeader | None = None
        """On process 0 of a slice of several processes: sends each step to the others before running it."""
        self.compiling: Warmup | None = None
        """The start-up compiles (warmup.py) of a worker that serves: what is compiled so far, the rest
        compiling in the background. None: every shape counts as compiled (`warmup()` compiled them, or
        each compiles on its first step)."""
        kv_events = KvEventRecorder(MEDIUM_CPU) if config.kv_events and config.kv_events.enabled else None
        self.prefix = PrefixKv(num_layers=model_config.num_layers, num_kv_heads=model_config.num_kv_heads,
                               head_dim=model_config.head_dim, dtype=np.dtype(self.dtype),
                               budget_bytes=config.prefix_cache_bytes,
                               hasher=BlockHasher(config.prefix_caching_hash_algo), kv_events=kv_events,
                               offload=self._open_offload(kv_events), kind=self.layout_kind)
        buckets = sorted({self._bucket(1 << i) for i in range(self.max_len.bit_length())})
        self.rates = PrefillRates(buckets)
        rows = [1 << i for i in range(pow2(config.max_batch_size).bit_length())]
        self._every = CompiledShapes.every(self.token_buckets, self.context_buckets, rows, buckets)
        self.scheduler: PrefillScheduler[PrefillJob] = PrefillScheduler(
            config.prefill_order, bucket=self._bucket, max_batch_size=config.max_batch_size,
            max_batch_tokens=config.max_batch_tokens, max_chunk=config.max_prefill_chunk,
            max_context=self.max_len, ageing_tokens_per_s=config.prefill_ageing, seconds=self.rates.seconds,
            token_room=lambda context: self.compiled.room(context),
            max_adapters=config.max_loras if self.lora is not None else None)
        self._shapes_run: set[StepShape] = set()
        """Every step shape run: a shape's first step compiles, so is not timed."""
        self.slots = 0
        """Token slots of every step run (the buffers' sizes)."""
        self.padding = 0
        """Of those, slots that held no prompt token."""
        self._wire_compiler = ThreadPoolExecutor(1, thread_name_prefix="compile-wire")
        self._wire_compiles: dict[tuple[int, tuple[str, int]], Future] = {}
        """The wire formats' compiles asked for (`_formats_on_host`), by (token slots, format)."""
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.batches = 0

    @staticmethod
    def _lora_slots(model_config: ModelConfig, config: PrefillConfig, groups: list[tuple[int, int]],
                    compute_dtype) -> PrefillLoras | None:
        if not config.enable_lora:
            return None
        if model_config.mla is not None:
            raise ValueError(f"--enable-lora: LoRA adapters are not served for {model_config.family} (latent "
                             "attention) models yet; serve it without --enable-lora")
        dtype = compute_dtype if config.lora_dtype == "auto" else jnp.dtype(config.lora_dtype)
        lora = PrefillLoras(model_config, groups, config.max_loras, config.cpu_loras, config.max_lora_rank, dtype)
        log.info("LoRA: %d device slots (--max-loras), %d adapters in host memory (--max-cpu-loras), rank <= %d, %s; "
                 "slot stacks %.1f MiB", config.max_loras, config.cpu_loras, config.max_lora_rank, np.dtype(dtype).name,
                 lora.nbytes / 2**20)
        return lora

    def _open_offload(self, kv_events: KvEventRecorder | None) -> TieredStore | None:
        """The offload tiers under the prefix KV (--kv-offloading-*), keyed by its blocks' layout; None when off."""
        config, c = self.config, self.model_config
        if not config.offloading:
            return None
        if not config.prefix_cache_bytes:
            log.warning("--kv-offloading-*: off on this prefill worker (--prefix-cache-bytes 0 keeps no prefix KV)")
            return None
        layout = KvLayout.of(c.num_layers, c.num_kv_heads, c.head_dim, BLOCK_SIZE, np.dtype(self.dtype).name,
                             kind=self.layout_kind)
        store = open_offload(config, layout, fingerprint(config.model_dir, c), kv_events)
        metrics.watch_kv_offload(lambda: (store.stats(), store.save_drops))
        log.info("KV offload tiers under the prefill prefix KV: %s", store.describe())
        return store

    def close(self) -> None:
        """On process 0 of a slice: tells the other processes to stop; drops the wire formats' compiles not begun;
        the offload tiers' threads end after their queued saves."""
        if self.replay is not None:
            self.replay.stop()
        self._wire_compiler.shutdown(wait=False, cancel_futures=True)
        if self.prefix.offload is not None:
            self.prefix.offload.close()

    def _bucket(self, n: int) -> int:
        return bucket_length(min(n, self.max_len), self.max_len, self.config.min_bucket)

    def shapes(self) -> list[StepShape]:
        """Every step shape this engine can run (each layer group, the head and the samplers at
        power-of-two rows up to max_batch_size come with each)."""
        return [StepShape(t, c) for c in self.context_buckets for t in self.token_buckets]

    @property
    def compiled(self) -> CompiledShapes:
        """The shapes a step may pack into (warmup.py's, growing as they compile)."""
        return self.compiling.compiled if self.compiling is not None else self._every

    @property
    def _compiles_pending(self) -> bool:
        """Start-up programs still compile in the background (what the traffic asks for counts)."""
        return self.compiling is not None and not self.compiling.finished.is_set()

    def step_shape(self, step: list[Segment]) -> StepShape:
        """The smallest compiled shape that holds the step's packed tokens and its context (the scheduler
        packed it to fit one; tells the background compiles the shape it would take with all compiled)."""
        tokens, context = packed_tokens(step), sum(s.start for s in step)
        wanted = StepShape(padded(self.token_buckets, tokens), padded(self.context_buckets, context))
        if self._compiles_pending:
            self.compiling.ask(wanted)
        return self.compiled.step_shape(tokens, context) or wanted

    def _penalized(self, rows: int, length: int) -> tuple[int, int]:
        """The compiled (rows, prompt length) penalized sampling pads to (step_packing.py)."""
        if self._compiles_pending:
            self.compiling.ask(("penalized", rows, length))
        return self.compiled.penalized_shape(rows, length) or (rows, length)

    @property
    def padding_share(self) -> float:
        """Share of the token slots run so far that held padding (0 before the first step)."""
        return self.padding / self.slots if self.slots else 0.0

    @property
    def queued_tokens(self) -> int:
        """Tokens of the prompts waiting or running still to compute."""
        return self.scheduler.queued_tokens

    def load(self, waits: bool = True) -> list:
        """Queued work, measured rate and (`waits`) a new prompt's expected wait per bucket
        (WorkerLoad.prefill_buckets; the waits replay the queue once per bucket)."""
        wait = {b: self.scheduler.expected_wait(b) for b in self.rates.buckets} if waits else None
        return self.rates.report(self.scheduler.queued_by_bucket, self.scheduler.prompts_by_bucket, wait)

    def enqueue(self, token_ids: list[int], sampling: gen_pb.SamplingParams, sample_index: int,
                kv_dtype: str, block_size: int = 16, due: float | None = None,
                constraint: Constraint | None = None, fetched: Fetched | None = None,
                adapter: PrefillAdapter | None = None) -> PrefillJob:
        """Queues a prompt; its first token and KV arrive on the job. block_size: the target cache's,
        over which fp8_e4m3/int8 scales are computed (a power of two). due: when its first token is due
        (time.monotonic(); the TTFT budget it was admitted under), None: never urgent (scheduler.py).
        constraint: the request's grammar state (Grammars.constraint, outputs so far replayed); fetched: its blocks
        the offload tiers held (`PrefixKv.fetch`, awaited just before); adapter: the LoRA adapter it prefills with
        (`self.lora.adapter`, loaded just before; None: the base model)."""
        if not 0 < len(token_ids) <= self.max_model_len:  # no bucket fits: it would stop the loop
            raise ValueError(f"a prompt of {len(token_ids)} tokens; this worker takes 1 to {self.max_model_len}")
        if block_size <= 0 or block_size & (block_size - 1):
            raise ValueError(f"KV block size {block_size} is not a power of two")
        if adapter is not None and self.lora is None:
            raise ValueError(f"LoRA adapter {adapter.key.name!r}: this prefill worker serves no LoRA adapters; start it "
                             f"with --enable-lora")
        job = PrefillJob(token_ids, sampling, sample_index, kv_dtype, block_size, constraint=constraint, adapter=adapter)
        if not sampling.HasField("prompt_logprobs"):  # those need every position's hidden state
            hit = self.prefix.lookup(token_ids, multiple_of=block_size, fetched=fetched, adapter=job.adapter_key)
            if hit is not None:
                job.computed = hit[0].shape[1]
                job.context = self._new_context(job)
                job.context[0, :, : job.computed], job.context[1, :, : job.computed, :, : self.value_dim] = hit
                metrics.prefill_prefix_cache_hits.inc(job.computed)
        if self._compiles_pending:
            self.compiling.ask(*prompt_shapes(job.num_tokens, job.computed, self.scheduler.max_chunk,
                                              self.token_buckets, self.context_buckets))
        self.scheduler.add(job, due)
        self._wakeup.set()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._loop(), name="prefill-loop")
        return job

    def _new_context(self, job: PrefillJob) -> np.ndarray:
        c = self.model_config
        return np.zeros((2, c.num_layers, job.num_tokens, c.num_kv_heads, c.head_dim), np.dtype(self.dtype))

    async def submit(self, token_ids: list[int], sampling: gen_pb.SamplingParams, sample_index: int,
                     kv_dtype: str, block_size: int = 16, constraint: Constraint | None = None,
                     adapter: PrefillAdapter | None = None) -> PrefillResult:
        """The whole result at once: the first token and the KV of all layers."""
        job = self.enqueue(token_ids, sampling, sample_index, kv_dtype, block_size, constraint=constraint,
                           adapter=adapter)
        try:
            first = await job.first_token
            pieces: list[KvTensors] = []
            while (piece := await job.kv.get()) is not None:
                if isinstance(piece, BaseException):
                    raise piece
                pieces.append(piece)
        except asyncio.CancelledError:
            job.cancel()
            raise
        c, n = self.model_config, len(token_ids)
        shape = (c.num_layers, n, c.num_kv_heads, c.head_dim)
        k, v = np.zeros(shape, pieces[0].k.dtype), np.zeros((*shape[:3], self.value_dim), pieces[0].v.dtype)
        quantized = pieces[0].k_scales is not None
        scales_shape = (c.num_layers, -(-n // block_size), c.num_kv_heads)
        v_scales_shape = (*scales_shape[:2], c.num_kv_heads if self.value_dim else 0)
        ks, vs = (np.zeros(scales_shape, np.float32), np.zeros(v_scales_shape, np.float32)) if quantized else (None, None)
        for p in pieces:
            layers, tokens = slice(p.layer_start, p.layer_start + p.num_layers), slice(p.token_start, p.token_start + p.num_tokens)
            k[layers, tokens], v[layers, tokens] = p.k, p.v
            if quantized:
                b0 = p.token_start // block_size
                blocks = slice(b0, b0 + p.k_scales.shape[1])
                ks[layers, blocks], vs[layers, blocks] = p.k_scales, p.v_scales
        return PrefillResult(first, k, v, ks, vs, job.first_logprob, job.prompt_logprobs)

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            step = self.scheduler.next_step()
            if self.compiling is not None and step:  # the start-up compiles left run only while no prompt waits
                self.compiling.pause()
            elif self.compiling is not None:
                self.compiling.resume()
            if not step:
                self._wakeup.clear()
                if len(self.scheduler) and self._compiles_pending:
                    # a prompt no compiled shape holds yet (blocks larger than the first set's context chunk):
                    # tried again as the background compiles more
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wakeup.wait(), 0.1)
                else:
                    await self._wakeup.wait()
                continue
            for s in step:
                if not s.job.started.done():
                    s.job.started.set_result(None)
            t0 = time.perf_counter()
            shape = self.step_shape(step)
            try:
                await asyncio.to_thread(self._run, step, shape, loop)
                metrics.prefill_computed_tokens.inc(sum(s.length for s in step))
                if shape in self._shapes_run:
                    longest = max(s.job.num_tokens for s in step)
                    self.rates.record(self._bucket(longest), sum(s.length for s in step), time.perf_counter() - t0)
                self._shapes_run.add(shape)
                self.slots += shape.tokens
                self.padding += shape.tokens - sum(s.length for s in step)
            except Exception as e:
                log.exception("prefill step of %d segments failed", len(step))
                for s in step:
                    self._fail(s.job, e)
            finally:
                self.scheduler.finish(step)
            self.batches += 1

    @staticmethod
    def _fail(job: PrefillJob, error: Exception) -> None:
        job.context = None
        if not job.first_token.done():
            job.first_token.set_exception(error)
        job.kv.put_nowait(error)

    def dispatch(self, inputs: StepInputs, to_host: bool = True) -> StepOutputs:
        """Runs one step's programs (model_runner.py); a slice's other processes run it on the same inputs."""
        return self.runner.dispatch(inputs, to_host)

    def _run(self, step: list[Segment[PrefillJob]], shape: StepShape, loop: asyncio.AbstractEventLoop) -> None:
        """Runs one step (in a worker thread), handing each job its KV and, at its last segment, its first token."""
        slots = None if self.lora is None else self.lora.slots([s.job.adapter for s in step])
        inputs, offsets = step_inputs(step, shape, self.model_config, self.dtype, self.vocab_size, self._bucket,
                                      self._penalized, slots)
        on_host = self._formats_on_host(shape, inputs.formats)
        if on_host:
            inputs = replace(inputs, formats=tuple(f for f in inputs.formats if f not in on_host))
        keep = [s for s in step if not s.last or self.prefix.enabled]  # whose compute-dtype KV the host keeps
        for s in keep:
            if s.job.context is None:
                s.job.context = self._new_context(s.job)
        with watch() as compiles:
            out = self.dispatch(inputs) if self.replay is None else self.replay.run(inputs, self.dispatch)
        if compiles:
            metrics.prefill_compile_waits.inc()
            log.warning("prefill step of shape %s waited for %d program(s) to compile", shape, len(compiles))
        for _, _, k, v in out.kv if keep or on_host else ():
            k.copy_to_host_async()
            v.copy_to_host_async()
        if out.prompt_logprobs is not None:
            self._take_prompt_logprobs(step, offsets, out.prompt_logprobs)
        finishing = [s for s in step if s.last]
        if finishing:
            first_ids = np.asarray(out.first)
            self._logprobs([s.job for s in finishing], out.logits, first_ids)
            for r, s in enumerate(finishing):
                if s.job.prompt_lp is not None:  # the answer to the first token carries them
                    self._finish_prompt_logprobs(s.job)
                loop.call_soon_threadsafe(_resolve, s.job.first_token, int(first_ids[r]))
        for s in step:  # a cached prefix leaves before the tokens computed after it
            if s.job.sent < s.start:
                self._put(loop, s.job, self._host_wire(s.job, 0, s.job.sent, s.start))
                s.job.sent = s.start

        for start, wire, k, v in out.kv:
            host = {f: tuple(None if a is None else np.asarray(a) for a in arrays) for f, arrays in wire.items()}
            if keep or on_host:
                ck, cv = np.asarray(k), np.asarray(v)  # [l, 1, T, Hkv, D] in the compute dtype
            for s in keep:
                off = offsets[step.index(s)]
                s.job.context[0, start : start + ck.shape[0], s.start : s.end] = ck[:, 0, off : off + s.length]
                s.job.context[1, start : start + ck.shape[0], s.start : s.end, :, : self.value_dim] = \
                    cv[:, 0, off : off + s.length]
            for i, s in enumerate(step):
                job, off, bs = s.job, offsets[i], s.job.block_size
                if (job.kv_dtype, bs) in on_host:  # the segment's tokens alone: its blocks are the buffer's
                    piece = KvTensors(start, s.start, *_wire_format(ck[:, 0, off : off + s.length],
                                                                    cv[:, 0, off : off + s.length], job))
                    self._put(loop, job, piece)
                    continue
                hk, hv, hks, hvs = host[job.kv_dtype, bs]
                b0, nb = off // bs, -(-s.length // bs)
                hk, hks = hk[:, 0, off : off + s.length], None if hks is None else hks[:, 0, b0 : b0 + nb]
                if hv is None:  # an MLA latent: no V, no V scales
                    v0, vs0 = _no_value(hk, hks)
                    piece = KvTensors(start, s.start, hk, v0, hks, vs0)
                else:
                    piece = KvTensors(start, s.start, hk, hv[:, 0, off : off + s.length], hks,
                                      None if hvs is None else hvs[:, 0, b0 : b0 + nb])
                self._put(loop, job, piece)
        for s in step:
            s.job.computed = s.job.sent = s.end
            if s.last:
                if s.job.prompt_lp is not None:
                    self._finish_prompt_logprobs(s.job)
                if s.job.context is not None and self.prefix.enabled:
                    loop.call_soon_threadsafe(self._store_prefix, s.job.token_ids, s.job.context, s.job.adapter_key)
                s.job.context = None
                self._put(loop, s.job, None)

    def _store_prefix(self, token_ids: list[int], context: np.ndarray, adapter: AdapterKey | None) -> None:
        """On the event loop's thread, where lookups run too."""
        self.prefix.store(token_ids, context[0], context[1, ..., : self.value_dim], adapter)

    @staticmethod
    def _put(loop: asyncio.AbstractEventLoop, job: PrefillJob, item) -> None:
        loop.call_soon_threadsafe(job.kv.put_nowait, item)

    def _host_wire(self, job: PrefillJob, layer_start: int, token_start: int, token_end: int) -> KvTensors:
        """Tokens [token_start, token_end) of the job's host context (all layers) in its wire format."""
        k, v = job.context[0, :, token_start:token_end], job.context[1, :, token_start:token_end, :, : self.value_dim]
        return KvTensors(layer_start, token_start, *_wire_format(k, v, job))  # [L, n, Hkv, D], v [.., D | 0]

    def _formats_on_host(self, shape: StepShape, formats: tuple[tuple[str, int], ...]) -> tuple[tuple[str, int], ...]:
        """The step's wire formats (dtype, block size: the decode workers', learned per request) whose device
        programs a serving worker has not compiled for the shape yet: the host converts the KV to those
        (`_wire_format`, kvcache/quant.py's reference) while one thread compiles them; none for an engine
        whose every program compiles on its first step."""
        if self.compiling is None:
            return ()
        missing = tuple(f for f in formats if not self.runner.wire_compiled(shape.tokens, f))
        for fmt in missing:
            if (shape.tokens, fmt) not in self._wire_compiles:
                self._wire_compiles[shape.tokens, fmt] = self._wire_compiler.submit(self._compile_wire,
                                                                                     shape.tokens, fmt)
        return missing

    def _compile_wire(self, tokens: int, fmt: tuple[str, int]) -> None:
        try:
            self.runner.compile_wire(tokens, fmt)
        except Exception:
            log.exception("prefill: compiling the KV's wire format %s for %d token slots failed; the host "
                          "converts it", fmt, tokens)

    @staticmethod
    def _take_prompt_logprobs(step: list[Segment[PrefillJob]], offsets: list[int], computed: tuple) -> None:
        """Each asking segment's share of its prompt logprobs, from the step's (chosen, top ids, top logprobs)."""
        chosen, top_ids, top_lps = (np.asarray(a)[0] for a in computed)
        for i, s in enumerate(step):
            job = s.job
            if not job.sampling.HasField("prompt_logprobs"):
                continue
            if job.prompt_lp is None:
                n, top = job.num_tokens, top_ids.shape[-1]
                job.prompt_lp = (np.zeros(n, np.float32), np.zeros((n, top), np.int32), np.zeros((n, top), np.float32))
            ahead = min(s.end + 1, job.num_tokens) - (s.start + 1)  # tokens predicted from this segment
            rows = slice(offsets[i], offsets[i] + ahead)
            for dst, src in zip(job.prompt_lp, (chosen, top_ids, top_lps), strict=True):
                dst[s.start + 1 : s.start + 1 + ahead] = src[rows]

    @staticmethod
    def _finish_prompt_logprobs(job: PrefillJob) -> None:
        chosen, top_ids, top_lps = job.prompt_lp
        job.prompt_logprobs = [
            logprobs.token_logprob(job.token_ids[j], chosen[j], top_ids[j], top_lps[j], job.sampling.prompt_logprobs)
            for j in range(1, job.num_tokens)
        ]
        job.prompt_lp = None

    @staticmethod
    def _logprobs(jobs: list[PrefillJob], logits: jax.Array, first_ids: np.ndarray) -> None:
        """Each job's first-token logprob, when asked, set on the job."""
        if not any(j.sampling.HasField("logprobs") for j in jobs):
            return
        host_logits = np.asarray(logits)
        for i, job in enumerate(jobs):
            if job.sampling.HasField("logprobs"):
                job.first_logprob = logprobs.from_logits(host_logits[i : i + 1], [int(first_ids[i])],
                                                         job.sampling.logprobs)[0]

    def warmup(self, progress: bool = False, shapes: list[StepShape] | None = None) -> float:
        """Compiles (ahead of time: nothing runs) every program `_run` dispatches, for every shape of
        `shapes()` (or the given ones), so no request pays for a compile. Returns the seconds it took.
        (A worker that serves compiles the common ones first and the rest while it serves: warmup.py.)"""
        plan = Warmup(self, shapes)
        return plan.compile(plan.jobs, threads=cores(), progress=progress)

def _wire_format(k: np.ndarray, v: np.ndarray, job: PrefillJob) -> tuple:
    """k, v [L, n, Hkv, D] on the host, the first on a block boundary, in the job's wire format: (k, v, k
    scales, v scales), fp8_e4m3/int8 quantized by the numpy reference (kvcache/quant.py), scales None else."""
    if job.kv_dtype in QUANTIZED:
        qk, ks = host_quant.quantize(k.astype(np.float32), job.block_size, job.kv_dtype)
        if v.shape[-1] == 0:  # an MLA latent
            v0, vs0 = _no_value(qk, ks)
            return qk, v0, ks, vs0
        qv, vs = host_quant.quantize(v.astype(np.float32), job.block_size, job.kv_dtype)
        return qk, qv, ks, vs
    wire = NUMPY_DTYPES[job.kv_dtype]
    return k.astype(wire), v.astype(wire), None, None


def _no_value(k: np.ndarray, k_scales: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
    """The V and V scales of MLA latent entries k [l, n, 1, D] (scales [l, blocks, 1]): empty, [l, n, 1, 0] and
    [l, blocks, 0], in k's dtype and float32."""
    return np.zeros((*k.shape[:3], 0), k.dtype), None if k_scales is None else np.zeros((*k_scales.shape[:2], 0), np.float32)


def _resolve(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)
