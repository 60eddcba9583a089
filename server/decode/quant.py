"""Weight-only quantized linear layers for the decode tier: int8 and fp8 (e4m3), per-output-channel scales.

Weights are quantized once at load from the checkpoint's values: `w ≈ q * scale[out]`, scale =
absmax over the input dimension / qmax (127 for int8, 448 for fp8). On CPU the matmul runs by
dequantizing to the compute dtype per call; the quantized store is what the worker holds in memory.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kvcache.quant import QMAX
from pdserve.server.decode import cuda_linear
from pdserve.server.decode.cuda_linear import Kernel

WeightFormat = Literal["int8", "fp8"]
QUANTIZED_WEIGHTS: dict[str, tuple[torch.dtype, float]] = {
    "int8": (torch.int8, QMAX["int8"]),
    "fp8": (torch.float8_e4m3fn, QMAX["fp8_e4m3"]),
}


def quantize_weight(w: torch.Tensor, fmt: WeightFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (q [out, in] int8 or float8_e4m3fn, scale [out, 1] float32)."""
    dtype, qmax = QUANTIZED_WEIGHTS[fmt]
    w = w.float()
    scale = w.abs().amax(dim=1, keepdim=True) / qmax  # [out, 1]
    y = (w / torch.where(scale > 0, scale, torch.ones_like(scale))).clamp(-qmax, qmax)
    return (y.round() if fmt == "int8" else y).to(dtype), scale


class Linear(nn.Module):
    """y = x @ w.T + b with w held as loaded (float) or, after `quantize_`, as int8/fp8 + per-row scales."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 device: torch.device | str | None = None):
        super().__init__()
        self.dtype = dtype
        self.weight = nn.Buffer(torch.empty(out_features, in_features, dtype=dtype, device=device))  # [out, in]
        self.register_buffer("scale", None)  # [out, 1] float32 once quantized
        self.kernel: Kernel | None = None  # a matmul reading the quantized weight (cuda_linear), if any
        self.bias = nn.Buffer(torch.empty(out_features, dtype=dtype, device=device)) if bias else None  # [out]

    def quantize_(self, fmt: WeightFormat, kernel: Kernel | None = None) -> None:
        """Replaces the loaded weight with its int8/fp8 form and per-output-channel scales; kernel: the matmul
        over them (None: dequantize per call)."""
        if self.scale is not None:
            raise ValueError("the weight is quantized already")
        q, scale = quantize_weight(self.weight, fmt)
        self.weight = nn.Buffer(q)  # [out, in] int8 / float8_e4m3fn
        self.scale = nn.Buffer(scale)  # [out, 1] float32
        self.kernel = kernel

    def dequantized(self) -> torch.Tensor:
        if self.scale is None:
            return self.weight
        return (self.weight.float() * self.scale).to(self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(x, self.weight, self.scale, self.bias)
        return F.linear(x, self.dequantized(), self.bias)


def quantize(model: nn.Module, fmt: WeightFormat) -> str:
    """Every `Linear` of the model (its layers' matmuls) to int8/fp8; embeddings, norms and biases stay.
    Returns how they compute: through a kernel for the format on the model's device, or "saves memory only"."""
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    kernel = cuda_linear.pick(fmt, linears[0].dtype, linears[0].weight.device) if linears else None
    for module in linears:
        module.quantize_(fmt, kernel)
    model.weight_format = fmt
    device = linears[0].weight.device.type if linears else "-"
    model.weight_kernel = (f"{fmt} weights through {kernel.__name__}" if kernel else
                           f"{fmt} weights dequantized per matmul on {device}: the format saves memory only")
    return model.weight_kernel


def buffer_bytes(module: nn.Module) -> int:
    """Bytes of every buffer and parameter the module holds (what its weights take in memory)."""
    return sum(t.nbytes for t in module.buffers()) + sum(p.nbytes for p in module.parameters())
