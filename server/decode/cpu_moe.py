"""The decode tier's mixture-of-experts step on the CPU: the grouped matmul or the loop over chosen experts,
chosen by measurement once at start (`prepare`), the choice logged in one line.

- `grouped`: the step's token copies sorted by expert, then one `torch._grouped_mm` call for gate|up and one for
  down over the experts' weights stacked (`cuda_moe.stack_experts`: each expert's Linear a view of the stack, the
  memory not doubled), the activation and the weighted combine vectorised: no Python loop over experts and no
  host read of the routing. It reads plain float weights only (fp32/bf16/fp16; not int8/fp8, not oneDNN's
  prepacked layout).
- `loop` (`moe.MoeMlp`'s own step, the fallback): one matmul pair per chosen expert through its `Linear`s, so
  whatever they compute with applies: oneDNN prepacked weights, torch's weight-only int8 kernel, fp8 dequantized.

Measured (benchmarks/engine/moe_layer.py, AMD EPYC with AVX-512 and avx512_bf16, no AMX, torch 2.13, one thread, a layer
of d 512, 8 experts of 1024, top 2, the paths taking turns on a loaded machine): torch 2.13's CPU `_grouped_mm`
runs a plain matmul per group, within a few percent of the loop over plain weights, while oneDNN's prepacked
weights make the loop 1.5-2x faster in fp32 and 1.3-1.6x in bf16 at 1-16 tokens (the loop's own Python costs
~30 us per chosen expert, ~10% of a step at 16 tokens). So `prepare` keeps the loop wherever the experts are
prepacked or quantized and measures the two on the layer's own weights otherwise; a torch whose CPU grouped
matmul is a real kernel wins the measurement without a code change.
"""

from __future__ import annotations

import functools
import statistics
import time

import torch
import torch.nn.functional as F

from pdserve.server.decode.cuda_moe import StackedExperts, stack_experts

PATHS = ("grouped", "loop")
PROBE_TOKENS = (1, 16)
"""Decode batches the measurement times (the sum of their times decides)."""


@functools.cache
def grouped_runs(dtype: torch.dtype) -> tuple[bool, str]:
    """Whether torch's grouped matmul runs on the CPU for dtype here and agrees with a matmul per group (a tiny
    call, once per process) -> (ok, why not)."""
    if not hasattr(torch, "_grouped_mm"):
        return False, f"torch {torch.__version__} has no _grouped_mm"
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(5, 32, generator=g).to(dtype)
        w = torch.randn(3, 48, 32, generator=g).to(dtype)  # [E, out, in], read transposed as the experts are
        offs = torch.tensor([2, 2, 5], dtype=torch.int32)  # an empty group in the middle
        got = torch._grouped_mm(x, w.transpose(1, 2), offs=offs).float()
        want = torch.cat([x[:2] @ w[0].T, x[2:] @ w[2].T]).float()
    except Exception as e:  # noqa: BLE001 - any failure: not on this build
        return False, f"torch._grouped_mm on cpu raised {e!r}"
    err = ((got - want).abs().max() / want.abs().max()).item()
    return err < 1e-2, f"max error {err:.1e} against a matmul per group"


def activation(gate: torch.Tensor, act: str, inplace: bool = False) -> torch.Tensor:
    """SiLU or tanh-GELU of the gate (SiLU written over it with inplace: the gate is a fresh matmul's output)."""
    return F.silu(gate, inplace=inplace) if act == "silu" else F.gelu(gate, approximate="tanh")


def combine(out: torch.Tensor, weights: torch.Tensor, order: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Expert outputs of the sorted copies [T k, d] -> each token's routing-weighted sum [T, d] in fp32."""
    weighted = out.float() * weights.flatten()[order][:, None]  # [T k, d]
    T = weights.shape[0]
    return torch.zeros(T, out.shape[1], dtype=torch.float32, device=out.device).index_add_(0, tokens, weighted)


def grouped_experts(flat: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, stacked: StackedExperts,
                    act: str) -> torch.Tensor:
    """sum over each token's k experts of weight * down(act(gate(x)) * up(x)) -> [T, d] in x's dtype, each expert's
    rows in one matmul (two grouped calls in all)."""
    E = stacked.gate_up.shape[0]
    chosen = experts.flatten()  # [T k] token-major
    order = chosen.argsort(stable=True)  # copies sorted by expert
    tokens = order // experts.shape[1]  # [T k]
    counts = torch.zeros(E, dtype=torch.int64, device=chosen.device).scatter_add_(0, chosen, torch.ones_like(chosen))
    offs = counts.cumsum(0).to(torch.int32)  # [E] each expert's rows' end (no host read, on CUDA too)
    gate, up = torch._grouped_mm(flat[tokens], stacked.gate_up.transpose(1, 2), offs=offs).chunk(2, dim=-1)
    out = torch._grouped_mm(activation(gate, act, inplace=True).mul_(up), stacked.down.transpose(1, 2),
                            offs=offs)  # [T k, d]
    return combine(out, weights, order, tokens).to(flat.dtype)


def _timed(fn, reps: int = 5) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(mlp) -> dict[str, float]:
    """Seconds per step of the layer on each path, summed over PROBE_TOKENS tokens (random inputs, the layer's own
    weights, which it stacks: `mlp.stacked` set, `mlp.grouped` left as it was)."""
    mlp.stacked = mlp.stacked or stack_experts(list(mlp.gate_up), list(mlp.down))
    d = mlp.router.shape[1]
    g = torch.Generator().manual_seed(0)
    was = mlp.grouped
    times = dict.fromkeys(PATHS, 0.0)
    with torch.inference_mode():
        for n in PROBE_TOKENS:
            x = torch.randn(1, n, d, generator=g).to(mlp.router.dtype)
            for path in PATHS:
                mlp.grouped = path == "grouped"
                times[path] += _timed(lambda: mlp(x))
    mlp.grouped = was
    return times


def choose(mlp) -> tuple[str, str]:
    """(path, why) for one CPU MoE layer as loaded (prepacked and quantized or not)."""
    dtype = mlp.router.dtype
    ok, why = grouped_runs(dtype)
    if not ok:
        return "loop", f"no CPU grouped matmul for {dtype} here ({why})"
    linears = [*mlp.gate_up, *mlp.down]
    if any(m.packed for m in linears):
        return "loop", "the experts are prepacked for oneDNN (the grouped matmul reads plain weights only)"
    if any(m.scale is not None for m in linears):
        return "loop", "the experts are quantized (the loop keeps their int8/fp8 kernels)"
    times = measure(mlp)
    best = min(times, key=times.__getitem__)
    measured = ", ".join(f"{p} {t * 1e6:.0f} us" for p, t in times.items())
    return best, f"fastest measured on the layer's weights ({measured} for {'+'.join(map(str, PROBE_TOKENS))} tokens)"


def prepare(model) -> str:
    """On the CPU, every MoE layer of the model set to the path measured fastest on its first one; returns the
    start-up line's words."""
    layers = [layer.experts for layer in model.layers if layer.experts is not None]
    if not layers:
        return ""
    path, why = choose(layers[0])
    for mlp in layers:
        if path == "grouped":
            mlp.group()
        else:
            mlp.grouped = False
    how = "one grouped matmul per projection over all experts" if path == "grouped" else \
        "one matmul pair per chosen expert through its Linears"
    return f"{len(layers)} layers: {path} ({how}; {why})"
