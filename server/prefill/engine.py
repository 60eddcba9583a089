"""The prefill loop: batch waiting prompts, pad to a bucket, run the jitted model, sample.

Life cycle of a prompt here:
1. `submit` queues it in the scheduler (scheduler.py: fifo or shortest-first) and waits on a future.
2. The loop takes the scheduler's next batch (up to the batch limits), pads lengths to a power-of-two
   bucket and the batch to a power of two, so XLA compiles a bounded set of shapes; each batch's
   speed is measured per bucket (rates.py) for the coordinator's expected-wait admission.
3. The model runs in a worker thread; the first token is sampled on the device.
4. Each prompt gets its first token and its KV for the true length only, in the wire dtype: for
   fp8_e4m3/int8 quantized on the device with per-block, per-kv-head scales (prefill.quant).
   The caller streams that KV while the next batch computes.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from pdserve.kvcache.layout import NUMPY_DTYPES, QUANTIZED
from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.server.model.config import ModelConfig
from pdserve.server.prefill.config import PrefillConfig
from pdserve.server.prefill.model import bucket_length, make_prefill_fn
from pdserve.server.prefill.quant import quantize_kv
from pdserve.server.prefill.rates import PrefillRates
from pdserve.server.prefill.sampler import sample_jit
from pdserve.server.prefill.scheduler import PrefillScheduler

log = logging.getLogger("pdserve.prefill")


@dataclass
class PrefillResult:
    first_token: int
    k: np.ndarray  # [L, T, Hkv, D] in the wire dtype
    v: np.ndarray  # [L, T, Hkv, D]
    k_scales: np.ndarray | None = None  # [L, ceil(T / block_size), Hkv] float32 for fp8_e4m3/int8
    v_scales: np.ndarray | None = None


@dataclass
class PrefillJob:
    token_ids: list[int]
    sampling: gen_pb.SamplingParams
    sample_index: int
    kv_dtype: str
    block_size: int
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def cancelled(self) -> bool:
        return self.future.done()


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


class PrefillEngine:
    def __init__(self, model_config: ModelConfig, params, config: PrefillConfig):
        self.model_config = model_config
        self.params = params
        self.config = config
        self.max_len = _pow2(model_config.max_model_len)
        self._fn = make_prefill_fn(model_config)
        self._quantize_kv = jax.jit(quantize_kv, static_argnames=("block_size", "fmt"))
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

    async def submit(self, token_ids: list[int], sampling: gen_pb.SamplingParams, sample_index: int,
                     kv_dtype: str, block_size: int = 16) -> PrefillResult:
        """block_size: the target cache's, over which fp8_e4m3/int8 scales are computed."""
        if not 0 < len(token_ids) <= self.model_config.max_model_len:  # no bucket fits: it would stop the loop
            raise ValueError(f"a prompt of {len(token_ids)} tokens; this model takes 1 to "
                             f"{self.model_config.max_model_len}")
        job = PrefillJob(token_ids, sampling, sample_index, kv_dtype, block_size)
        self.scheduler.add(job)
        self._wakeup.set()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._loop(), name="prefill-loop")
        return await job.future

    async def _loop(self) -> None:
        while True:
            batch = self.scheduler.next_batch()
            if not batch:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            t0 = time.perf_counter()
            shape = (_pow2(len(batch)), max(self._bucket(j.num_tokens) for j in batch))
            try:
                results = await asyncio.to_thread(self._run, batch)
                if shape in self._shapes_run:
                    self.rates.record(shape[1], sum(j.num_tokens for j in batch), time.perf_counter() - t0)
                self._shapes_run.add(shape)
            except Exception as e:
                log.exception("prefill batch of %d failed", len(batch))
                results = [e] * len(batch)
            finally:
                self.scheduler.finish(batch)
            self.batches += 1
            for job, result in zip(batch, results):
                if job.future.done():
                    continue
                if isinstance(result, Exception):
                    job.future.set_exception(result)
                else:
                    job.future.set_result(result)

    def _run(self, batch: list[PrefillJob]) -> list[PrefillResult]:
        lengths = [len(j.token_ids) for j in batch]
        seq_len = bucket_length(max(lengths), self.max_len, self.config.min_bucket)
        rows = _pow2(len(batch))
        tokens = np.zeros((rows, seq_len), dtype=np.int32)  # [B, S]
        for i, job in enumerate(batch):
            tokens[i, : lengths[i]] = job.token_ids
        true_lengths = np.ones((rows,), dtype=np.int32)
        true_lengths[: len(batch)] = lengths
        logits, k, v = self._fn(self.params, tokens, true_lengths)  # [B, V], [L, B, S, Hkv, D] x2

        def column(values, dtype):
            out = np.zeros((rows,), dtype=dtype)
            out[: len(values)] = values
            return out

        sp = [j.sampling for j in batch]
        first = sample_jit(
            logits,
            column([p.temperature for p in sp], np.float32),
            column([p.top_k for p in sp], np.int32),
            column([p.top_p if p.top_p > 0 else 1.0 for p in sp], np.float32),
            column([(p.seed if p.HasField("seed") else secrets.randbits(32)) % 2**32 for p in sp], np.uint32),
            column([j.sample_index for j in batch], np.int32),
        )
        first = np.asarray(first)
        host: dict[tuple[str, int], tuple[np.ndarray, ...]] = {}
        for dtype, bs in {(j.kv_dtype, j.block_size) for j in batch}:
            if dtype in QUANTIZED:  # on the device, over each row's true length
                qk, k_scales = self._quantize_kv(k, true_lengths, block_size=bs, fmt=dtype)
                qv, v_scales = self._quantize_kv(v, true_lengths, block_size=bs, fmt=dtype)
                host[dtype, bs] = tuple(np.asarray(a) for a in (qk, qv, k_scales, v_scales))
            else:
                wire = NUMPY_DTYPES[dtype]
                host[dtype, bs] = (np.asarray(k.astype(wire)), np.asarray(v.astype(wire)), None, None)
        results = []
        for i, job in enumerate(batch):
            hk, hv, hks, hvs = host[job.kv_dtype, job.block_size]
            n = lengths[i]
            nb = -(-n // job.block_size)
            results.append(PrefillResult(
                int(first[i]), np.ascontiguousarray(hk[:, i, :n]), np.ascontiguousarray(hv[:, i, :n]),
                None if hks is None else np.ascontiguousarray(hks[:, i, :nb]),
                None if hvs is None else np.ascontiguousarray(hvs[:, i, :nb]),
            ))
        return results

    def warmup(self) -> None:
        """Compiles the smallest bucket so the first request does not pay for it."""
        tokens = np.zeros((1, self.config.min_bucket), dtype=np.int32)
        self._shapes_run.add(tokens.shape)
        logits, k, v = self._fn(self.params, tokens, np.ones((1,), dtype=np.int32))
        jax.block_until_ready(sample_jit(logits, jnp.zeros(1), jnp.zeros(1, jnp.int32), jnp.ones(1),
                                         jnp.zeros(1, jnp.uint32), jnp.zeros(1, jnp.int32)))
