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


def _scripted_slow(engine: PrefillEngine, order: list[list[tuple[int, int, int]]], seconds: float = 0.05) -> None:
    """The model replaced by a scripted slow one: it records each step's segments (prompt length,
    start, end) in order."""

    def run(step, shape, loop):
        time.sleep(seconds)
        order.append([(s.job.num_tokens, s.start, s.end) for s in step])
        for s in step:
            kv = np.zeros((2, s.length, 2, 32), np.float32)
            loop.call_soon_threadsafe(s.job.kv.put_nowait, KvTensors(0, s.start, kv, kv))
            s.job.computed = s.end
            if s.last:
                loop.call_soon_threadsafe(s.job.first_token.set_result, 7)
                loop.call_soon_threadsafe(s.job.kv.put_nowait, None)

    engine._run = run  # type: ignore[method-assign]


@pytest.mark.parametrize("order, want", [
    # the short prompt takes the front of the first step after the running one; chunks fill the rest
    ("shortest-first", [[(100, 0, 100)], [(5, 0, 5), (200, 0, 200), (201, 0, 32)], [(201, 32, 201), (202, 0, 80)],
                        [(202, 80, 202)]]),
    ("fifo", [[(100, 0, 100)], [(200, 0, 200), (201, 0, 48)], [(201, 48, 201), (202, 0, 96)],
              [(202, 96, 202), (5, 0, 5)]]),
])
async def test_a_short_prompt_behind_three_long_ones_is_served_first(tiny_model, order, want):
    engine = _engine(tiny_model("llama"), prefill_order=order, max_batch_tokens=256)
    ran: list[list[tuple[int, int, int]]] = []
    _scripted_slow(engine, ran, seconds=0.3)
    running = asyncio.ensure_future(engine.submit(list(range(100)), GREEDY, 0, "float32"))
    await asyncio.sleep(0)  # queued
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
    await _idle(engine)
    # A shape's first step compiles, so is not timed: every step here had a new (tokens, context) shape.
    assert [b.max_tokens for b in engine.load() if b.tokens_per_second > 0] == []


async def test_every_prompt_of_a_mixed_load_is_served(tiny_model):
    engine = _engine(tiny_model("llama"), max_batch_tokens=512)
    ran: list[list[tuple[int, int, int]]] = []
    _scripted_slow(engine, ran, seconds=0.002)
    lengths = [5, 300, 17, 250, 3, 3, 64, 500, 9, 129] * 4
    results = await asyncio.gather(*(engine.submit(list(range(n)), GREEDY, 0, "float32") for n in lengths))
    assert [r.k.shape[1] for r in results] == lengths
    assert sorted(end for step in ran for (n, _, end) in step if end == n) == sorted(lengths)
    await _idle(engine)
    assert [(b.max_tokens, b.queued_tokens) for b in engine.load()] == [(n, 0) for n in (16, 32, 64, 128, 256, 512)]


async def test_chunked_packed_and_prefix_reused_prefills_equal_one_prompt_alone(tiny_model):
    """Chunks of 16 and 64 tokens, prompts packed with others, a prompt whose prefix is cached: the same
    first token and KV (float32 and int8 on the wire) as each prompt alone in one pass."""
    path = tiny_model("qwen3")
    alone = _engine(path, max_batch_size=1, prefix_cache_bytes=0)
    prompts = [[(7 * i + 3) % 500 for i in range(n)] for n in (150, 40, 9, 97)]
    prompts.append(prompts[0][:128] + [11, 12, 13])  # shares 128 tokens (8 blocks) with the first
    want = {fmt: [await alone.submit(p, GREEDY, 0, fmt) for p in prompts] for fmt in ("float32", "int8")}
    for chunk in (16, 64):
        engine = _engine(path, max_prefill_chunk=chunk, max_batch_tokens=128)
        for fmt in ("float32", "int8"):
            got = await asyncio.gather(*(engine.submit(p, GREEDY, 0, fmt) for p in prompts[:4]))
            got.append(await engine.submit(prompts[4], GREEDY, 0, fmt))  # after the first is cached
            for p, g, w in zip(prompts, got, want[fmt], strict=True):
                assert g.first_token == w.first_token, (chunk, fmt, len(p))
                assert g.k.shape == w.k.shape == (2, len(p), 2, 32)
                if fmt == "int8":  # the same blocks' scales, so the same integers but for rounding ties
                    np.testing.assert_allclose(g.k_scales, w.k_scales, rtol=1e-5)
                    assert np.abs(g.k.astype(np.int32) - w.k.astype(np.int32)).max() <= 1
                else:
                    np.testing.assert_allclose(g.k, w.k, atol=1e-5)
                    np.testing.assert_allclose(g.v, w.v, atol=1e-5)
        assert engine.prefix.hits >= 2 * 128  # the shared prefix came from the cache, once per format
        await _idle(engine)
        assert 0 < engine.padding_share < 1


async def _idle(engine: PrefillEngine) -> None:
    """Waits for the loop to take back its last step (a job's result can arrive just before)."""
    for _ in range(100):
        if engine.queued_tokens == 0:
            return
        await asyncio.sleep(0.01)
    assert engine.queued_tokens == 0


async def test_prompt_logprobs_survive_chunking(tiny_model):
    path = tiny_model("llama")
    sampling = gen_pb.SamplingParams(max_tokens=1, temperature=0.0, top_p=1.0, prompt_logprobs=2, logprobs=1)
    prompt = [(5 * i + 1) % 300 for i in range(70)]
    whole = await _engine(path).submit(prompt, sampling, 0, "float32")
    chunked = await _engine(path, max_prefill_chunk=16).submit(prompt, sampling, 0, "float32")
    assert chunked.first_token == whole.first_token
    assert len(chunked.prompt_logprobs) == len(whole.prompt_logprobs) == 69
    for a, b in zip(chunked.prompt_logprobs, whole.prompt_logprobs, strict=True):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
        assert list(a.top_token_ids) == list(b.top_token_ids)


async def test_prompt_logprobs_are_ready_with_the_first_token(tiny_model):
    """The service answers as soon as the first token resolves: the prompt's logprobs must be set by then."""
    path = tiny_model("llama")
    engine = _engine(path, max_prefill_chunk=16)
    sampling = gen_pb.SamplingParams(max_tokens=1, temperature=0.0, top_p=1.0, prompt_logprobs=1)
    prompt = [(7 * i + 2) % 300 for i in range(40)]
    job = engine.enqueue(prompt, sampling, 0, "float32")
    await job.first_token
    assert [e.token_id for e in job.prompt_logprobs] == prompt[1:]
