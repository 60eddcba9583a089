"""Matmuls over int8/fp8 weights that read the quantized bytes themselves, where the device has a kernel.

fp8 on CUDA devices of compute capability 8.9+ (Ada, Hopper): `torch._scaled_mm` with the activations
quantized per row on the fly (W8A8 with row-wise scales, as vLLM's fp8 does), so the weights stream at
one byte each. int8: `torch._weight_int8pack_mm` (weight-only) where torch has it for the device. Each is
tried once on a small input at load; where none runs, `pick` returns None and the weights are
dequantized per matmul: the format saves memory only, and the start-up log says so.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

FP8_MAX = 448.0

Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
"""(x [.., in] in the compute dtype, q [out, in], scale [out, 1] f32, bias [out] | None) -> [.., out]."""


def fp8_scaled_mm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])  # [M, in]
    x_scale = (rows.abs().amax(-1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)  # [M, 1]
    x_q = (rows.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)  # [M, in]
    out = torch._scaled_mm(x_q, q.t(), scale_a=x_scale, scale_b=scale.t().contiguous(), out_dtype=x.dtype)  # [M, out]
    if bias is not None:  # row-wise scaling takes no bias
        out = out + bias
    return out.reshape(*x.shape[:-1], q.shape[0])


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
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):
        return False
    return bool(((got - expected).abs().max() <= 0.1 * expected.abs().max() + 1e-3).item())


def pick(fmt: str, dtype: torch.dtype, device: torch.device) -> Kernel | None:
    """The kernel for fmt weights computing in dtype on device, or None (dequantize per matmul)."""
    if device.type != "cuda":
        return None
    if fmt == "fp8":
        if torch.cuda.get_device_capability(device) < (8, 9) or dtype == torch.float32:
            return None
        return fp8_scaled_mm if _runs(fp8_scaled_mm, fmt, dtype, device) else None
    if fmt == "int8":
        return int8_pack_mm if _runs(int8_pack_mm, fmt, dtype, device) else None
    return None
