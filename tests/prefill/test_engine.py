"""The prefill engine batches concurrent prompts and gives each exactly what it gives alone."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from pdserve.kvcache.tensors import KvTensors
from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.server.model.config import load_config
from pdserve.server.model.weights import load_weights
from pdserve.server.prefill.config import PrefillConfig
from pdserve.server.prefill.engine import PrefillEngine
from pdserve.server.prefill.model import load_params

GREEDY = gen_pb.SamplingParams(max_tokens=4, temperature=0.0, top_p=1.0, top_k=0)


def _engine(path, **kw) -> PrefillEngine:
    config = load_config(path)
    return PrefillEngine(config, load_params(config, load_weights(path)), PrefillConfig(model_dir=path, **kw))


async def test_concurrent_prompts_are_batched_and_exact(tiny_model):
    path = tiny_model("qwen2")
    engine = _engine(path)
    prompts = [list(range(3, 3 + n)) for n in (3, 17, 9, 30, 1)]
    results = await asyncio.gather(*(engine.submit(p, GREEDY, 0, "float32") for p in prompts))
    assert engine.batches < len(prompts)  # at least two prompts shared a batch
    alone = _engine(path, max_batch_size=1)
    for prompt, got in zip(prompts, results):
        want = await alone.submit(prompt, GREEDY, 0, "float32")
        assert got.first_token == want.first_token
        assert got.k.shape == (2, len(prompt), 2, 32)  # [L, true length, Hkv, D]: never padding
        np.testing.assert_allclose(got.k, want.k, atol=1e-5)
        np.testing.assert_allclose(got.v, want.v, atol=1e-5)
    assert engine.queued_tokens == 0


async def test_kv_comes_in_the_wire_dtype(tiny_model):
    engine = _engine(tiny_model("llama"))
    result = await engine.submit([5, 6, 7], GREEDY, 0, "bfloat16")
    assert str(result.k.dtype) == "bfloat16" and result.k.shape == (2, 3, 2, 32)


async def test_cancelled_prompt_is_dropped(tiny_model):
    engine = _engine(tiny_model("llama"), max_batch_size=1)
    first = asyncio.ensure_future(engine.submit([1, 2, 3], GREEDY, 0, "float32"))
    doomed = asyncio.ensure_future(engine.submit([4, 5, 6], GREEDY, 0, "float32"))
    await asyncio.sleep(0)
    doomed.cancel()
    await first
    for _ in range(50):
        if engine.queued_tokens == 0:
            break
        await asyncio.sleep(0.02)
    assert engine.queued_tokens == 0


def _scripted_slow(engine: PrefillEngine, order: list[int], seconds: float = 0.05) -> None:
    """The model replaced by a scripted slow one: it records which prompts ran, in what order."""

    def run(batch, loop):
        time.sleep(seconds)
        order.extend(len(j.token_ids) for j in batch)
        for job in batch:
            kv = np.zeros((2, len(job.token_ids), 2, 32), np.float32)
            loop.call_soon_threadsafe(job.first_token.set_result, 7)
            loop.call_soon_threadsafe(job.kv.put_nowait, KvTensors(0, 0, kv, kv))
            loop.call_soon_threadsafe(job.kv.put_nowait, None)

    engine._run = run  # type: ignore[method-assign]


@pytest.mark.parametrize("order, want", [
    ("shortest-first", [100, 5, 200, 201, 202]),
    ("fifo", [100, 200, 201, 202, 5]),
])
async def test_a_short_prompt_behind_three_long_ones_is_served_first(tiny_model, order, want):
    engine = _engine(tiny_model("llama"), prefill_order=order, max_batch_tokens=256)  # one long prompt a batch
    ran: list[int] = []
    _scripted_slow(engine, ran, seconds=0.3)
    running = asyncio.ensure_future(engine.submit(list(range(100)), GREEDY, 0, "float32"))
    for _ in range(1000):
        if not len(engine.scheduler):
            break  # the first prompt is running: the others queue behind it
        await asyncio.sleep(0.001)
    longs = [asyncio.ensure_future(engine.submit(list(range(n)), GREEDY, 0, "float32")) for n in (200, 201, 202)]
    await asyncio.sleep(0)
    short = asyncio.ensure_future(engine.submit(list(range(5)), GREEDY, 0, "float32"))
    await asyncio.sleep(0)
    queued = {b.max_tokens: (b.queued_tokens, b.queued_prompts) for b in engine.load() if b.queued_prompts}
    assert queued == {16: (5, 1), 128: (100, 1), 256: (603, 3)}  # the running prompt counts until it is done
    await asyncio.gather(running, short, *longs)
    assert ran == want
    assert engine.queued_tokens == 0
    # Only the bucket that ran a shape twice has a rate: a shape's first batch compiles, so is not timed.
    assert [b.max_tokens for b in engine.load() if b.tokens_per_second > 0] == [256]


async def test_every_prompt_of_a_mixed_load_is_served(tiny_model):
    engine = _engine(tiny_model("llama"), max_batch_tokens=512)
    ran: list[int] = []
    _scripted_slow(engine, ran, seconds=0.002)
    lengths = [5, 300, 17, 250, 3, 3, 64, 500, 9, 129] * 4
    results = await asyncio.gather(*(engine.submit(list(range(n)), GREEDY, 0, "float32") for n in lengths))
    assert [r.k.shape[1] for r in results] == lengths
    assert sorted(ran) == sorted(lengths) and engine.queued_tokens == 0
    assert [(b.max_tokens, b.queued_tokens) for b in engine.load()] == [(n, 0) for n in (16, 32, 64, 128, 256, 512)]
