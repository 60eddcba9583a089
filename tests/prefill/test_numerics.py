"""bf16 matmuls accumulate in fp32, and the first token is answered before any KV is handed over."""

from __future__ import annotations

import asyncio

import jax
import jax.extend
import jax.numpy as jnp

from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.server.model.config import load_config
from pdserve.server.model.weights import load_weights
from pdserve.server.prefill import engine as engine_module
from pdserve.server.prefill.config import PrefillConfig
from pdserve.server.prefill.engine import PrefillEngine
from pdserve.server.prefill.model import Packing, embed, head, layer_group, load_params


def _dots(jaxpr) -> list:
    """Every dot_general equation, in nested jaxprs (scan bodies) too."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append(eqn)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += _dots(sub)
    return found


def test_every_bf16_matmul_accumulates_in_fp32(tiny_model):
    path = tiny_model("qwen3")
    config = load_config(path)
    params = load_params(config, load_weights(path), dtype="bfloat16")
    tokens = jnp.zeros((2, 16), jnp.int32)

    def forward(params, tokens):
        packing = Packing.plain(*tokens.shape)
        x, cos, sin = embed(params, tokens, packing.positions, config=config)
        context = jnp.zeros((config.num_layers, 2, 0, config.num_kv_heads, config.head_dim), jnp.bfloat16)
        x, k, v = layer_group(params["layers"], x, cos, sin, packing, context, context, config=config)
        return head(params, x, jnp.array([3, 16]), config=config), k, v

    dots = _dots(jax.make_jaxpr(forward)(params, tokens).jaxpr)
    assert len(dots) >= 9  # q, k, v, scores, probs x v, o, gate, up, down (and the lm_head)
    assert {str(e.invars[0].aval.dtype) for e in dots} == {"bfloat16"}
    assert {str(e.params["preferred_element_type"]) for e in dots} == {"float32"}


async def test_the_first_token_is_answered_before_any_kv(tiny_model, monkeypatch):
    path = tiny_model("llama")
    config = load_config(path)
    engine = PrefillEngine(config, load_params(config, load_weights(path)),
                           PrefillConfig(model_dir=path, kv_layer_groups=2))
    order: list[tuple[int, str]] = []
    resolve = engine_module._resolve

    def logged_resolve(future, value):
        order.append((jobs.index(next(j for j in jobs if j.first_token is future)), "first"))
        resolve(future, value)

    class LoggedQueue(asyncio.Queue):
        def __init__(self, i: int):
            super().__init__()
            self.i = i

        def put_nowait(self, item):
            order.append((self.i, "kv" if item is not None else "end"))
            super().put_nowait(item)

    monkeypatch.setattr(engine_module, "_resolve", logged_resolve)
    greedy = gen_pb.SamplingParams(max_tokens=2, temperature=0.0)
    jobs = [engine.enqueue(list(range(3, 3 + n)), greedy, 0, "bfloat16") for n in (5, 12)]  # one batch
    for i, job in enumerate(jobs):
        job.kv = LoggedQueue(i)
    for job in jobs:
        await job.first_token
        while await job.kv.get() is not None:
            pass
    assert order == [(0, "first"), (1, "first"), (0, "kv"), (1, "kv"), (0, "kv"), (1, "kv"), (0, "end"), (1, "end")]
    assert all(job.first_token.result() >= 0 for job in jobs)
