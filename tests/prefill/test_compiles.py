"""After `warmup`, a load of mixed prompt lengths and sampling options (structured output's first-token
masks among them) compiles nothing, packed, chunked or from a cached prefix.

Compilations are counted from JAX's own monitoring events: every jit cache miss traces a jaxpr
(`/jax/core/compile/jaxpr_trace_duration`) and every XLA compile reports its duration
(`/jax/core/compile/backend_compile_duration`), eager operations included.
"""

from __future__ import annotations

import asyncio

import jax
import jax.monitoring
import numpy as np

from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.server.model.config import load_config
from pdserve.server.model.weights import load_weights
from pdserve.server.prefill.config import PrefillConfig
from pdserve.server.prefill.engine import PrefillEngine
from pdserve.server.prefill.model import load_params
from pdserve.server.structured.grammars import Grammars

COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/backend_compile_duration")
_seen: list[str] = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, duration, **kw: _seen.append(event) if event in COMPILE_EVENTS else None)


def compiles() -> int:
    return len(_seen)


def _sampling(i: int) -> gen_pb.SamplingParams:
    """Greedy, seeded sampling, penalties, min_tokens, logprobs and prompt logprobs, in turn."""
    options = [
        dict(temperature=0.0),
        dict(temperature=0.8, top_k=5, top_p=0.9, seed=7),
        dict(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2),
        dict(temperature=0.0, min_tokens=3),
        dict(temperature=0.0, logprobs=2),
        dict(temperature=0.0, prompt_logprobs=1),
    ]
    return gen_pb.SamplingParams(max_tokens=4, **options[i % len(options)])


async def test_a_mixed_load_compiles_nothing_after_warmup(tiny_model):
    path = tiny_model("qwen2")
    model_config = load_config(path)
    config = PrefillConfig(model_dir=path, max_batch_size=4, max_model_len=128)
    params = load_params(model_config, load_weights(path))
    engine = PrefillEngine(model_config, params, config)
    shapes = engine.shapes()
    # (token slots, context slots): up to 4 prompts of 128 tokens packed; a context of up to 128 tokens
    assert [(s.tokens, s.context) for s in shapes] == [(t, c) for c in (0, 128) for t in (16, 32, 64, 128, 256, 512)]
    engine.warmup()

    grammars = Grammars.for_model(path, model_config.vocab_size, tuple(model_config.eos_token_ids))
    spec = gen_pb.StructuredOutput(json_object=True)
    grammars.compiled(spec)
    before = compiles()
    rng = np.random.default_rng(0)
    lengths = [1, 5, 16, 17, 31, 40, 63, 64, 65, 100, 128, 3, 90, 22, 8, 127]
    wire = ["float32", "bfloat16"]
    for wave in range(2):  # concurrent prompts of mixed lengths: batches of 1, 2 and 4 rows
        results = await asyncio.gather(*(
            engine.submit(rng.integers(3, 500, n).tolist(), _sampling(i + wave), 0, wire[i % 2],
                          constraint=grammars.constraint(spec) if i % 3 == wave else None)
            for i, n in enumerate(lengths)))
        assert [r.k.shape[1] for r in results] == lengths
    alone = [await engine.submit(list(range(3, 3 + n)), _sampling(0), 0, "float32") for n in (2, 33, 128)]
    assert [r.k.shape[1] for r in alone] == [2, 33, 128]
    assert engine.prefix.hits == 32  # the 128-token prompt reused the 33-token one's two full blocks
    assert compiles() == before, f"{compiles() - before} compilations on the request path"
    assert engine.batches < 3 + 2 * len(lengths)  # prompts shared steps

    chunked = PrefillEngine(model_config, params, PrefillConfig(model_dir=path, max_batch_size=4, max_model_len=128,
                                                                       max_prefill_chunk=32, max_batch_tokens=64))
    chunked.warmup()
    before_chunked = compiles()
    results = await asyncio.gather(*(chunked.submit(rng.integers(3, 500, n).tolist(), _sampling(i), 0, "float32")
                                     for i, n in enumerate(lengths)))
    assert [r.k.shape[1] for r in results] == lengths
    assert compiles() == before_chunked, f"{compiles() - before_chunked} compilations on the chunked request path"
    before = compiles()

    jax.jit(lambda x: x * 3)(np.zeros(7, np.float32))  # the counter counts: a new program compiles
    assert compiles() > before
