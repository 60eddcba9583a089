"""The prefill engine batches concurrent prompts and gives each exactly what it gives alone."""

from __future__ import annotations

import asyncio

import numpy as np

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
