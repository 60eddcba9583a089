"""Prefill tier quantization: int8/fp8 weights at load, and the KV quantized on the device for the wire."""

from __future__ import annotations

import asyncio

import jax.numpy as jnp
import numpy as np
import pytest

from pdserve.kvcache.quant import dequantize as kv_dequantize
from pdserve.kvcache.quant import error_bound, quantize
from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.server.model.config import load_config
from pdserve.server.model.weights import load_weights
from pdserve.server.prefill.config import PrefillConfig
from pdserve.server.prefill.engine import PrefillEngine
from pdserve.server.prefill.model import forward_logits, load_params
from pdserve.server.prefill.quant import param_bytes, quantize_kv, quantize_weight

GREEDY = gen_pb.SamplingParams(max_tokens=4, temperature=0.0, top_p=1.0, top_k=0)


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
def test_device_kv_quantization_matches_the_reference_over_true_lengths(fmt):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 2, 16, 2, 8)).astype(np.float32)  # [L, B, S, Hkv, D], bucket 16
    x[:, 0, 11:] = 1e3  # padding garbage after row 0's length 11 must not widen its last block's scale
    lengths = np.array([11, 16], np.int32)
    q, scales = quantize_kv(jnp.asarray(x), jnp.asarray(lengths), block_size=4, fmt=fmt)
    assert q.shape == (3, 2, 16, 2, 8) and scales.shape == (3, 2, 4, 2)
    for row, n in enumerate(lengths):
        want_q, want_scales = quantize(x[:, row, :n], 4, fmt)
        got_scales = np.asarray(scales)[:, row, : -(-n // 4)]
        # XLA divides by qmax as a multiply by 1/qmax: the scales agree to 1 ulp, not always bit for bit
        np.testing.assert_allclose(got_scales, want_scales, rtol=2.5e-7, atol=0)
        got = kv_dequantize(np.asarray(q)[:, row, :n], got_scales, 4)
        assert np.all(np.abs(got - x[:, row, :n]) <= error_bound(x[:, row, :n], got_scales, 4, fmt))
        assert np.mean(np.asarray(q)[:, row, :n].view(np.int8) == want_q.view(np.int8)) > 0.99


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
def test_device_kv_quantization_pads_the_bucket_to_whole_blocks(fmt):
    x = np.linspace(-2, 2, 1 * 1 * 16 * 1 * 4, dtype=np.float32).reshape(1, 1, 16, 1, 4)
    q, scales = quantize_kv(jnp.asarray(x), jnp.asarray([10]), block_size=32, fmt=fmt)  # one block > bucket
    assert q.shape == (1, 1, 32, 1, 4) and scales.shape == (1, 1, 1, 1)
    assert float(scales[0, 0, 0, 0]) == pytest.approx(float(np.abs(x[0, 0, :10]).max()) / {"int8": 127, "fp8_e4m3": 448}[fmt])


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_weight_quantization_is_per_output_channel_within_bound(fmt):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((2, 64, 4, 8)).astype(np.float32)  # [L, H, Hq, D]: contracts H
    w[:, :, 1] *= 50.0  # one head's outputs much larger: its own scales
    q, scale = quantize_weight(w, (1,), fmt)
    assert scale.shape == (2, 1, 4, 8) and scale.dtype == np.float32
    np.testing.assert_array_equal(scale, np.abs(w).max(axis=1, keepdims=True) / {"int8": 127, "fp8": 448}[fmt])
    err = np.abs(q.astype(np.float32) * scale - w)
    if fmt == "int8":
        assert np.all(err <= scale / 2 * (1 + 1e-6))
    else:
        assert np.all(err <= np.maximum(np.abs(w) * 2**-4, scale * 2**-10) * (1 + 1e-6))


@pytest.fixture(scope="module")
def qwen2(tiny_model):
    path = tiny_model("qwen2")
    return path, load_config(path), load_weights(path)


TOKENS = jnp.asarray([list(range(1, 25))])


@pytest.fixture(scope="module")
def fp32_logits(qwen2):
    _, config, weights = qwen2
    return np.asarray(forward_logits(load_params(config, weights, "float32"), TOKENS, config=config))[0]  # [S, V]


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_quantized_weights_hold_less_memory_and_keep_the_logits_close(qwen2, fp32_logits, fmt):
    _, config, weights = qwen2
    full = load_params(config, weights, "float32")
    quant = load_params(config, weights, fmt)
    layers = quant["layers"]
    assert str(layers["wq"].dtype) == {"int8": "int8", "fp8": "float8_e4m3fn"}[fmt]
    assert layers["wq_scale"].shape == (2, 1, 4, 32) and layers["wo_scale"].shape == (2, 1, 1, 128)
    assert str(layers["attn_norm"].dtype) == "float32" and str(quant["embed"].dtype) == "float32"
    # matmul weights: 2 layers x (q 128x128 + k, v 2x 128x64 + o 128x128 + mlp 3x 128x256) = 327680 values
    matmul_values = 2 * (128 * 128 * 2 + 128 * 64 * 2 + 3 * 128 * 256)
    scale_values = 2 * (128 + 64 + 64 + 128 + 256 + 256 + 128)
    assert param_bytes(full) - param_bytes(quant) == matmul_values * 3 - scale_values * 4
    got = np.asarray(forward_logits(quant, TOKENS, config=config))[0]  # [S, V]
    rel = np.abs(got - fp32_logits).max() / np.abs(fp32_logits).max()
    assert rel < {"int8": 0.05, "fp8": 0.15}[fmt]  # of the largest logit, on flat random weights


async def test_engine_sends_quantized_kv_and_scales_for_the_true_length(qwen2):
    path, config, weights = qwen2
    engine = PrefillEngine(config, load_params(config, weights), PrefillConfig(model_dir=path))
    prompts = [list(range(3, 3 + n)) for n in (5, 21)]
    plain = await asyncio.gather(*(engine.submit(p, GREEDY, 0, "float32") for p in prompts))
    for dtype in ("int8", "fp8_e4m3"):
        results = await asyncio.gather(*(engine.submit(p, GREEDY, 0, dtype, block_size=8) for p in prompts))
        for prompt, got, ref in zip(prompts, results, plain):
            n = len(prompt)
            assert got.first_token == ref.first_token
            assert str(got.k.dtype) == {"int8": "int8", "fp8_e4m3": "float8_e4m3fn"}[dtype]
            assert got.k.shape == (2, n, 2, 32) and got.k_scales.shape == (2, -(-n // 8), 2)
            for q, scales, x in ((got.k, got.k_scales, ref.k), (got.v, got.v_scales, ref.v)):
                _, want_scales = quantize(x, 8, dtype)
                np.testing.assert_allclose(scales, want_scales, rtol=1e-6)
                err = np.abs(kv_dequantize(q, scales, 8) - x)
                assert np.all(err <= error_bound(x, scales, 8, dtype) * 1.01)
    assert plain[0].k_scales is None
