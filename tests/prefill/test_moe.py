"""Mixture-of-experts models on the prefill tier against transformers (Mixtral: top 2 of 8 renormalised;
Qwen3-MoE: top 2 of 8 as the softmax gave them), and the grouped routing against a per-expert loop."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from pdserve.server.model.config import MoeConfig, load_config
from pdserve.server.model.weights import load_weights
from pdserve.server.prefill.model import forward_logits, load_params
from pdserve.server.prefill.moe import moe_mlp, route

TOL = 1e-4


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def moe_model(request, tiny_model):
    path = tiny_model(request.param)
    config = load_config(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return config, load_params(config, load_weights(path)), hf


@pytest.mark.parametrize("n", [1, 13, 70])
def test_logits_match_transformers(moe_model, n):
    config, params, hf = moe_model
    assert config.moe is not None and config.moe.num_experts == 8 and config.moe.top_k == 2
    ids = np.random.default_rng(n).integers(0, config.vocab_size, n, dtype=np.int32)
    got = np.asarray(forward_logits(params, jnp.asarray(ids[None]), config=config))[0]
    with torch.no_grad():
        want = hf(torch.tensor(ids[None], dtype=torch.long)).logits[0].numpy()
    assert np.abs(got - want).max() < TOL


@pytest.mark.parametrize("renormalize", [True, False])
def test_grouped_experts_equal_a_loop_over_experts(renormalize):
    """Every token's top-k experts by hand, one expert at a time, against the sorted grouped matmuls."""
    moe = MoeConfig(num_experts=5, top_k=2, intermediate_size=12, renormalize=renormalize)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 7, 16), dtype=np.float32)
    router = rng.standard_normal((16, 5), dtype=np.float32)
    gate, up = (rng.standard_normal((5, 16, 12), dtype=np.float32) for _ in range(2))
    down = rng.standard_normal((5, 12, 16), dtype=np.float32)
    got = np.asarray(moe_mlp(jnp.asarray(x), router, gate, up, down, moe, jax.nn.silu))
    flat = x.reshape(-1, 16)
    probs = np.exp(flat @ router) / np.exp(flat @ router).sum(-1, keepdims=True)
    want = np.zeros_like(flat)
    for t in range(flat.shape[0]):
        top = np.argsort(-probs[t])[:2]
        weights = probs[t, top] / (probs[t, top].sum() if renormalize else 1.0)
        for e, w in zip(top, weights):
            h = flat[t] @ gate[e]
            want[t] += w * ((h / (1 + np.exp(-h))) * (flat[t] @ up[e])) @ down[e]
    np.testing.assert_allclose(got.reshape(-1, 16), want, rtol=1e-4, atol=1e-4)
    weights, experts = route(jnp.asarray(flat @ router), moe)
    assert experts.shape == (21, 2) and np.all(np.asarray(experts)[:, 0] != np.asarray(experts)[:, 1])
