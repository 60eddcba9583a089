"""Matmuls over int8/fp8 weights that read the quantized bytes themselves, where the device has a kernel.

fp8 on CUDA devices of compute capability 8.9+ (Ada, Hopper): `torch._scaled_mm` with the activations
quantized per row on the fly (W8A8 with row-wise scales, as vLLM's fp8 does), so the weights stream at
one byte each. The activations' absmax, scale and fp8 cast are one Triton kernel (`quantize_rows`: a
program per row) where triton is installed, else ~6 small torch kernels (`fp8_scaled_mm_torch`); at batch 1 a
step's ~225 linears make those launches most of what fp8 saves in weight traffic. int8:
`torch._weight_int8pack_mm` (weight-only) where torch has it for the device. Each is tried once on a
small input at load; where none runs, `pick` returns None and the weights are dequantized per matmul:
the format saves memory only, and the start-up log says so.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

FP8_MAX = 448.0

Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
"""(x [.., in] in the compute dtype, q [out, in], scale [out, 1] f32, bias [out] | None) -> [.., out]."""


def quantize_rows_torch(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [M, in] -> (fp8 e4m3 [M, in], scale [M, 1] f32): rows ~= q * scale, scale = absmax / 448."""
    x_scale = (rows.abs().amax(-1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)  # [M, 1]
    return (rows.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), x_scale


QUANT_BLOCK = 1024
"""Columns one iteration of `quantize_rows` reads."""


@functools.cache
def _quantize_rows_kernel():
    """The Triton kernel, made on first use (a test chooses the interpreter before)."""
    import triton
    import triton.language as tl

    @triton.jit
    def quantize_rows(X, Q, S, K, stride_x, stride_q, QMAX: tl.constexpr, BLOCK: tl.constexpr):
        """One row of X [M, K]: its absmax, scale = max(absmax / QMAX, 1e-12) into S [M], X / scale in fp8 into Q."""
        row = tl.program_id(0).to(tl.int64)
        amax = tl.zeros([BLOCK], tl.float32)
        for start in range(0, K, BLOCK):
            k = start + tl.arange(0, BLOCK)
            x = tl.load(X + row * stride_x + k, mask=k < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.max(amax, 0) / QMAX, 1e-12)
        for start in range(0, K, BLOCK):
            k = start + tl.arange(0, BLOCK)
            x = tl.load(X + row * stride_x + k, mask=k < K, other=0.0).to(tl.float32)
            q = tl.minimum(tl.maximum(x / scale, -QMAX), QMAX)
            tl.store(Q + row * stride_q + k, q.to(Q.dtype.element_ty), mask=k < K)
        tl.store(S + row, scale)

    return quantize_rows


def quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """As `quantize_rows_torch`, the same bytes, in one Triton kernel launch."""
    M, K = rows.shape
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    q = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=rows.device)
    scale = torch.empty(M, 1, dtype=torch.float32, device=rows.device)
    _quantize_rows_kernel()[(M,)](rows, q, scale, K, rows.stride(0), q.stride(0), QMAX=FP8_MAX, BLOCK=QUANT_BLOCK)
    return q, scale


def _fp8_mm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
            quantize: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])  # [M, in]
    x_q, x_scale = quantize(rows)  # [M, in] fp8, [M, 1] f32
    # scale [out, 1] viewed [1, out]: the same memory, no transposed copy per call
    out = torch._scaled_mm(x_q, q.t(), scale_a=x_scale, scale_b=scale.view(1, -1), out_dtype=x.dtype)  # [M, out]
    if bias is not None:  # row-wise scaling takes no bias
        out = out + bias
    return out.reshape(*x.shape[:-1], q.shape[0])


@functools.cache
def _have_triton() -> bool:
    from pdserve.server.decode.cuda_attention import have_triton

    return have_triton()


def fp8_scaled_mm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """W8A8 fp8, the activations quantized by one Triton kernel (`quantize_rows`); by torch ops where triton is
    not installed."""
    return _fp8_mm(x, q, scale, bias, quantize_rows if _have_triton() else quantize_rows_torch)


def fp8_scaled_mm_torch(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
                        ) -> torch.Tensor:
    """W8A8 fp8, the activations quantized by torch ops (`quantize_rows_torch`): where the Triton kernel fails."""
    return _fp8_mm(x, q, scale, bias, quantize_rows_torch)


def int8_pack_mm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])  # [M, in]
    out = torch._weight_int8pack_mm(rows, q, scale[:, 0].to(x.dtype))  # [M, out]
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], q.shape[0])


def _runs(kernel: Kernel, fmt: str, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the kernel runs here and agrees with dequantize-then-matmul on a small input."""
    from pdserve.server.decode.quant import quantize_weight

    try:
        g = torch.Generator(device="cpu").manual_seed(0)
        w = torch.randn(64, 128, generator=g).to(device)
        x = torch.randn(16, 128, generator=g).to(device, dtype)
        q, scale = quantize_weight(w, fmt)  # type: ignore[arg-type]
        got = kernel(x, q, scale, None).float()
        expected = x.float() @ (q.float() * scale).t()
    except Exception:  # noqa: BLE001 - any failure (a Triton compile error included): not this kernel
        return False
    return bool(((got - expected).abs().max() <= 0.1 * expected.abs().max() + 1e-3).item())


def pick(fmt: str, dtype: torch.dtype, device: torch.device) -> Kernel | None:
    """The kernel for fmt weights computing in dtype on device, or None (dequantize per matmul)."""
    if device.type != "cuda":
        return None
    if fmt == "fp8":
        if torch.cuda.get_device_capability(device) < (8, 9) or dtype == torch.float32:
            return None
        return next((k for k in (fp8_scaled_mm, fp8_scaled_mm_torch) if _runs(k, fmt, dtype, device)), None)
    if fmt == "int8":
        return int8_pack_mm if _runs(int8_pack_mm, fmt, dtype, device) else None
    return None
