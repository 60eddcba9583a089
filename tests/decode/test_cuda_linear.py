"""The fp8 activation-quantizing Triton kernel (`cuda_linear.quantize_rows`), run by Triton's interpreter on the
CPU, against the torch ops it replaces, and the fp8 linear through it against the dequantized matmul.

The interpreter's float -> fp8 e4m3 cast drops the carry when rounding up crosses a power of two (125.9 -> 64,
not 128) and flushes subnormals to zero; CUDA's conversion rounds to nearest even, and `benchmarks/gpu.py`'s
correctness stage checks the bytes equal there. Here every other byte is equal, and the differing ones are
exactly those."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton is first imported

from pdserve.server.decode import cuda_linear
from pdserve.server.decode.cuda_attention import have_triton
from pdserve.server.decode.quant import quantize_weight

needs_triton = pytest.mark.skipif(not have_triton(), reason="triton is not installed here (pip install triton)")


@needs_triton
@pytest.mark.parametrize("width", [128, 2500, 4096])  # one block, a ragged last block, whole blocks
def test_quantize_rows_gives_the_torch_ops_scales_and_bytes(width):
    g = torch.Generator().manual_seed(width)
    x = torch.randn(3, width, generator=g) * torch.tensor([[0.01], [3.0], [300.0]])
    x[1, 7] = 0.0
    q, scale = cuda_linear.quantize_rows(x)
    want_q, want_scale = cuda_linear.quantize_rows_torch(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and scale.shape == (3, 1)
    assert torch.equal(scale, want_scale)
    got, want = q.float(), want_q.float()
    differ = got != want
    if torch.cuda.is_available():
        assert not differ.any()
    else:  # the interpreter's carry (half the right power of two) and its subnormals (flushed to zero)
        assert differ.float().mean() < 0.05
        carry = (got * 2 == want) & (want.abs().log2().frac() == 0)
        flushed = (got == 0) & (want.abs() < 2.0**-6)  # below e4m3's smallest normal
        assert (carry | flushed)[differ].all()
    zero = torch.zeros(2, 64)
    q, scale = cuda_linear.quantize_rows(zero)
    assert torch.equal(q.float(), zero) and torch.equal(scale, torch.full((2, 1), 1e-12))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_through_the_kernel_matches_the_dequantized_matmul(dtype):
    """W8A8 through `quantize_rows` and torch._scaled_mm (CPU here) against x @ dequantized(w).T: within what
    quantizing the activations to fp8 costs (e4m3 keeps 3 mantissa bits: ~6% of a value, averaging out)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=g)
    q, scale = quantize_weight(w, "fp8")
    x = torch.randn(5, 256, generator=g).to(dtype)
    bias = torch.randn(64, generator=g).to(dtype)
    try:
        got = cuda_linear.fp8_scaled_mm(x, q, scale, bias).float()  # through quantize_rows (triton is here)
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"torch._scaled_mm does not run here: {e}")
    expected = x.float() @ (q.float() * scale).t() + bias.float()
    assert got.shape == (5, 64)
    err = (got - expected).abs().max().item() / expected.abs().max().item()
    assert err < 0.05, err
    torch_path = cuda_linear.fp8_scaled_mm_torch(x, q, scale, bias).float()
    assert (got - torch_path).abs().max().item() / expected.abs().max().item() < 0.05
