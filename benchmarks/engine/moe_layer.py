"""One mixture-of-experts layer's decode step alone (`MoeMlp`), each CPU path side by side in one process, on one
thread, at batch 1, 4 and 16: less sensitive to a loaded machine than the served decode of `moe_decode.py`.

    .venv/bin/python -m pdserve.benchmarks.engine.moe_layer [--hidden 512] [--expert-size 1024] [--experts 8] \
        [--top-k 2] [--batches 1 4 16] [--dtypes float32 bfloat16] [--reps 30]

The default shape is `moe_decode.py`'s (its Mixtral-like and Qwen3-MoE-like checkpoints share it: 8 experts of
1024, top 2, renormalised). Paths (`cpu_moe`):
- loop (plain): one matmul pair per chosen expert, torch's default linear (what `moe_decode` ran before it took
  the served start-up's matmul choice);
- loop (oneDNN): the same over weights prepacked for oneDNN (`cpu_matmul`'s `onednn` path);
- grouped: two `torch._grouped_mm` calls over the experts stacked (`cpu_moe.grouped_experts`);
- fused: one call of the fused C kernel over the experts in its panels (`cpu_moe_kernel`), where it builds and
  takes the shape;
- loop (int8): int8 expert weights through torch's weight-only int8 kernel (float32/bf16 compute).
Each cell is the median of --reps steps (after two warm-up steps), microseconds per layer step; the paths take
turns step by step, so the machine's load falls on each alike.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from pdserve.server.decode import cpu_moe_kernel
from pdserve.server.decode.moe import MoeMlp
from pdserve.server.decode.quant import quantize
from pdserve.server.model.config import MoeConfig


def layer(hidden: int, expert_size: int, experts: int, top_k: int, dtype: torch.dtype) -> MoeMlp:
    mlp = MoeMlp(MoeConfig(experts, top_k, expert_size, renormalize=True), hidden, "silu", dtype, "cpu")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for buffer in mlp.buffers():
            buffer.copy_(torch.randn(buffer.shape, generator=g) * 0.05)
    return mlp


def steps_us(mlps: dict[str, MoeMlp], x: torch.Tensor, reps: int) -> dict[str, float]:
    """Median microseconds per step of each layer on x, the layers taking turns step by step (so a change in
    the machine's load falls on all of them alike)."""
    times: dict[str, list[float]] = {name: [] for name in mlps}
    with torch.inference_mode():
        for mlp in mlps.values():
            mlp(x)
            mlp(x)
        for _ in range(reps):
            for name, mlp in mlps.items():
                t0 = time.perf_counter()
                mlp(x)
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) * 1e6 for name, t in times.items()}


def paths(args, dtype: torch.dtype) -> dict[str, MoeMlp]:
    """Each path's layer, the same weights (the same seed)."""
    make = lambda: layer(args.hidden, args.expert_size, args.experts, args.top_k, dtype)  # noqa: E731
    plain, grouped, packed, int8 = make(), make(), make(), make()
    grouped.group()
    out = {"loop (plain)": plain, "grouped": grouped}
    kernel = cpu_moe_kernel.load()
    if not isinstance(kernel, str) and cpu_moe_kernel.takes(args.hidden, args.expert_size, dtype, kernel.width) is None:
        fused = make()
        fused.fuse_cpu(kernel.width)
        out["fused"] = fused
    for m in (*packed.gate_up, *packed.down):
        m.prepack(float32=True)
    if packed.gate_up[0].packed:
        out["loop (oneDNN)"] = packed
    quantize(int8, "int8")
    out["loop (int8)"] = int8
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--expert-size", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    load = os.getloadavg()
    print(f"torch {torch.__version__}, one thread; load average {load[0]:.2f} at start; d {args.hidden}, "
          f"{args.experts} experts of {args.expert_size}, top {args.top_k}; us per layer step (median of {args.reps})")
    print("| dtype | path | " + " | ".join(f"batch {b}" for b in args.batches) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in args.batches) + " |")
    for name in args.dtypes:
        dtype = getattr(torch, name)
        xs = [torch.randn(1, b, args.hidden, generator=torch.Generator().manual_seed(b)).to(dtype)
              for b in args.batches]
        layers = paths(args, dtype)
        cells = [steps_us(layers, x, args.reps) for x in xs]
        for path in layers:
            print(f"| {name} | {path} | " + " | ".join(f"{c[path]:.0f}" for c in cells) + " |", flush=True)
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
