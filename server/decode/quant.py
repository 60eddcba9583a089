"""Weight-only quantized linear layers for the decode tier: int8 and fp8 (e4m3), per-output-channel scales.

Weights are quantized once at load from the checkpoint's values: `w ≈ q * scale[out]`, scale =
absmax over the input dimension / qmax (127 for int8, 448 for fp8).

How each runs on CPU (measured on one core, benchmarks/decode_step.py): bf16/fp16 weights are
prepacked for oneDNN at load (`Linear.prepack`, `DecoderModel.prepack`; ~1.5x the streaming rate of torch's default linear at 1-16
rows); int8 runs through torch's weight-only int8 kernel (`_weight_int8pack_mm`, scales applied to the
output), never dequantized; fp8 has no CPU kernel (`_scaled_mm` on CPU and fp8 -> bf16 conversion both
run ~20x slower than a bf16 matmul), so each call dequantizes: on CPU fp8 weights save memory only.
float32 weights keep torch's default linear, the one transformers (the parity oracle) runs.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kvcache.quant import QMAX

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
    """y = x @ w.T + b with w held as given (float) or quantized (int8/fp8 + per-row scales)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                 fmt: WeightFormat | None = None):
        super().__init__()
        self.dtype = dtype
        if fmt is None:
            self.weight = nn.Buffer(weight.to(dtype))  # [out, in]
            self.scale = None
        else:
            q, scale = quantize_weight(weight, fmt)
            self.weight = nn.Buffer(q)  # [out, in] int8 / float8_e4m3fn
            self.scale = nn.Buffer(scale)  # [out, 1] float32
        self.bias = None if bias is None else nn.Buffer(bias.to(dtype))
        self.packed = False
        """weight holds oneDNN's blocked layout (`prepack`): only `_linear_pointwise` can read it."""

    def prepack(self) -> None:
        """On CPU, bf16/fp16 weights reordered once into oneDNN's blocked layout (in place of the plain
        ones, so memory does not double); a no-op on other devices and for other formats."""
        if self.packed or self.weight.device.type != "cpu" or self.scale is not None:
            return
        if self.weight.dtype in (torch.bfloat16, torch.float16) and torch.backends.mkldnn.is_available():
            self.weight = nn.Buffer(torch.ops.mkldnn._reorder_linear_weight(self.weight, None))
            self.packed = True

    def dequantized(self) -> torch.Tensor:
        if self.packed:
            raise ValueError("a prepacked weight is in oneDNN's layout; read it through forward")
        if self.scale is None:
            return self.weight
        return (self.weight.float() * self.scale).to(self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        if self.weight.dtype == torch.int8 and x.device.type == "cpu" and x.shape[-1] % 32 == 0:
            # (torch 2.13's bf16 kernel reads out of bounds when the input width is not a multiple of 16)
            y = torch._weight_int8pack_mm(x.reshape(-1, x.shape[-1]).contiguous(), self.weight,
                                          self.scale[:, 0].to(x.dtype))  # [N, out]
            y = y.view(*x.shape[:-1], -1)
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.dequantized(), self.bias)


def buffer_bytes(module: nn.Module) -> int:
    """Bytes of every buffer and parameter the module holds (what its weights take in memory)."""
    return sum(t.nbytes for t in module.buffers()) + sum(p.nbytes for p in module.parameters())
