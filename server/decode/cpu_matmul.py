"""How a checkpoint's matmuls compute on a CPU decode worker, chosen once at start (`--cpu-matmul`).

- `onednn`: the weights in the checkpoint's dtype, prepacked into oneDNN's blocked layout
  (`Linear.prepack`). For bf16, ~1.5x torch's default linear where the CPU has bf16 dot products
  (AVX512-bf16, AMX, AVX-NE-convert); oneDNN's bf16 reorder needs AVX-512 BW/VL/DQ or AVX-NE-convert and
  raises elsewhere. For fp32, 1.3-3x torch's default linear at 4-16 rows, on AVX2 as on AVX-512 (torch's
  default sgemm is slow at a decode step's few rows; vLLM's CPU backend prepacks through oneDNN too).
- `plain`: torch's default linear in the checkpoint's dtype (for bf16 without native support, ATen
  converts to fp32 in its inner loop).
- `float32` / `float32-onednn` (bf16/fp16 checkpoints): the weights upcast at load (exact: every bf16 is an
  fp32), every matmul in fp32 through torch's default linear or prepacked for oneDNN; twice the weights'
  memory, the tokens of an fp32 run on the same weights (transformers' with `torch_dtype=float32`), the
  path the prefill tier takes on XLA:CPU.

`auto` takes bf16 `onednn` where the CPU has native bf16 and oneDNN runs it (tried on a small input by
`hardware.torch_probe`), else whichever of the paths that run here measures fastest on the model's own
MLP shape at 4 rows (a few milliseconds at start). Quantized (int8/fp8) weights have their own kernels:
only their compute dtype is chosen here. A forced path this CPU cannot run is refused at start, naming
the flag.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from pdserve.server.choices import CPU_MATMULS
from pdserve.server.hardware import Cpu, TorchCaps

HALF = (torch.bfloat16, torch.float16)
PACKED = ("onednn", "float32-onednn")
"""The paths whose weights are prepacked for oneDNN."""
UPCAST = ("float32", "float32-onednn")
"""The paths that upcast a bf16/fp16 checkpoint to fp32 at load."""


def runnable(dtype: torch.dtype, caps: TorchCaps, quantized: bool) -> list[str]:
    """The paths that run for dtype weights here (quantized weights have their own kernels: no prepack)."""
    onednn = {torch.bfloat16: caps.onednn_bf16, torch.float16: caps.onednn_fp16}.get(dtype, caps.onednn_fp32)
    fp32_onednn = caps.onednn_fp32 and not quantized
    if dtype == torch.float32:
        return (["onednn"] if fp32_onednn else []) + ["plain"]
    return (["onednn"] if onednn and not quantized else []) + ["plain"] + \
        (["float32-onednn"] if fp32_onednn else []) + ["float32"]


def _time_linear(fn, x: torch.Tensor, reps: int = 5) -> float:
    """Median seconds of one call, over `reps` timings of a few calls each (after a warm-up call)."""
    fn(x)
    calls = 4
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn(x)
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def measure(paths: list[str], dtype: torch.dtype, hidden: int, intermediate: int) -> dict[str, float]:
    """Seconds per [4, hidden] x [hidden, intermediate] linear on each path (the decode step's widest
    matmul at a small batch; intermediate capped at 8192 to keep start-up short)."""
    g = torch.Generator().manual_seed(0)
    w32 = torch.randn(min(intermediate, 8192), hidden, generator=g) / hidden**0.5  # [out, in]
    x32 = torch.randn(4, hidden, generator=g)
    out: dict[str, float] = {}
    for path in paths:
        w, x = (w32, x32) if path in UPCAST else (w32.to(dtype), x32.to(dtype))
        if path in PACKED:
            packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
            out[path] = _time_linear(lambda a: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], ""), x)
        else:
            out[path] = _time_linear(lambda a: F.linear(a, w), x)
    return out


def choose(requested: str, dtype: torch.dtype, cpu: Cpu, caps: TorchCaps, hidden: int, intermediate: int,
           quantized: bool = False) -> tuple[str, str]:
    """(path, why) for dtype weights on this CPU; ValueError for a forced path that cannot run here."""
    if requested not in CPU_MATMULS:
        raise ValueError(f"--cpu-matmul must be one of {', '.join(CPU_MATMULS)}, not {requested!r}")
    paths = runnable(dtype, caps, quantized)
    name = str(dtype).removeprefix("torch.")
    if requested != "auto":
        if requested not in paths:
            needs = "AVX-512 BW/VL/DQ or AVX-NE-convert" if dtype in HALF and "onednn" == requested else "oneDNN"
            raise ValueError(f"--cpu-matmul {requested} cannot run for {name}{' quantized' if quantized else ''} "
                             f"weights on this CPU ({cpu.describe()}; oneDNN's prepacked {name} linear needs {needs}"
                             f"{', and unquantized weights' if quantized else ''}); it takes {', '.join(paths)} "
                             f"here, or auto")
        return requested, "forced by --cpu-matmul"
    if "onednn" in paths and cpu.native_bf16 and dtype == torch.bfloat16:
        return "onednn", "native bf16 on this CPU"
    if len(paths) == 1:
        return paths[0], "the only path here"
    times = measure(paths, dtype, hidden, intermediate)
    best = min(times, key=times.__getitem__)
    native = ("native bf16" if cpu.native_bf16 else "no native bf16") if dtype == torch.bfloat16 else f"{name} weights"
    measured = ", ".join(f"{p} {t * 1e6:.0f} us" for p, t in times.items())
    return best, f"{native} on this CPU; fastest measured ({measured} a [4, {hidden}] linear)"


def describe(path: str, dtype: torch.dtype, why: str) -> str:
    """The start-up line's words for the choice, e.g. 'bf16 weights -> fp32 compute (no native bf16 ...)'."""
    name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(dtype, str(dtype))
    how = {"onednn": f"{name} compute, prepacked for oneDNN", "plain": f"{name} compute, torch's default linear",
           "float32": "fp32 compute (upcast at load, exact), torch's default linear",
           "float32-onednn": "fp32 compute (upcast at load, exact), prepacked for oneDNN"}[path]
    return f"{name} weights -> {how} ({why})"
