"""The prefill loop: batch waiting prompts, pad to a bucket, run the jitted model, sample.

Life cycle of a prompt here:
1. `submit` queues it and waits on a future.
2. The loop takes the queued prompts (up to the batch limits), pads lengths to a power-of-two
   bucket and the batch to a power of two, so XLA compiles a bounded set of shapes.
3. The model runs in a worker thread; the first token is sampled on the device.
4. Each prompt gets its first token and its KV for the true length only, in the wire dtype: for
   fp8_e4m3/int8 quantized on the device with per-block, per-kv-head scales (prefill.quant).
   The caller streams that KV while the next batch computes.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections import deque
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from pdserve.kvcache.layout import NUMPY_DTYPES, QUANTIZED
from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.server.model.config import ModelConfig, resolve_max_model_len
from pdserve.server.prefill.config import PrefillConfig
from pdserve.server.prefill.model import bucket_length, make_prefill_fn
from pdserve.server.prefill.quant import quantize_kv
from pdserve.server.prefill.sampler import sample_jit

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


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


class PrefillEngine:
    def __init__(self, model_config: ModelConfig, params, config: PrefillConfig):
        self.model_config = model_config
        self.params = params
        self.config = config
        self.max_model_len = resolve_max_model_len(model_config.max_model_len, config.max_model_len)
        self.max_len = _pow2(self.max_model_len)
        self._fn = make_prefill_fn(model_config)
        self._quantize_kv = jax.jit(quantize_kv, static_argnames=("block_size", "fmt"))
        self._queue: deque[PrefillJob] = deque()
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.queued_tokens = 0
        self.batches = 0

    async def submit(self, token_ids: list[int], sampling: gen_pb.SamplingParams, sample_index: int,
                     kv_dtype: str, block_size: int = 16) -> PrefillResult:
        """block_size: the target cache's, over which fp8_e4m3/int8 scales are computed."""
        if not 0 < len(token_ids) <= self.max_model_len:  # no bucket fits: it would stop the loop
            raise ValueError(f"a prompt of {len(token_ids)} tokens; this worker takes 1 to {self.max_model_len}")
        job = PrefillJob(token_ids, sampling, sample_index, kv_dtype, block_size)
        self._queue.append(job)
        self.queued_tokens += len(token_ids)
        self._wakeup.set()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._loop(), name="prefill-loop")
        return await job.future

    def _take_batch(self) -> list[PrefillJob]:
        batch: list[PrefillJob] = []
        longest = 0
        while self._queue and len(batch) < self.config.max_batch_size:
            job = self._queue[0]
            if job.future.done():  # cancelled while queued
                self._queue.popleft()
                self.queued_tokens -= len(job.token_ids)
                continue
            longest_if = max(longest, len(job.token_ids))
            padded = _pow2(len(batch) + 1) * bucket_length(longest_if, self.max_len, self.config.min_bucket)
            if batch and padded > self.config.max_batch_tokens:
                break
            batch.append(self._queue.popleft())
            longest = longest_if
        return batch

    async def _loop(self) -> None:
        while True:
            batch = self._take_batch()
            if not batch:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            try:
                results = await asyncio.to_thread(self._run, batch)
            except Exception as e:
                log.exception("prefill batch of %d failed", len(batch))
                results = [e] * len(batch)
            finally:
                self.queued_tokens -= sum(len(j.token_ids) for j in batch)
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
        logits, k, v = self._fn(self.params, tokens, np.ones((1,), dtype=np.int32))
        jax.block_until_ready(sample_jit(logits, jnp.zeros(1), jnp.zeros(1, jnp.int32), jnp.ones(1),
                                         jnp.zeros(1, jnp.uint32), jnp.zeros(1, jnp.int32)))
