"""The prefill loop: batch waiting prompts, pad to a bucket, run the jitted model layer group by group.

Life cycle of a prompt here:
1. `enqueue` queues it as a PrefillJob in the scheduler (scheduler.py: fifo or shortest-first);
   `submit` does that and collects the whole result.
2. The loop takes the scheduler's next batch (up to the batch limits), pads lengths to a power-of-two
   bucket and the batch to a power of two: one of `shapes()`, every one of which `warmup` compiled
   at start, so nothing compiles here. Each batch's speed is measured per bucket (rates.py) for the
   coordinator's expected-wait admission. `job.started` resolves: the prefill of this prompt begins
   (its KV stream opens now, and the decode worker's lease with it).
3. In a worker thread the model runs as `kv_layer_groups` jitted layer groups, dispatched back to
   back, then the head: the first token is sampled on the device, from the logits with the prompt's
   penalties and min_tokens applied; when asked, the prompt's logprobs come from the final hidden
   state of the same pass. Only then is each group's KV converted to the wire dtype on the device
   (fp8_e4m3/int8 quantized with per-block, per-kv-head scales over each prompt's true length) and
   copied to the host asynchronously, so the first token never waits behind KV on its way out.
4. The first token goes to `job.first_token` (its logprob and the prompt's logprobs on the job
   beside it) before any KV; then, as each group's host copy lands, every prompt of the batch gets
   its KvTensors for the true length on `job.kv` (then None).
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

from pdserve.kvcache.layout import NUMPY_DTYPES, QUANTIZED
from pdserve.kvcache.tensors import KvTensors
from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.server import logprobs
from pdserve.server.model.config import ModelConfig, resolve_max_model_len
from pdserve.server.prefill.config import PrefillConfig
from pdserve.server.prefill.model import bucket_length, embed, group_sizes, head, layer_group, prompt_logprobs_head
from pdserve.server.prefill.quant import quantize_kv
from pdserve.server.prefill.rates import PrefillRates
from pdserve.server.prefill.sampler import penalize, sample_jit
from pdserve.server.prefill.scheduler import PrefillScheduler

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
    """Resolves when the engine takes the job into a batch: its prefill begins."""
    first_token: asyncio.Future[int] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    kv: asyncio.Queue = field(default_factory=asyncio.Queue)
    """KvTensors of each layer group in order, then None; or the exception that ended the prefill."""
    first_logprob: gen_pb.TokenLogprob | None = None
    """The first token's logprob when sampling.logprobs is set; set before `first_token` resolves."""
    prompt_logprobs: list[gen_pb.TokenLogprob] = field(default_factory=list)
    """When sampling.prompt_logprobs is set: one per prompt token after the first; set before
    `first_token` resolves."""

    def cancel(self) -> None:
        """Drops the job if it is still queued; a running batch finishes without it."""
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


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


class PrefillEngine:
    def __init__(self, model_config: ModelConfig, params, config: PrefillConfig):
        self.model_config = model_config
        self.params = params
        self.config = config
        self.max_model_len = resolve_max_model_len(model_config.max_model_len, config.max_model_len or 0)
        self.max_len = _pow2(self.max_model_len)
        self.groups = group_sizes(model_config.num_layers, config.kv_layer_groups)
        """(first layer, layers) of each group the prefill runs and ships as one."""
        self._embed = jax.jit(partial(embed, config=model_config))
        self._group = jax.jit(partial(layer_group, config=model_config), static_argnames=("size",))
        self._head = jax.jit(partial(head, config=model_config))
        self._prompt_logprobs = jax.jit(partial(prompt_logprobs_head, config=model_config,
                                                top=min(logprobs.MAX_LOGPROBS, model_config.vocab_size)))
        self._quantize_kv = jax.jit(quantize_kv, static_argnames=("block_size", "fmt"))
        self._cast = jax.jit(lambda a, dtype: a.astype(dtype), static_argnames=("dtype",))
        self.scheduler: PrefillScheduler[PrefillJob] = PrefillScheduler(
            config.prefill_order, bucket=self._bucket, max_batch_size=config.max_batch_size,
            max_batch_tokens=config.max_batch_tokens, ageing_tokens_per_s=config.prefill_ageing)
        buckets = sorted({self._bucket(1 << i) for i in range(self.max_len.bit_length())})
        self.rates = PrefillRates(buckets)
        self._shapes_run: set[tuple[int, int]] = set()
        """(rows, padded length) of every batch run: a shape's first batch compiles, so is not timed."""
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.batches = 0

    def _bucket(self, n: int) -> int:
        return bucket_length(min(n, self.max_len), self.max_len, self.config.min_bucket)

    @property
    def queued_tokens(self) -> int:
        """Tokens of the prompts waiting or running."""
        return self.scheduler.queued_tokens

    def load(self) -> list:
        """Queued work and measured rate per bucket (WorkerLoad.prefill_buckets)."""
        return self.rates.report(self.scheduler.queued_by_bucket, self.scheduler.prompts_by_bucket)

    def enqueue(self, token_ids: list[int], sampling: gen_pb.SamplingParams, sample_index: int,
                kv_dtype: str, block_size: int = 16) -> PrefillJob:
        """Queues a prompt; its first token and KV arrive on the job. block_size: the target cache's,
        over which fp8_e4m3/int8 scales are computed."""
        if not 0 < len(token_ids) <= self.max_model_len:  # no bucket fits: it would stop the loop
            raise ValueError(f"a prompt of {len(token_ids)} tokens; this worker takes 1 to {self.max_model_len}")
        job = PrefillJob(token_ids, sampling, sample_index, kv_dtype, block_size)
        self.scheduler.add(job)
        self._wakeup.set()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._loop(), name="prefill-loop")
        return job

    async def submit(self, token_ids: list[int], sampling: gen_pb.SamplingParams, sample_index: int,
                     kv_dtype: str, block_size: int = 16) -> PrefillResult:
        """The whole result at once: the first token and the KV of all layers."""
        job = self.enqueue(token_ids, sampling, sample_index, kv_dtype, block_size)
        try:
            first = await job.first_token
            groups: list[KvTensors] = []
            while (group := await job.kv.get()) is not None:
                if isinstance(group, BaseException):
                    raise group
                groups.append(group)
        except asyncio.CancelledError:
            job.cancel()
            raise

        def cat(name: str) -> np.ndarray | None:
            parts = [getattr(g, name) for g in groups]
            return None if parts[0] is None else np.concatenate(parts)

        return PrefillResult(first, cat("k"), cat("v"), cat("k_scales"), cat("v_scales"),
                             job.first_logprob, job.prompt_logprobs)

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = self.scheduler.next_batch()
            if not batch:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            for job in batch:
                if not job.started.done():
                    job.started.set_result(None)
            t0 = time.perf_counter()
            shape = (_pow2(len(batch)), max(self._bucket(j.num_tokens) for j in batch))
            try:
                await asyncio.to_thread(self._run, batch, loop)
                if shape in self._shapes_run:
                    self.rates.record(shape[1], sum(j.num_tokens for j in batch), time.perf_counter() - t0)
                self._shapes_run.add(shape)
            except Exception as e:
                log.exception("prefill batch of %d failed", len(batch))
                for job in batch:
                    self._fail(job, e)
            finally:
                self.scheduler.finish(batch)
            self.batches += 1

    @staticmethod
    def _fail(job: PrefillJob, error: Exception) -> None:
        if not job.first_token.done():
            job.first_token.set_exception(error)
        job.kv.put_nowait(error)

    def _run(self, batch: list[PrefillJob], loop: asyncio.AbstractEventLoop) -> None:
        """Runs the batch (in a worker thread), handing each job its KV groups and first token."""
        lengths = [len(j.token_ids) for j in batch]
        seq_len = bucket_length(max(lengths), self.max_len, self.config.min_bucket)
        rows = _pow2(len(batch))
        tokens = np.zeros((rows, seq_len), dtype=np.int32)  # [B, S]
        for i, job in enumerate(batch):
            tokens[i, : lengths[i]] = job.token_ids
        true_lengths = np.ones((rows,), dtype=np.int32)
        true_lengths[: len(batch)] = lengths
        formats = {(j.kv_dtype, j.block_size) for j in batch}

        x, cos, sin = self._embed(self.params, tokens)  # [B, S, H], [S, D] x2
        kv = []  # (first layer, k, v [l, B, S, Hkv, D]) of each group, on the device
        for start, size in self.groups:  # dispatched back to back: XLA runs them while we wait below
            x, k, v = self._group(self.params["layers"], x, cos, sin, np.int32(start), size=size)
            kv.append((start, k, v))
        logits = self._head(self.params, x, true_lengths)  # [B, V]
        first = self._sample(self._penalized(logits, batch, tokens, true_lengths), batch, rows)
        prompt_lp = None
        if any(j.sampling.HasField("prompt_logprobs") for j in batch):  # the same pass's hidden state
            prompt_lp = self._prompt_logprobs(self.params, x, tokens)  # [B, S], [B, S, top] x2
        # The KV's conversion and host copies are queued behind the sampling, so the first token
        # (which needs every layer anyway) is answered before any KV leaves the device.
        pending = [(start, {f: self._to_wire(k, v, true_lengths, *f) for f in formats}) for start, k, v in kv]
        del kv, k, v
        first_ids = np.asarray(first)
        self._logprobs(batch, logits, first_ids, prompt_lp)
        for i, job in enumerate(batch):
            loop.call_soon_threadsafe(_resolve, job.first_token, int(first_ids[i]))

        for start, wire in pending:
            host = {f: tuple(None if a is None else np.asarray(a) for a in arrays) for f, arrays in wire.items()}
            for i, job in enumerate(batch):
                hk, hv, hks, hvs = host[job.kv_dtype, job.block_size]
                n, nb = lengths[i], -(-lengths[i] // job.block_size)
                group = KvTensors(start, 0, hk[:, i, :n], hv[:, i, :n],  # views into the batch's host copy
                                  None if hks is None else hks[:, i, :nb], None if hvs is None else hvs[:, i, :nb])
                loop.call_soon_threadsafe(job.kv.put_nowait, group)
        for job in batch:
            loop.call_soon_threadsafe(job.kv.put_nowait, None)

    def _to_wire(self, k: jax.Array, v: jax.Array, true_lengths: np.ndarray, dtype: str, block_size: int):
        """(k, v, k_scales, v_scales) in the wire format, already copying to the host."""
        if dtype in QUANTIZED:  # on the device, over each row's true length
            qk, k_scales = self._quantize_kv(k, true_lengths, block_size=block_size, fmt=dtype)
            qv, v_scales = self._quantize_kv(v, true_lengths, block_size=block_size, fmt=dtype)
            arrays = (qk, qv, k_scales, v_scales)
        else:
            wire = NUMPY_DTYPES[dtype]
            arrays = (k, v, None, None) if k.dtype == wire else (self._cast(k, dtype=dtype), self._cast(v, dtype=dtype), None, None)
        for a in arrays:
            if a is not None:
                a.copy_to_host_async()
        return arrays

    @staticmethod
    def _logprobs(batch: list[PrefillJob], logits: jax.Array, first_ids: np.ndarray, prompt_lp) -> None:
        """Each job's first-token logprob and prompt logprobs, when asked, set on the job."""
        host_logits = np.asarray(logits) if any(j.sampling.HasField("logprobs") for j in batch) else None
        prompt_lp = None if prompt_lp is None else [np.asarray(a) for a in prompt_lp]
        for i, job in enumerate(batch):
            p = job.sampling
            if p.HasField("logprobs"):
                job.first_logprob = logprobs.from_logits(host_logits[i : i + 1], [int(first_ids[i])], p.logprobs)[0]
            if p.HasField("prompt_logprobs"):
                chosen, top_ids, top_lps = (a[i] for a in prompt_lp)
                job.prompt_logprobs = [
                    logprobs.token_logprob(job.token_ids[j], chosen[j], top_ids[j], top_lps[j], p.prompt_logprobs)
                    for j in range(1, len(job.token_ids))
                ]

    def _penalized(self, logits: jax.Array, batch: list[PrefillJob], tokens: np.ndarray,
                   lengths: np.ndarray) -> jax.Array:
        """The logits with each prompt's penalties and min_tokens applied (the same logits when none asks)."""
        rows = tokens.shape[0]
        sp = [j.sampling for j in batch]
        blocked = np.zeros((rows, logits.shape[-1]), dtype=bool)  # [B, V]
        for i, job in enumerate(batch):
            if job.sample_index < job.sampling.min_tokens:
                eos = () if job.sampling.ignore_eos else self.model_config.eos_token_ids
                banned = [t for t in (*eos, *job.sampling.stop_token_ids) if 0 <= t < logits.shape[-1]]
                blocked[i, banned] = True
        repetition = [p.repetition_penalty if p.HasField("repetition_penalty") else 1.0 for p in sp]
        if not (blocked.any() or any(p.presence_penalty or p.frequency_penalty for p in sp)
                or any(r != 1.0 for r in repetition)):
            return logits
        return penalize(logits, tokens, lengths, _column([j.sample_index for j in batch], np.int32, rows),
                        _column([p.presence_penalty for p in sp], np.float32, rows),
                        _column([p.frequency_penalty for p in sp], np.float32, rows),
                        np.concatenate([np.asarray(repetition, np.float32),
                                        np.ones(rows - len(batch), np.float32)]), blocked)

    @staticmethod
    def _sample(logits: jax.Array, batch: list[PrefillJob], rows: int) -> jax.Array:
        def column(values, dtype):
            return _column(values, dtype, rows)

        sp = [j.sampling for j in batch]
        return sample_jit(
            logits,
            column([p.temperature for p in sp], np.float32),
            column([p.top_k for p in sp], np.int32),
            column([p.top_p if p.top_p > 0 else 1.0 for p in sp], np.float32),
            column([(p.seed if p.HasField("seed") else secrets.randbits(32)) % 2**32 for p in sp], np.uint32),
            column([j.sample_index for j in batch], np.int32),
            column([p.min_p for p in sp], np.float32),
        )

    def shapes(self) -> list[tuple[int, int]]:
        """Every (rows, padded length) batch the loop can run: rows a power of two up to the batch size,
        lengths the buckets, rows x length within --max-num-batched-tokens (a lone prompt always runs).
        `warmup` compiles exactly these; batching that changes the shapes changes this method."""
        rows = [1 << i for i in range(_pow2(self.config.max_batch_size).bit_length())]
        lengths = sorted({self._bucket(1 << i) for i in range(self.max_len.bit_length())})
        return [(r, s) for r in rows for s in lengths if r == 1 or r * s <= self.config.max_batch_tokens]

    def warmup(self, progress: bool = False) -> float:
        """Compiles (ahead of time: nothing runs) every program `_run` dispatches, for every shape of
        `shapes()`, so no request pays for a compile. Returns the seconds it took."""
        import os
        from concurrent.futures import ThreadPoolExecutor, as_completed

        from tqdm import tqdm

        t0 = time.perf_counter()
        shapes = self.shapes()
        with ThreadPoolExecutor(min(len(shapes), os.cpu_count() or 1), thread_name_prefix="compile") as pool:
            done = [pool.submit(self._compile, *shape) for shape in shapes]  # XLA compiles outside the GIL
            for future in tqdm(as_completed(done), total=len(done), desc="compiling prefill shapes", unit="shape",
                               disable=not progress):
                future.result()
        return time.perf_counter() - t0

    def _compile(self, rows: int, length: int) -> None:
        """The programs of one batch shape: embed, each layer group's size, head, sampling, penalties,
        prompt logprobs and the KV's cast to the unquantized wire dtypes."""
        spec = jax.ShapeDtypeStruct
        tokens, lengths = spec((rows, length), jnp.int32), spec((rows,), jnp.int32)
        column = {t: spec((rows,), t) for t in (jnp.float32, jnp.int32, jnp.uint32)}
        x, cos, sin = _avals(self._embed.lower(self.params, tokens).compile())
        casts = {d for d in ("float32", "bfloat16") if jnp.dtype(d) != x.dtype}
        done = set()  # (size, x's sharding): the groups' programs differ only in these
        for _, size in self.groups:  # in order: each group's x comes from the one before
            if (size, x.sharding) not in done:
                done.add((size, x.sharding))
                x, k, _ = _avals(self._group.lower(self.params["layers"], x, cos, sin, np.int32(0),
                                                   size=size).compile())
                for dtype in casts:
                    self._cast.lower(k, dtype=dtype).compile()
        logits, = _avals(self._head.lower(self.params, x, lengths).compile())
        f32, i32, u32 = column[jnp.float32], column[jnp.int32], column[jnp.uint32]
        sample_jit.lower(logits, f32, i32, f32, u32, i32, f32).compile()
        penalize.lower(logits, tokens, lengths, i32, f32, f32, f32, spec(logits.shape, jnp.bool_)).compile()
        self._prompt_logprobs.lower(self.params, x, tokens).compile()


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
