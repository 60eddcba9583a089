"""Weight-only quantized linear layers for the decode tier: int8 and fp8 (e4m3), per-output-channel scales.

Weights are quantized once, right after loading (`quantize`), from the loaded values: `w ≈ q * scale[out]`,
scale = absmax over the input dimension / qmax (127 for int8, 448 for fp8).

On CUDA (`cuda_linear`): fp8 through `torch._scaled_mm` on devices of compute capability 8.9+, int8
through torch's weight-only int8 kernel where it runs there; elsewhere dequantized per call (memory only).

How each runs on CPU (measured on one core, benchmarks/engine/decode_step.py): bf16/fp16 weights are
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
from pdserve.server import hardware
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
    """y = x @ w.T + b with w held as loaded (float), prepacked for oneDNN (CPU), or after `quantize_` as
    int8/fp8 + per-row scales."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 device: torch.device | str | None = None):
        """Empty buffers of the shapes, in dtype on the device; `weights.load_weights` fills them."""
        super().__init__()
        self.dtype = dtype
        self.weight = nn.Buffer(torch.empty(out_features, in_features, dtype=dtype, device=device))  # [out, in]
        self.register_buffer("scale", None)  # [out, 1] float32 once quantized
        self.register_buffer("bias", torch.empty(out_features, dtype=dtype, device=device) if bias else None)  # [out]
        self.kernel: Kernel | None = None
        """A matmul reading the quantized weight itself (`cuda_linear`), where the device has one."""
        self.packed = False
        """weight holds oneDNN's blocked layout (`prepack`): only `_linear_pointwise` can read it."""
        self.cpu_int8 = False
        """int8 weights run torch's weight-only int8 CPU kernel (set by `quantize` where it runs)."""

    @classmethod
    def of(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> Linear:
        """A Linear over a weight [out, in] (and bias [out]) already in memory, in dtype (default: its own)."""
        dtype = dtype or weight.dtype
        linear = cls(weight.shape[1], weight.shape[0], False, dtype, device="meta")
        linear.weight = nn.Buffer(weight.to(dtype))
        if bias is not None:
            linear.bias = nn.Buffer(bias.to(dtype))
        return linear

    def quantize_(self, fmt: WeightFormat, kernel: Kernel | None = None) -> None:
        """Replaces the loaded weight with its int8/fp8 form and per-output-channel scales; kernel: the matmul
        over them (None: torch's CPU int8 kernel where it applies, else dequantize per call)."""
        if self.scale is not None or self.packed:
            raise ValueError("the weight is quantized or prepacked already")
        q, scale = quantize_weight(self.weight, fmt)
        self.weight = nn.Buffer(q)  # [out, in] int8 / float8_e4m3fn
        self.scale = nn.Buffer(scale)  # [out, 1] float32
        self.kernel = kernel

    def prepack(self, float32: bool = False) -> None:
        """On CPU, bf16/fp16 (and with `float32`, fp32) weights reordered once into oneDNN's blocked layout
        (in place of the plain ones, so memory does not double); a no-op on other devices and formats."""
        if self.packed or self.weight.device.type != "cpu" or self.scale is not None:
            return
        dtypes = (torch.bfloat16, torch.float16) + ((torch.float32,) if float32 else ())
        if self.weight.dtype in dtypes and torch.backends.mkldnn.is_available():
            self.weight = nn.Buffer(torch.ops.mkldnn._reorder_linear_weight(self.weight, None))
            self.packed = True

    def dequantized(self) -> torch.Tensor:
        if self.packed:
            raise ValueError("a prepacked weight is in oneDNN's layout; read it through forward")
        if self.scale is None:
            return self.weight
        return (self.weight.float() * self.scale).to(self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if self.kernel is not None:
            return self.kernel(x, self.weight, self.scale, self.bias)
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        if self.cpu_int8 and x.device.type == "cpu" and x.shape[-1] % 32 == 0:
            # (torch 2.13's bf16 kernel reads out of bounds when the input width is not a multiple of 16)
            y = torch._weight_int8pack_mm(x.reshape(-1, x.shape[-1]).contiguous(), self.weight,
                                          self.scale[:, 0].to(x.dtype))  # [N, out]
            y = y.view(*x.shape[:-1], -1)
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.dequantized(), self.bias)


def quantize(model: nn.Module, fmt: WeightFormat) -> str:
    """Every `Linear` of the model (its layers' matmuls) to int8/fp8; embeddings, norms and biases stay.
    Returns (and sets as model.weight_kernel) how they compute: through a kernel for the format on the
    model's device, or "saves memory only"."""
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    device = linears[0].weight.device if linears else torch.device("cpu")
    kernel = cuda_linear.pick(fmt, linears[0].dtype, device) if linears else None
    cpu_int8 = fmt == "int8" and device.type == "cpu" and hardware.torch_probe().int8_cpu
    for module in linears:
        module.quantize_(fmt, kernel)
        module.cpu_int8 = cpu_int8
    model.weight_format = fmt
    if kernel is not None:
        model.weight_kernel = f"{fmt} weights through {kernel.__name__}"
    elif cpu_int8:
        model.weight_kernel = "int8 weights through torch's weight-only int8 kernel on cpu (input widths of 32k)"
    else:
        model.weight_kernel = f"{fmt} weights dequantized per matmul on {device.type}: the format saves memory only"
    return model.weight_kernel


def buffer_bytes(module: nn.Module) -> int:
    """Bytes of every buffer and parameter the module holds (what its weights take in memory)."""
    return sum(t.nbytes for t in module.buffers()) + sum(p.nbytes for p in module.parameters())
