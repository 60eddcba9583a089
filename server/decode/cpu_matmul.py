"""How a bf16 (or fp16) checkpoint's matmuls compute on a CPU decode worker, chosen once at start.

- `onednn`: the weights prepacked into oneDNN's blocked layout (`Linear.prepack`), ~1.5x the rate of
  torch's default bf16 linear where the CPU has bf16 dot products (AVX512-bf16, AMX, AVX-NE-convert).
  oneDNN's bf16 reorder needs AVX-512 BW/VL/DQ or AVX-NE-convert: elsewhere it raises at start.
- `plain`: torch's default bf16 linear (ATen converts to fp32 in its inner loop where the CPU lacks bf16).
- `float32`: the weights upcast at load (exact: every bf16 is an fp32) and every matmul in fp32, the path
  the prefill tier takes on XLA:CPU; twice the weights' memory, the tokens of an fp32 run on the same
  weights (transformers' with `torch_dtype=float32`).

`auto` takes `onednn` where the CPU has native bf16 and oneDNN runs it (tried on a small input by
`hardware.torch_probe`), else whichever of the paths that run here measures fastest on the model's own
MLP shape (a few milliseconds at start). `--cpu-matmul` forces one; a forced path this CPU cannot run is
refused at start, naming the flag.
"""

from __future__ import annotations

import statistics
import time
import torch
import torch.nn.functional as F

from pdserve.server.hardware import Cpu, TorchCaps
from pdserve.server.vocabulary import CPU_MATMULS
HALF = (torch.bfloat16, torch.float16)


def runnable(dtype: torch.dtype, caps: TorchCaps, quantized: bool) -> list[str]:
    """The paths that run for dtype weights here (quantized weights have their own kernels: no prepack)."""
    onednn = caps.onednn_bf16 if dtype == torch.bfloat16 else caps.onednn_fp16
    return (["onednn"] if onednn and not quantized else []) + ["plain", "float32"]


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
    w, x = w32.to(dtype), x32.to(dtype)
    out: dict[str, float] = {}
    for path in paths:
        if path == "onednn":
            packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
            out[path] = _time_linear(lambda a: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], ""), x)
        elif path == "plain":
            out[path] = _time_linear(lambda a: F.linear(a, w), x)
        else:
            out[path] = _time_linear(lambda a: F.linear(a, w32), x32)
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
            raise ValueError(f"--cpu-matmul onednn: oneDNN cannot run {name} linears on this CPU ({cpu.describe()}; "
                             f"it needs AVX-512 BW/VL/DQ or AVX-NE-convert{', and unquantized weights' if quantized else ''}); "
                             f"use --cpu-matmul auto, plain or float32")
        return requested, "forced by --cpu-matmul"
    if "onednn" in paths and cpu.native_bf16 and dtype == torch.bfloat16:
        return "onednn", "native bf16 on this CPU"
    times = measure(paths, dtype, hidden, intermediate)
    best = min(times, key=times.__getitem__)
    native = "native bf16" if cpu.native_bf16 else "no native bf16"
    measured = ", ".join(f"{p} {t * 1e6:.0f} us" for p, t in times.items())
    return best, f"{native} on this CPU; fastest measured ({measured} a [4, {hidden}] linear)"


def describe(path: str, dtype: torch.dtype, why: str) -> str:
    """The start-up line's words for the choice, e.g. 'bf16 weights -> fp32 compute (no native bf16 ...)'."""
    name = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))
    how = {"onednn": f"{name} compute, prepacked for oneDNN", "plain": f"{name} compute, torch's default linear",
           "float32": "fp32 compute (upcast at load, exact)"}[path]
    return f"{name} weights -> {how} ({why})"
