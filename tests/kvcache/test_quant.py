"""Reference KV quantization: round trips within the stated bounds, scales per block per head, wire bytes."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from pdserve.kvcache.layout import KvLayout
from pdserve.kvcache.quant import QMAX, block_scales, dequantize, error_bound, quantize
from pdserve.v1 import worker_pb2 as pb

from .test_receiver import TOKEN, Harness


def kv(shape=(3, 21, 2, 16), seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    x[:, :, 1] *= 40.0  # heads with very different ranges: one scale each
    x[1, 5:9] = 0.0  # layer 1's second block (tokens 4..7) partly zero
    return x


@pytest.mark.parametrize("dtype", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("block_size", [4, 16])
def test_round_trip_within_the_stated_bound(dtype, block_size):
    x = kv()
    q, scales = quantize(x, block_size, dtype)
    assert q.dtype == {"int8": np.int8, "fp8_e4m3": ml_dtypes.float8_e4m3fn}[dtype]
    assert scales.shape == (3, -(-21 // block_size), 2) and scales.dtype == np.float32
    y = dequantize(q, scales, block_size)
    err = np.abs(y - x)
    assert np.all(err <= error_bound(x, scales, block_size, dtype))
    # the bound is tight enough to mean something: relative to each block-head's range
    rel = err.max() / np.abs(x).max()
    assert rel < {"int8": 1 / 254 + 1e-6, "fp8_e4m3": 1 / 16 + 1e-6}[dtype]


@pytest.mark.parametrize("dtype", ["int8", "fp8_e4m3"])
def test_scales_are_absmax_per_block_per_head(dtype):
    x = kv()
    scales = block_scales(x, 4, dtype)  # blocks of tokens 0-3, 4-7, ..., 20 (a partial last block)
    for layer, block, head in [(0, 0, 0), (2, 3, 1), (1, 5, 0)]:
        expected = np.abs(x[layer, block * 4 : block * 4 + 4, head]).max() / QMAX[dtype]
        assert scales[layer, block, head] == np.float32(expected)
    # the absmax maps to exactly qmax, so the full range is used
    q, _ = quantize(x, 4, dtype)
    assert np.abs(q.astype(np.float32)).max() == QMAX[dtype]


def test_an_all_zero_block_has_scale_zero_and_round_trips_to_zero():
    x = np.zeros((1, 8, 1, 4), np.float32)
    x[0, 4:] = 3.0
    for dtype in ("int8", "fp8_e4m3"):
        q, scales = quantize(x, 4, dtype)
        assert scales[0, :, 0].tolist() == [0.0, np.float32(3.0 / QMAX[dtype])]
        assert np.array_equal(dequantize(q, scales, 4), x)


def test_int8_values_are_exact_multiples_of_the_scale():
    x = np.arange(-127, 128, dtype=np.float32).reshape(1, 255, 1, 1) * 0.5  # absmax 63.5 -> scale 0.5
    q, scales = quantize(x, 256, "int8")
    assert scales.ravel().tolist() == [0.5]
    assert q.ravel().tolist() == list(range(-127, 128))
    assert np.array_equal(dequantize(q, scales, 256), x)


def test_refuses_an_unquantized_dtype():
    with pytest.raises(ValueError, match="bfloat16 is not a quantized KV dtype"):
        quantize(kv(), 4, "bfloat16")


# ---- bytes on the wire ----------------------------------------------------------------------------

WIRE = dict(num_layers=4, num_kv_heads=2, head_dim=32, block_size=16)


async def push(layout: KvLayout, num_tokens: int) -> int:
    """Sends num_tokens of KV through a real KvSender -> KvReceiver; returns Transfer.bytes_received."""
    harness = Harness(layout, 4 * 2**20)
    await harness.server.start()
    try:
        transfer = harness.receiver.expect("r1", 0, TOKEN, num_tokens)
        x = kv((WIRE["num_layers"], num_tokens, WIRE["num_kv_heads"], WIRE["head_dim"]), seed=1)
        header = pb.KvHeader(request_id="r1", transfer_token=TOKEN, num_tokens=num_tokens,
                             fingerprint=pb.ModelFingerprint(digest="c0ffee" * 10 + "beef"))
        if layout.dtype in ("int8", "fp8_e4m3"):
            (k, ks), (v, vs) = quantize(x, layout.block_size, layout.dtype), quantize(-x, layout.block_size, layout.dtype)
            await harness.sender.send(harness.address, header, layout, k, v, 1, k_scales=ks, v_scales=vs)
        else:
            k = x.astype(layout.np_dtype)
            await harness.sender.send(harness.address, header, layout, k, k, 1)
        assert await transfer.done == 1
        return transfer.bytes_received
    finally:
        await harness.close()


async def test_quantized_kv_takes_half_of_bf16_and_a_quarter_of_fp32_on_the_wire_plus_scales():
    tokens = 160  # 10 blocks of 16
    got = {}
    for dtype in ("float32", "bfloat16", "fp8_e4m3", "int8"):
        got[dtype] = await push(KvLayout.of(**WIRE, dtype=dtype), tokens)
    kv_bytes_fp32 = 2 * 4 * 2 * 32 * 4 * tokens  # (k, v) x L x Hkv x D x 4 bytes x T = 327680
    scale_bytes = 4 * 2 * 4 * 2 * 10  # float32 x (k, v) x L x Hkv x blocks = 640: 4 bytes a token at bs 16
    assert got == {
        "float32": kv_bytes_fp32,
        "bfloat16": kv_bytes_fp32 // 2,
        "fp8_e4m3": kv_bytes_fp32 // 4 + scale_bytes,
        "int8": kv_bytes_fp32 // 4 + scale_bytes,
    }
    per_token = {d: b / tokens for d, b in got.items()}
    assert per_token == {"float32": 2048.0, "bfloat16": 1024.0, "fp8_e4m3": 516.0, "int8": 516.0}
