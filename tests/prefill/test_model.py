"""The JAX prefill model against transformers, for every family: logits, post-RoPE K and V, padding."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from pdserve.server.model.config import load_config
from pdserve.server.model.weights import load_weights
from pdserve.server.prefill.shapes import bucket_length
from pdserve.server.prefill.model import (compute_dtype, forward_logits, load_params, make_prefill_fn,
                                          served_weight_dtype)

TOL = 1e-4


def _prompt(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 512, size=n, dtype=np.int32)  # [n]


def _hf_run(hf, ids: np.ndarray):
    """ids [S] -> (logits [S, V], k, v [L, S, Hkv, D]) from transformers."""
    with torch.no_grad():
        out = hf(torch.tensor(ids[None], dtype=torch.long), use_cache=True)
    layers = out.cache.layers  # transformers 5: `cache` (was `past_key_values`); keys [B, Hkv, S, D]
    k = np.stack([layer.keys[0].transpose(0, 1).float().numpy() for layer in layers])
    v = np.stack([layer.values[0].transpose(0, 1).float().numpy() for layer in layers])
    return out.logits[0].float().numpy(), k, v


@pytest.fixture(scope="module")
def loaded(family_model):
    family, path = family_model
    config = load_config(path)
    params = load_params(config, load_weights(path))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return family, config, params, hf


def test_forward_logits_match_transformers(loaded):
    _, config, params, hf = loaded
    ids = _prompt(11, seed=1)
    want, _, _ = _hf_run(hf, ids)
    got = np.asarray(forward_logits(params, jnp.asarray(ids[None]), config=config))[0]  # [S, V]
    assert got.shape == (11, config.vocab_size)
    assert np.abs(got - want).max() < TOL


def test_prefill_kv_match_transformers_cache(loaded):
    _, config, params, hf = loaded
    ids = _prompt(11, seed=2)
    want_logits, want_k, want_v = _hf_run(hf, ids)
    tokens = np.zeros((1, 16), np.int32)
    tokens[0, :11] = ids
    logits, k, v = make_prefill_fn(config)(params, jnp.asarray(tokens), jnp.array([11], jnp.int32))
    L, hkv, d = config.num_layers, config.num_kv_heads, config.head_dim
    assert logits.shape == (1, config.vocab_size) and logits.dtype == jnp.float32
    assert k.shape == v.shape == (L, 1, 16, hkv, d)
    assert np.abs(np.asarray(logits)[0] - want_logits[-1]).max() < TOL
    assert np.abs(np.asarray(k)[:, 0, :11] - want_k).max() < TOL
    assert np.abs(np.asarray(v)[:, 0, :11] - want_v).max() < TOL


def test_batched_padded_prefill_equals_each_prompt_alone(loaded):
    _, config, params, hf = loaded
    prompts = [_prompt(5, seed=3), _prompt(13, seed=4)]
    s = bucket_length(13, config.max_model_len)
    assert s == 16
    tokens = np.zeros((2, s), np.int32)
    for row, ids in enumerate(prompts):
        tokens[row, : len(ids)] = ids
    lengths = jnp.array([len(p) for p in prompts], jnp.int32)
    logits, k, v = make_prefill_fn(config)(params, jnp.asarray(tokens), lengths)
    for row, ids in enumerate(prompts):
        want_logits, want_k, want_v = _hf_run(hf, ids)
        n = len(ids)
        assert np.abs(np.asarray(logits)[row] - want_logits[-1]).max() < TOL
        assert np.abs(np.asarray(k)[:, row, :n] - want_k).max() < TOL
        assert np.abs(np.asarray(v)[:, row, :n] - want_v).max() < TOL


def test_params_are_stacked_over_layers(loaded):
    family, config, params, _ = loaded
    layers = params["layers"]
    L, h, i = config.num_layers, config.hidden_size, config.intermediate_size
    assert layers["wq"].shape == (L, h, config.num_heads, config.head_dim)
    assert layers["wk"].shape == (L, h, config.num_kv_heads, config.head_dim)
    assert layers["w_down"].shape == (L, i, h)
    assert ("bq" in layers) == (family == "qwen2")
    assert ("q_norm" in layers) == (family == "qwen3")
    assert ("lm_head" in params) == (not config.tie_word_embeddings)


def test_bfloat16_checkpoint_runs_close_to_transformers_bfloat16(tiny_model):
    path = tiny_model("llama", "bfloat16")
    config = load_config(path)
    assert config.dtype == "bfloat16"
    params = load_params(config, load_weights(path), dtype="bfloat16")
    assert params["layers"]["wq"].dtype == jnp.bfloat16 and params["final_norm"].dtype == jnp.float32
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ids = _prompt(11, seed=5)
    want, want_k, _ = _hf_run(hf, ids)
    got = np.asarray(forward_logits(params, jnp.asarray(ids[None]), config=config))[0]
    _, k, _ = make_prefill_fn(config)(params, jnp.asarray(ids[None]), jnp.array([11], jnp.int32))
    assert k.dtype == jnp.bfloat16
    # Measured over 8 prompts: logits max err 0.017-0.021 (|logits| up to ~2.5), K max err 0.012-0.017,
    # argmax equal on 10 or 11 of 11 positions (a random model's top logits lie close together).
    assert np.abs(got - want).max() < 0.05
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.8
    assert np.abs(np.asarray(k, np.float32)[:, 0] - want_k).max() < 0.05


def test_served_weight_dtype_upcasts_bf16_only_for_auto_on_cpu():
    assert served_weight_dtype("auto", "bfloat16", "cpu") == "float32"  # XLA:CPU's fp32 matmul is faster
    assert served_weight_dtype("auto", "bfloat16", "tpu") == "bfloat16"
    assert served_weight_dtype("auto", "bfloat16", "gpu") == "bfloat16"
    assert served_weight_dtype("auto", "float32", "cpu") == "float32"
    assert served_weight_dtype("bfloat16", "bfloat16", "cpu") == "bfloat16"  # asked for: kept
    assert served_weight_dtype("int8", "bfloat16", "cpu") == "int8"


def test_quantized_weights_of_a_bf16_checkpoint_compute_in_fp32_only_on_cpu(tiny_model):
    path = tiny_model("llama", "bfloat16")
    bf16 = load_config(path)
    assert bf16.dtype == "bfloat16"
    for fmt in ("int8", "fp8"):
        assert compute_dtype(bf16, fmt, "cpu") == "float32"  # XLA:CPU's bf16 dot is the slow path
        assert compute_dtype(bf16, fmt, "tpu") == "bfloat16"
        assert compute_dtype(bf16, fmt) == "bfloat16"  # no backend: as on an accelerator
    assert compute_dtype(bf16, "bfloat16", "cpu") == "bfloat16"  # unquantized: the weights' own, as asked
    assert load_params(bf16, load_weights(path), "int8", backend="cpu")["embed"].dtype == jnp.float32
    assert load_params(bf16, load_weights(path), "int8", backend="tpu")["embed"].dtype == jnp.bfloat16


def test_served_bf16_checkpoint_on_cpu_computes_in_fp32_and_sends_bf16_kv(tiny_model):
    """`pdserve prefill --prefill-matmul xla-fp32` (load_engine) on a bf16 checkpoint: fp32 weights equal to the
    bf16 ones (the upcast is exact), the first token of fp32 transformers on those weights, bf16 KV."""
    import asyncio

    from pdserve.v1 import generation_pb2 as gen_pb
    from pdserve.server.prefill.config import PrefillConfig
    from pdserve.server.prefill.main import load_engine

    path = tiny_model("llama", "bfloat16")
    engine = load_engine(PrefillConfig(model_dir=path, max_batch_size=1, max_model_len=64, prefill_matmul="xla-fp32"),
                         progress=False)
    wq = engine.runner.group_layers[0]["wq"]
    assert wq.dtype == jnp.float32
    bf16 = load_params(load_config(path), load_weights(path), dtype="bfloat16")["layers"]["wq"]
    np.testing.assert_array_equal(np.asarray(wq), np.asarray(bf16[: wq.shape[0]], np.float32))
    ids = _prompt(11, seed=5)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        want = int(hf(torch.tensor(ids[None])).logits[0, -1].argmax())
    greedy = gen_pb.SamplingParams(max_tokens=1, temperature=0.0)
    result = asyncio.run(engine.submit(ids.tolist(), greedy, 0, "bfloat16"))
    assert result.first_token == want
    assert str(result.k.dtype) == "bfloat16"


def test_bucket_length():
    assert [bucket_length(n, 512) for n in (1, 16, 17, 100, 256, 300)] == [16, 16, 32, 128, 256, 512]
    assert bucket_length(3, 512, min_bucket=4) == 4
    assert bucket_length(500, 400 + 100) == 500
    with pytest.raises(ValueError):
        bucket_length(0, 512)
    with pytest.raises(ValueError):
        bucket_length(513, 512)
