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
   shape is one of `shapes()`, compiled at start (`warmup`; a serving worker compiles the rarer ones while
   it serves, and a step whose shape is still waiting compiles it first: warmup.py).
   Each step's speed is measured for the coordinator's expected-wait admission (rates.py).
   `job.started` resolves at the first segment: the prompt's KV stream opens now, and the decode
   worker's lease with it.
3. In a worker thread the step becomes host arrays (`StepInputs`) and `dispatch` runs them (on a slice
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
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass, field
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from pdserve.kvcache import quant as host_quant
from pdserve.kvcache.layout import NUMPY_DTYPES, QUANTIZED
from pdserve.kvcache.tensors import KvTensors
from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.server import logprobs, metrics
from pdserve.server.model.config import ModelConfig, resolve_max_model_len
from pdserve.server.prefill.config import PrefillConfig
from pdserve.server.prefill.model import (Packing, bucket_length, embed, group_sizes, head, layer_group,
                                          prompt_logprobs_head, split_layers)
from pdserve.server.prefill.prefix_kv import PrefixKv
from pdserve.server.prefill.quant import quantize_kv_masked
from pdserve.server.prefill.rates import PrefillRates
from pdserve.server.prefill.replay import SliceLeader
from pdserve.server.prefill.sampler import penalize, sample
from pdserve.server.prefill.scheduler import PrefillScheduler, Segment, aligned, packed_tokens
from pdserve.server.prefill.sharding import host_readable
from pdserve.server.prefill.step_inputs import StepInputs
from pdserve.server.prefill.warmup import Warmup, cores

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
    the prefix KV; None while neither needs it."""
    prompt_lp: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    """When prompt logprobs are asked: chosen [T], top ids and logprobs [T, top], filled segment by segment."""

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


@dataclass(frozen=True)
class StepOutputs:
    """What `dispatch` returns, on the device (replicated over a mesh that spans processes)."""

    logits: jax.Array | None
    """f32 [R, V] at the finishing prompts' last tokens, before penalties (None: none finishes)."""
    first: jax.Array | None
    """int32 [R]: their sampled first tokens."""
    prompt_logprobs: tuple[jax.Array, jax.Array, jax.Array] | None
    """chosen [1, T], top ids and logprobs [1, T, top], when a prompt asks for them."""
    kv: list[tuple[int, dict[tuple[str, int], tuple], jax.Array, jax.Array]]
    """Each layer group's first layer, its KV in each wire format (k, v, k scales, v scales; scales None
    unquantized), and its k, v [l, 1, T, Hkv, D] in the compute dtype."""

    def wait(self) -> None:
        """Returns when every program of the step has run (what a slice's follower waits for)."""
        jax.block_until_ready([self.logits, self.first, self.prompt_logprobs,
                               [(k, v, *wire.values()) for _, wire, k, v in self.kv]])


@dataclass(frozen=True)
class StepShape:
    """The static shape of one step: XLA compiles each once."""

    tokens: int
    """The packed buffer's token slots (a token bucket)."""
    context: int
    """Context slots (a context bucket; 0 when no segment has earlier tokens)."""


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


CONTEXT_BUCKET = 256
"""The smallest context bucket."""


def _buckets(smallest: int, largest: int, growth: int = 2) -> list[int]:
    """smallest, smallest * growth, ... below `largest`, then `largest`."""
    out = []
    b = smallest
    while b < largest:
        out.append(b)
        b *= growth
    return [*out, largest]


class PrefillEngine:
    def __init__(self, model_config: ModelConfig, params, config: PrefillConfig):
        self.model_config = model_config
        self.config = config
        self.max_model_len = resolve_max_model_len(model_config.max_model_len, config.max_model_len or 0)
        self.max_len = _pow2(self.max_model_len)
        self.groups = group_sizes(model_config.num_layers, config.kv_layer_groups)
        """(first layer, layers) of each group the prefill runs and ships as one."""
        self.group_layers = split_layers(params["layers"], self.groups)
        """Each group's own weight stack; the engine keeps no stack of all layers beside them."""
        self.params = {name: value for name, value in params.items() if name != "layers"}
        """embed, final_norm, [lm_head]."""
        largest = min(config.max_batch_tokens, _pow2(config.max_batch_size) * self.max_len)  # what steps can fill
        self.token_buckets = _buckets(min(config.min_bucket, largest), largest)
        """The packed buffer's sizes, powers of two: few and static, so every one is compiled at start."""
        chunked = min(config.max_prefill_chunk or config.max_batch_tokens, config.max_batch_tokens) < self.max_model_len
        self.context_buckets = [0]
        if chunked or config.prefix_cache_bytes:  # else no step has context: nothing to compile for it
            self.context_buckets += _buckets(min(CONTEXT_BUCKET, self.max_len), self.max_len, growth=4)
        """Context sizes (all segments' earlier tokens of a step together, at most max_len), growing 4x:
        padded context costs little (attention skips key blocks no query reads), a shape costs a compile."""
        self.dtype = params["embed"].dtype
        self.vocab_size = self.params.get("lm_head", self.params["embed"]).shape[0]
        out = host_readable(params)  # on a mesh that spans processes: outputs replicated, for process 0 to read
        self._embed = jax.jit(partial(embed, config=model_config), **out)
        self._group = jax.jit(partial(layer_group, config=model_config), **out)
        self._head = jax.jit(partial(head, config=model_config), **out)
        self._penalize = jax.jit(penalize, **out)
        self._sample = jax.jit(sample, **out)
        self._prompt_logprobs = jax.jit(partial(prompt_logprobs_head, config=model_config,
                                                top=min(logprobs.MAX_LOGPROBS, model_config.vocab_size)), **out)
        self._quantize_kv = jax.jit(quantize_kv_masked, static_argnames=("block_size", "fmt"), **out)
        self._cast = jax.jit(lambda a, dtype: a.astype(dtype), static_argnames=("dtype",), **out)
        self.replay: SliceLeader | None = None
        """On process 0 of a slice of several processes: sends each step to the others before running it."""
        self.compiling: Warmup | None = None
        """The start-up compiles still going on while the worker serves (warmup.py); a step makes sure of
        its own programs first."""
        self.prefix = PrefixKv(num_layers=model_config.num_layers, num_kv_heads=model_config.num_kv_heads,
                               head_dim=model_config.head_dim, dtype=np.dtype(self.dtype),
                               budget_bytes=config.prefix_cache_bytes)
        buckets = sorted({self._bucket(1 << i) for i in range(self.max_len.bit_length())})
        self.rates = PrefillRates(buckets)
        self.scheduler: PrefillScheduler[PrefillJob] = PrefillScheduler(
            config.prefill_order, bucket=self._bucket, max_batch_size=config.max_batch_size,
            max_batch_tokens=config.max_batch_tokens, max_chunk=config.max_prefill_chunk,
            max_context=self.max_len, ageing_tokens_per_s=config.prefill_ageing, seconds=self.rates.seconds)
        self._shapes_run: set[StepShape] = set()
        """Every step shape run: a shape's first step compiles, so is not timed."""
        self.slots = 0
        """Token slots of every step run (the buffers' sizes)."""
        self.padding = 0
        """Of those, slots that held no prompt token."""
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.batches = 0

    def close(self) -> None:
        """On process 0 of a slice: tells the other processes to stop (nothing to do on one process)."""
        if self.replay is not None:
            self.replay.stop()

    def _bucket(self, n: int) -> int:
        return bucket_length(min(n, self.max_len), self.max_len, self.config.min_bucket)

    def shapes(self) -> list[StepShape]:
        """Every step shape this engine can run (each layer group, the head and the samplers at
        power-of-two rows up to max_batch_size come with each)."""
        return [StepShape(t, c) for c in self.context_buckets for t in self.token_buckets]

    def step_shape(self, step: list[Segment]) -> StepShape:
        """The smallest shape that holds the step's packed tokens and its context."""
        tokens, context = packed_tokens(step), sum(s.start for s in step)
        return StepShape(next(b for b in self.token_buckets if b >= tokens),
                         next(b for b in self.context_buckets if b >= context))

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
                kv_dtype: str, block_size: int = 16, due: float | None = None) -> PrefillJob:
        """Queues a prompt; its first token and KV arrive on the job. block_size: the target cache's,
        over which fp8_e4m3/int8 scales are computed (a power of two). due: when its first token is due
        (time.monotonic(); the TTFT budget it was admitted under), None: never urgent (scheduler.py)."""
        if not 0 < len(token_ids) <= self.max_model_len:  # no bucket fits: it would stop the loop
            raise ValueError(f"a prompt of {len(token_ids)} tokens; this worker takes 1 to {self.max_model_len}")
        if block_size <= 0 or block_size & (block_size - 1):
            raise ValueError(f"KV block size {block_size} is not a power of two")
        job = PrefillJob(token_ids, sampling, sample_index, kv_dtype, block_size)
        if not sampling.HasField("prompt_logprobs"):  # those need every position's hidden state
            hit = self.prefix.lookup(token_ids, multiple_of=block_size)
            if hit is not None:
                job.computed = hit[0].shape[1]
                job.context = self._new_context(job)
                job.context[0, :, : job.computed], job.context[1, :, : job.computed] = hit
                metrics.prefill_prefix_cache_hits.inc(job.computed)
        self.scheduler.add(job, due)
        self._wakeup.set()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._loop(), name="prefill-loop")
        return job

    def _new_context(self, job: PrefillJob) -> np.ndarray:
        c = self.model_config
        return np.zeros((2, c.num_layers, job.num_tokens, c.num_kv_heads, c.head_dim), np.dtype(self.dtype))

    async def submit(self, token_ids: list[int], sampling: gen_pb.SamplingParams, sample_index: int,
                     kv_dtype: str, block_size: int = 16) -> PrefillResult:
        """The whole result at once: the first token and the KV of all layers."""
        job = self.enqueue(token_ids, sampling, sample_index, kv_dtype, block_size)
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
        k, v = np.zeros(shape, pieces[0].k.dtype), np.zeros(shape, pieces[0].v.dtype)
        quantized = pieces[0].k_scales is not None
        scales_shape = (c.num_layers, -(-n // block_size), c.num_kv_heads)
        ks, vs = (np.zeros(scales_shape, np.float32), np.zeros(scales_shape, np.float32)) if quantized else (None, None)
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

    def _pack(self, step: list[Segment[PrefillJob]], shape: StepShape):
        """Host arrays of the step: tokens, Packing, context k and v [L, 1, C, Hkv, D], segment offsets."""
        c = self.model_config
        align = max(s.job.block_size for s in step)
        tokens = np.zeros((1, shape.tokens), np.int32)  # [1, T]
        positions = np.zeros((1, shape.tokens), np.int32)
        segments = np.full((1, shape.tokens), -1, np.int32)
        context = np.zeros((2, c.num_layers, 1, shape.context, c.num_kv_heads, c.head_dim), np.dtype(self.dtype))
        context_positions = np.zeros((1, shape.context), np.int32)  # [1, C]
        context_segments = np.full((1, shape.context), -2, np.int32)
        offsets: list[int] = []
        at, ctx_at = 0, 0
        for i, s in enumerate(step):
            offsets.append(at)
            tokens[0, at : at + s.length] = s.job.token_ids[s.start : s.end]
            positions[0, at : at + s.length] = np.arange(s.start, s.end)
            segments[0, at : at + s.length] = i
            at += aligned(s.length, align)
            if s.start:
                context[:, :, 0, ctx_at : ctx_at + s.start] = s.job.context[:, :, : s.start]
                context_positions[0, ctx_at : ctx_at + s.start] = np.arange(s.start)
                context_segments[0, ctx_at : ctx_at + s.start] = i
                ctx_at += s.start
        packing = Packing(positions, segments, context_positions, context_segments)
        return tokens, packing, context, offsets

    def _inputs(self, step: list[Segment[PrefillJob]], shape: StepShape) -> tuple[StepInputs, list[int]]:
        """The step's device work as host arrays, and each segment's offset in the token buffer."""
        tokens, packing, context, offsets = self._pack(step, shape)
        finishing = [(i, s) for i, s in enumerate(step) if s.last]
        head_rows = penalties = sampling = next_tokens = None
        if finishing:
            rows = _pow2(len(finishing))
            head_rows = np.zeros((rows,), np.int32)
            head_rows[: len(finishing)] = [offsets[i] + s.length - 1 for i, s in finishing]
            jobs = [s.job for _, s in finishing]
            penalties, sampling = self._penalties(jobs, rows), self._sampling(jobs, rows)
        if any(s.job.sampling.HasField("prompt_logprobs") for s in step):  # this pass's hidden state
            next_tokens = self._next_tokens(step, offsets, shape)
        formats = tuple(sorted({(s.job.kv_dtype, s.job.block_size) for s in step}))
        return StepInputs(tokens, packing, context, formats, head_rows, penalties, sampling, next_tokens), offsets

    def dispatch(self, inputs: StepInputs, to_host: bool = True) -> StepOutputs:
        """Dispatches one step's programs, in this order (on every process of a slice): embed, each layer
        group, the head and sampling of the finishing prompts, their prompt logprobs, then each group's KV
        converted to each wire format (queued behind the sampling, so a first token never waits for KV)
        and, `to_host`, copying to the host as it is ready (a slice's other processes read nothing)."""
        packing = inputs.packing
        x, cos, sin = self._embed(self.params, inputs.tokens, packing.positions)  # [1, T, H], [1, T, D] x2
        kv = []  # (first layer, k, v [l, 1, T, Hkv, D]) of each group, on the device
        # The groups are dispatched back to back: XLA runs them while the host goes on.
        for (start, size), layers in zip(self.groups, self.group_layers):
            x, k, v = self._group(layers, x, cos, sin, packing, inputs.context[0, start : start + size],
                                  inputs.context[1, start : start + size])
            kv.append((start, k, v))
        logits = first = prompt_lp = None
        if inputs.head_rows is not None:
            logits = self._head(self.params, x, inputs.head_rows)  # [R, V]
            penalized = logits if inputs.penalties is None else self._penalize(logits, *inputs.penalties)
            first = self._sample(penalized, *inputs.sampling)  # [R]
        if inputs.next_tokens is not None:
            prompt_lp = self._prompt_logprobs(self.params, x, inputs.next_tokens)
        valid = packing.segments >= 0  # [1, T]
        wire = [(start, {f: self._to_wire(k, v, valid, *f, to_host=to_host) for f in inputs.formats}, k, v)
                for start, k, v in kv]
        return StepOutputs(logits, first, prompt_lp, wire)

    def _run(self, step: list[Segment[PrefillJob]], shape: StepShape, loop: asyncio.AbstractEventLoop) -> None:
        """Runs one step (in a worker thread), handing each job its KV and, at its last segment, its first token."""
        inputs, offsets = self._inputs(step, shape)
        if self.compiling is not None:
            self.compiling.ensure_step(shape, inputs)
        keep = [s for s in step if not s.last or self.prefix.enabled]  # whose compute-dtype KV the host keeps
        for s in keep:
            if s.job.context is None:
                s.job.context = self._new_context(s.job)
        out = self.dispatch(inputs) if self.replay is None else self.replay.run(inputs, self.dispatch)
        for _, _, k, v in out.kv if keep else ():
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
            if keep:
                hk, hv = np.asarray(k), np.asarray(v)  # [l, 1, T, Hkv, D]
                for s in keep:
                    off = offsets[step.index(s)]
                    s.job.context[0, start : start + hk.shape[0], s.start : s.end] = hk[:, 0, off : off + s.length]
                    s.job.context[1, start : start + hk.shape[0], s.start : s.end] = hv[:, 0, off : off + s.length]
            for i, s in enumerate(step):
                job, off, bs = s.job, offsets[i], s.job.block_size
                hk, hv, hks, hvs = host[job.kv_dtype, bs]
                b0, nb = off // bs, -(-s.length // bs)
                piece = KvTensors(start, s.start, hk[:, 0, off : off + s.length], hv[:, 0, off : off + s.length],
                                  None if hks is None else hks[:, 0, b0 : b0 + nb],
                                  None if hvs is None else hvs[:, 0, b0 : b0 + nb])
                self._put(loop, job, piece)
        for s in step:
            s.job.computed = s.job.sent = s.end
            if s.last:
                if s.job.prompt_lp is not None:
                    self._finish_prompt_logprobs(s.job)
                if s.job.context is not None and self.prefix.enabled:
                    loop.call_soon_threadsafe(self._store_prefix, s.job.token_ids, s.job.context)
                s.job.context = None
                self._put(loop, s.job, None)

    def _store_prefix(self, token_ids: list[int], context: np.ndarray) -> None:
        """On the event loop's thread, where lookups run too."""
        self.prefix.store(token_ids, context[0], context[1])

    @staticmethod
    def _put(loop: asyncio.AbstractEventLoop, job: PrefillJob, item) -> None:
        loop.call_soon_threadsafe(job.kv.put_nowait, item)

    def _host_wire(self, job: PrefillJob, layer_start: int, token_start: int, token_end: int) -> KvTensors:
        """Tokens [token_start, token_end) of the job's host context (all layers) in its wire format."""
        k, v = (job.context[i, :, token_start:token_end] for i in (0, 1))  # [L, n, Hkv, D]
        if job.kv_dtype in QUANTIZED:
            (qk, ks), (qv, vs) = (host_quant.quantize(x.astype(np.float32), job.block_size, job.kv_dtype) for x in (k, v))
            return KvTensors(layer_start, token_start, qk, qv, ks, vs)
        wire = NUMPY_DTYPES[job.kv_dtype]
        return KvTensors(layer_start, token_start, k.astype(wire), v.astype(wire))

    def _to_wire(self, k: jax.Array, v: jax.Array, valid: np.ndarray, dtype: str, block_size: int,
                 to_host: bool = True):
        """(k, v, k_scales, v_scales) in the wire format, (`to_host`) already copying to the host."""
        if dtype in QUANTIZED:  # on the device, over the real tokens' blocks
            qk, k_scales = self._quantize_kv(k, valid, block_size=block_size, fmt=dtype)
            qv, v_scales = self._quantize_kv(v, valid, block_size=block_size, fmt=dtype)
            arrays = (qk, qv, k_scales, v_scales)
        else:
            same = k.dtype == NUMPY_DTYPES[dtype]
            arrays = (k, v, None, None) if same else (self._cast(k, dtype=dtype), self._cast(v, dtype=dtype), None, None)
        for a in arrays if to_host else ():
            if a is not None:
                a.copy_to_host_async()
        return arrays

    @staticmethod
    def _next_tokens(step: list[Segment[PrefillJob]], offsets: list[int], shape: StepShape) -> np.ndarray:
        """int32 [1, T]: the token each position of the buffer predicts (position p: token p + 1)."""
        next_tokens = np.zeros((1, shape.tokens), np.int32)
        for i, s in enumerate(step):
            ahead = s.job.token_ids[s.start + 1 : s.end + 1]
            next_tokens[0, offsets[i] : offsets[i] + len(ahead)] = ahead
        return next_tokens

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

    def _penalties(self, jobs: list[PrefillJob], rows: int) -> tuple[np.ndarray, ...] | None:
        """`penalize`'s arguments after the logits, for each prompt's penalties and min_tokens (None when
        none asks: the logits are sampled as they are)."""
        sp = [j.sampling for j in jobs]
        blocked = np.zeros((rows, self.vocab_size), dtype=bool)  # [R, V]
        for i, job in enumerate(jobs):
            if job.sample_index < job.sampling.min_tokens:
                eos = () if job.sampling.ignore_eos else self.model_config.eos_token_ids
                banned = [t for t in (*eos, *job.sampling.stop_token_ids) if 0 <= t < self.vocab_size]
                blocked[i, banned] = True
        repetition = [p.repetition_penalty if p.HasField("repetition_penalty") else 1.0 for p in sp]
        if not (blocked.any() or any(p.presence_penalty or p.frequency_penalty for p in sp)
                or any(r != 1.0 for r in repetition)):
            return None
        lengths = _column([j.num_tokens for j in jobs], np.int32, rows)
        tokens = np.zeros((rows, self._bucket(int(lengths.max()))), np.int32)  # [R, S]: the whole prompts
        for i, job in enumerate(jobs):
            tokens[i, : job.num_tokens] = job.token_ids
        lengths[len(jobs):] = 1
        return (tokens, lengths, _column([j.sample_index for j in jobs], np.int32, rows),
                _column([p.presence_penalty for p in sp], np.float32, rows),
                _column([p.frequency_penalty for p in sp], np.float32, rows),
                np.concatenate([np.asarray(repetition, np.float32), np.ones(rows - len(jobs), np.float32)]), blocked)

    @staticmethod
    def _sampling(jobs: list[PrefillJob], rows: int) -> tuple[np.ndarray, ...]:
        """`sample`'s columns after the logits: each prompt's sampling parameters (a seed drawn here when
        it has none), padded to the head's rows."""
        def column(values, dtype):
            return _column(values, dtype, rows)

        sp = [j.sampling for j in jobs]
        return (
            column([p.temperature for p in sp], np.float32),
            column([p.top_k for p in sp], np.int32),
            column([p.top_p if p.top_p > 0 else 1.0 for p in sp], np.float32),
            column([(p.seed if p.HasField("seed") else secrets.randbits(32)) % 2**32 for p in sp], np.uint32),
            column([j.sample_index for j in jobs], np.int32),
            column([p.min_p for p in sp], np.float32),
        )

    def warmup(self, progress: bool = False, shapes: list[StepShape] | None = None) -> float:
        """Compiles (ahead of time: nothing runs) every program `_run` dispatches, for every shape of
        `shapes()` (or the given ones), so no request pays for a compile. Returns the seconds it took.
        (A worker that serves compiles the common ones first and the rest while it serves: warmup.py.)"""
        plan = Warmup(self, shapes)
        return plan.compile(plan.jobs, threads=cores(), progress=progress)

    def _compile_step(self, shape: StepShape) -> list[jax.ShapeDtypeStruct]:
        """The programs of one step shape: embed, each layer group's size, the KV's cast to the
        unquantized wire dtypes, the head at every row count, and the prompt logprobs."""
        c, spec = self.model_config, jax.ShapeDtypeStruct
        ints = spec((1, shape.tokens), jnp.int32)
        ctx = spec((1, shape.context), jnp.int32)
        packing = Packing(ints, ints, ctx, ctx)
        x, cos, sin = _avals(self._embed.lower(self.params, ints, ints).compile())
        casts = {d for d in ("float32", "bfloat16") if jnp.dtype(d) != x.dtype}
        done = set()  # (size, x's sharding): the groups' programs differ only in these
        for (_, size), layers in zip(self.groups, self.group_layers):  # each group's x comes from the one before
            if (size, x.sharding) not in done:
                done.add((size, x.sharding))
                context = spec((size, 1, shape.context, c.num_kv_heads, c.head_dim), self.dtype)
                x, k, _ = _avals(self._group.lower(layers, x, cos, sin, packing, context, context).compile())
                for dtype in casts:
                    self._cast.lower(k, dtype=dtype).compile()
        logits = [_avals(self._head.lower(self.params, x, spec((r,), jnp.int32)).compile())[0]
                  for r in (1 << i for i in range(_pow2(self.config.max_batch_size).bit_length()))]
        self._prompt_logprobs.lower(self.params, x, ints).compile()
        return logits  # [R, V] at each row count R

    def _compile_sample(self, logits: jax.ShapeDtypeStruct) -> None:
        """Sampling of the logits as the head returns them (no penalties)."""
        spec, rows = jax.ShapeDtypeStruct, logits.shape[0]
        f32, i32, u32 = (spec((rows,), t) for t in (jnp.float32, jnp.int32, jnp.uint32))
        self._sample.lower(logits, f32, i32, f32, u32, i32, f32).compile()

    def _compile_penalized(self, logits: jax.ShapeDtypeStruct, length: int) -> None:
        """The penalties over prompts padded to `length` at the head's logits' rows, and sampling of
        what they return."""
        spec, rows = jax.ShapeDtypeStruct, logits.shape[0]
        f32, i32 = spec((rows,), jnp.float32), spec((rows,), jnp.int32)
        penalized, = _avals(self._penalize.lower(logits, spec((rows, length), jnp.int32), i32, i32, f32, f32, f32,
                                                 spec(logits.shape, jnp.bool_)).compile())
        if penalized != logits:  # else `_compile_sample`'s
            self._compile_sample(penalized)


def _avals(compiled) -> tuple[jax.ShapeDtypeStruct, ...]:
    """What a compiled program returns, as the next program's arguments: sharded as it returns them
    over a mesh; on one device uncommitted, as arrays made from numpy (and so its outputs) are."""
    return tuple(jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=o.sharding if
                                      isinstance(o.sharding, jax.sharding.NamedSharding) else None)
                 for o in jax.tree.leaves(compiled.out_info))


def _column(values: list, dtype, rows: int) -> np.ndarray:
    """values padded with zeros to the batch's rows."""
    out = np.zeros((rows,), dtype=dtype)
    out[: len(values)] = values
    return out


def _resolve(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)
