"""Quantized KV in the decode tier's paged cache, and weight-only quantized linear layers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdserve.kvcache.layout import KvLayout
from pdserve.kvcache.quant import QMAX, dequantize, error_bound, quantize
from pdserve.server import hardware
from pdserve.server.decode.kv_cache import PagedKvCache

L, HKV, D, BS = 2, 2, 8, 4


def layout(dtype: str) -> KvLayout:
    return KvLayout(L, HKV, D, BS, dtype, "block_head")


def kv(tokens: int, seed: int = 0, scale: float = 1.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((L, tokens, HKV, D)) * scale).astype(np.float32)


@pytest.mark.parametrize("dtype", ["int8", "fp8_e4m3"])
def test_write_keeps_the_wire_bytes_and_scales_as_they_came(dtype):
    cache = PagedKvCache(layout(dtype), num_blocks=8)
    table = [5, 2, 7]
    x = kv(10)
    (k, ks), (v, vs) = quantize(x, BS, dtype), quantize(-2 * x, BS, dtype)
    cache.write(table, 0, 0, k[:, :8], v[:, :8], ks[:, :2], vs[:, :2])  # two pieces, the second partial
    cache.write(table, 0, 8, k[:, 8:], v[:, 8:], ks[:, 2:], vs[:, 2:])
    k_read, v_read = cache.read(table, 10)
    assert k_read.dtype == cache.dtype == {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}[dtype]
    assert k_read.view(torch.int8).numpy().tobytes() == k.tobytes()
    assert v_read.view(torch.int8).numpy().tobytes() == v.tobytes()
    k_scales, v_scales = cache.read_scales(table, 10)
    assert k_scales.numpy().tobytes() == ks.tobytes() and v_scales.numpy().tobytes() == vs.tobytes()
    assert cache.k_scales[:, [0, 1, 3, 4, 6]].count_nonzero() == 0  # other blocks untouched
    # gather dequantizes exactly as the numpy reference does
    k_all, v_all = cache.gather(1, torch.tensor([table]))
    np.testing.assert_array_equal(k_all[0, :10].numpy(), dequantize(k, ks, BS)[1])
    np.testing.assert_array_equal(v_all[0, :10].numpy(), dequantize(v, vs, BS)[1])


def test_write_refuses_missing_or_misshapen_scales():
    cache = PagedKvCache(layout("int8"), num_blocks=4)
    k, ks = quantize(kv(6), BS, "int8")
    with pytest.raises(ValueError, match=r"int8 KV needs k_scales float32 \(2, 2, 2\), got nothing"):
        cache.write([0, 1], 0, 0, k, k)
    with pytest.raises(ValueError, match=r"needs v_scales float32 \(2, 2, 2\), got float32 \(2, 1, 2\)"):
        cache.write([0, 1], 0, 0, k, k, ks, ks[:, :1])
    plain = PagedKvCache(KvLayout(L, HKV, D, BS, "float32"), num_blocks=4)
    with pytest.raises(ValueError, match="float32 KV takes no scales"):
        plain.write([0, 1], 0, 0, kv(6), kv(6), ks, ks)


@pytest.mark.parametrize("dtype", ["int8", "fp8_e4m3"])
def test_store_quantizes_like_the_reference(dtype):
    cache = PagedKvCache(layout(dtype), num_blocks=6)
    table = [4, 1, 3]
    x = kv(11, seed=2)
    slots = torch.tensor([table[t // BS] * BS + t % BS for t in range(11)])
    for layer in range(L):
        cache.store(layer, slots, torch.from_numpy(x[layer]), torch.from_numpy(x[layer] * 3))
    q, scales = quantize(x, BS, dtype)
    k_scales, v_scales = cache.read_scales(table, 11)
    np.testing.assert_array_equal(k_scales.numpy(), scales)
    np.testing.assert_allclose(v_scales.numpy(), scales * 3, rtol=1e-6)
    assert cache.read(table, 11)[0].view(torch.int8).numpy().tobytes() == q.tobytes()


@pytest.mark.parametrize("dtype", ["int8", "fp8_e4m3"])
def test_decode_tokens_appended_to_a_received_block_grow_its_scale(dtype):
    """Prefill sends 6 tokens (block 2 holds 2); decode stores tokens 6 and 7, the second out of range."""
    cache = PagedKvCache(layout(dtype), num_blocks=4)
    table = [3, 0]
    x = kv(8, seed=4)
    x[:, 7] *= 10.0  # token 7 exceeds the range of block 1's first three tokens
    (k, ks), (v, vs) = quantize(x[:, :6], BS, dtype), quantize(x[:, :6], BS, dtype)
    cache.write(table, 0, 0, k, v, ks, vs)
    received = cache.read(table, 8)[0].clone()
    for t in (6, 7):
        slot = torch.tensor([table[t // BS] * BS + t % BS])
        for layer in range(L):
            step = torch.from_numpy(x[layer, t : t + 1])
            cache.store(layer, slot, step, step)
    k_scales, _ = cache.read_scales(table, 8)
    expected = np.abs(x[:, 4:8]).max(axis=(1, 3)) / QMAX[dtype]  # block 1 now spans tokens 4..7
    np.testing.assert_allclose(k_scales[:, 1].numpy(), expected, rtol=1e-6)
    assert np.array_equal(k_scales[:, 0].numpy(), ks[:, 0])  # the full received block is untouched
    stored = cache.read(table, 8)[0]
    assert torch.equal(stored[:, :4].view(torch.int8), received[:, :4].view(torch.int8))
    k_all, _ = cache.gather(0, torch.tensor([table]))  # [1, 8, Hkv, D]
    got = k_all[0].numpy()[None]  # [1, 8, Hkv, D] of layer 0
    bound = error_bound(x[:1], k_scales[:1].numpy(), BS, dtype) * 2  # re-expressed once: two roundings
    assert np.all(np.abs(got - x[:1]) <= bound)


def test_a_reused_block_forgets_its_old_scale():
    cache = PagedKvCache(layout("int8"), num_blocks=2)
    big = torch.full((1, HKV, D), 100.0)
    small = torch.full((1, HKV, D), 0.5)
    cache.store(0, torch.tensor([4]), big, big)  # block 1, offset 0
    cache.store(0, torch.tensor([4]), small, small)  # freed and reused: starts again at offset 0
    assert cache.k_scales[0, 1].tolist() == [np.float32(0.5) / np.float32(127)] * HKV
    assert cache.gather(0, torch.tensor([[1]]))[0][0, 0].tolist() == [[0.5] * D] * HKV


def test_kv_capacity_doubles_with_fp8_and_int8_for_a_fixed_budget():
    """Qwen2.5-0.5B's KV shape (24 layers, 2 kv heads, head dim 64), blocks of 16, a 1 GiB budget."""
    per_block, tokens = {}, {}
    for dtype in ("float32", "bfloat16", "fp8_e4m3", "int8"):
        lay = KvLayout.of(24, 2, 64, 16, dtype)
        per_block[dtype] = PagedKvCache.bytes_per_block(lay)
        tokens[dtype] = PagedKvCache.num_blocks_for_budget(lay, 2**30) * 16
    # scales: 4 bytes x (k, v) x 24 layers x 2 heads = 384 bytes a block (24 a token at bs 16)
    assert per_block == {"float32": 393216, "bfloat16": 196608, "fp8_e4m3": 98304 + 384, "int8": 98304 + 384}
    assert tokens == {"float32": 43680, "bfloat16": 87376, "fp8_e4m3": 174080, "int8": 174080}
    assert tokens["int8"] / tokens["bfloat16"] == pytest.approx(1.992, abs=1e-3)  # 2x less the scales
    cache = PagedKvCache(KvLayout(24, 2, 64, 16, "int8", "block_head"), num_blocks=3)
    assert cache.nbytes == 3 * per_block["int8"]


# ---- the decode model with quantized weights and a quantized cache -----------------------------------

from pdserve.server.decode.model import DecoderModel  # noqa: E402
from pdserve.server.decode.quant import Linear, buffer_bytes, quantize_weight  # noqa: E402
from pdserve.server.decode.weights import build_model  # noqa: E402
from pdserve.server.model.config import load_config  # noqa: E402
from pdserve.server.model.weights import load_weights  # noqa: E402


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_weight_quantization_per_output_channel(fmt):
    w = torch.randn(6, 40, generator=torch.Generator().manual_seed(0))
    w[2] *= 30
    q, scale = quantize_weight(w, fmt)
    assert q.dtype == {"int8": torch.int8, "fp8": torch.float8_e4m3fn}[fmt] and scale.shape == (6, 1)
    assert torch.equal(scale, w.abs().amax(1, keepdim=True) / {"int8": 127, "fp8": 448}[fmt])
    err = (q.float() * scale - w).abs()
    bound = scale / 2 if fmt == "int8" else torch.maximum(w.abs() * 2**-4, scale * 2**-10)
    assert bool((err <= bound * (1 + 1e-6)).all())
    linear = Linear(40, 6, True, torch.float32)
    linear.weight.copy_(w)
    linear.bias.fill_(1)
    linear.quantize_(fmt)
    x = torch.randn(3, 40)
    assert torch.allclose(linear(x), x @ (q.float() * scale).T + 1)


@pytest.fixture(scope="module")
def llama(tiny_model):
    path = tiny_model("llama")
    return load_config(path), load_weights(path)


def _prefill_logits(model: DecoderModel, kv_dtype: str) -> torch.Tensor:
    c = model.config
    cache = PagedKvCache(KvLayout.of(c.num_layers, c.num_kv_heads, c.head_dim, 4, kv_dtype), 8)
    prompt = torch.arange(3, 22)  # 19 tokens: the model stores and reads them through the cache
    return model.prefill(prompt, [6, 1, 3, 0, 7], cache)  # [19, V]


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_quantized_weights_hold_less_memory_and_keep_logits_close(llama, fmt):
    config, weights = llama
    full = build_model(config, weights)
    quant = build_model(config, weights, torch.float32, weight_format=fmt)
    # 2 layers x (qkv 256x128 + o 128x128 + gate_up 512x128 + down 128x256) = 294912 weights: 4 -> 1 byte,
    # plus one float32 scale per output row: 2 x (256 + 128 + 512 + 128) = 2048
    assert buffer_bytes(full) - buffer_bytes(quant) == 294912 * 3 - 2048 * 4
    ref, got = _prefill_logits(full, "float32"), _prefill_logits(quant, "float32")
    assert ((got - ref).abs().max() / ref.abs().max()).item() < {"int8": 0.05, "fp8": 0.15}[fmt]


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
def test_quantized_cache_keeps_logits_close(llama, kv_dtype):
    model = build_model(*llama)
    ref, got = _prefill_logits(model, "float32"), _prefill_logits(model, kv_dtype)
    assert ((got - ref).abs().max() / ref.abs().max()).item() < {"int8": 0.02, "fp8_e4m3": 0.1}[kv_dtype]


def _linear(w: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, fmt: str | None = None) -> Linear:
    linear = Linear.of(w, bias, dtype)
    if fmt is not None:
        linear.quantize_(fmt)
    return linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [64, 40])  # the int8 kernel; a width it cannot take (dequantizes)
def test_int8_weights_run_the_int8_kernel_like_the_dequantized_matmul(dtype, width):
    """On CPU the int8 layer never dequantizes its weight; it computes what dequantize-then-matmul does."""
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(24, width, generator=g), torch.randn(2, 3, width, generator=g).to(dtype)
    linear = _linear(w, torch.ones(24), dtype, "int8")
    reference = (x.double() @ (linear.weight.double() * linear.scale.double()).T + 1)  # [2, 3, 24]
    got = linear(x)
    assert got.dtype == dtype and got.shape == (2, 3, 24)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2**-7}[dtype] * reference.abs().max().item()
    assert (got.double() - reference).abs().max().item() <= tol


ONEDNN_BF16 = pytest.mark.skipif(
    not hardware.torch_probe().onednn_bf16,
    reason=f"oneDNN cannot run bf16 linears on this CPU ({hardware.cpu().describe()}): it needs AVX-512 BW/VL/DQ or "
           f"AVX-NE-convert; tests/decode/test_cpu_matmul.py checks the fallback chosen here instead")


@ONEDNN_BF16
def test_prepacked_bf16_linear_computes_what_the_plain_one_does():
    g = torch.Generator().manual_seed(4)
    w, bias = torch.randn(48, 64, generator=g), torch.randn(48, generator=g)
    plain = _linear(w, bias, torch.bfloat16)
    packed = _linear(w, bias, torch.bfloat16)
    packed.prepack()
    assert packed.packed and not plain.packed
    for rows in (1, 4, 16):
        x = torch.randn(rows, 1, 64, generator=g).to(torch.bfloat16)
        torch.testing.assert_close(packed(x), plain(x), rtol=2**-7, atol=2**-7 * 8)
    with pytest.raises(ValueError, match="read it through forward"):
        packed.dequantized()
    fp32 = _linear(w, None, torch.float32)
    fp32.prepack()  # float32 keeps torch's default linear, the one transformers runs
    assert not fp32.packed


@ONEDNN_BF16
def test_a_prepacked_bf16_model_decodes_the_same_tokens(tiny_model):
    path = tiny_model("llama", "bfloat16")
    config, weights = load_config(path), load_weights(path)
    plain, packed = (build_model(config, weights, dtype=torch.bfloat16) for _ in range(2))
    packed.prepack()
    assert packed.packed_head is not None
    tokens = []
    for model in (plain, packed):
        logits = _prefill_logits(model, "bfloat16")  # [19, V]
        tokens.append(logits.argmax(-1).tolist())
    assert tokens[0] == tokens[1]
