"""The fused mixture-of-experts step on the CPU (`cpu_moe_kernel.c`): built once per machine with the system's C
compiler, loaded through ctypes, called once per layer and step (`fused_experts`).

One call groups the step's token copies by expert, streams each chosen expert's gate|up and down weights once
over all its rows (4 at a time, the activation between), and writes the routing-weighted sum: no Python per
expert, no gather or scatter tensors. The weights, fp32 or bf16 (fp32 math), are laid out once at start in panels
of `Kernel.width` outputs (`pack`: [E, N, K] -> [E, N / width, K, width], each panel one sequential stream that the
kernel prefetches ahead of its loads), in place of the experts' own. It is single-threaded: `cpu_moe.prepare`
measures it against the other paths at the worker's thread count.

Built with `-O3` and the instruction set `hardware.cpu()` reports (so `PDSERVE_CPU_ISA` caps it too) by
`native_build`: found prebuilt in $PDSERVE_PREBUILT_KERNELS (the decode image's), else compiled once into
$PDSERVE_KERNEL_CACHE; a machine with neither a prebuilt library nor a C compiler (`cc`, or $CC) gets the other
paths, said at start-up.
"""

from __future__ import annotations

import ctypes
import functools
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.server import hardware, native_build
from pdserve.server.native_build import NativeSource

CACHE_ENV = native_build.CACHE_ENV
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
"""The expert weight dtypes it reads (the value: the kernel's bf16 flag)."""
MAX_COPIES = 1024
"""The most token copies (tokens x top k) one call takes (its sort and scratch grow with them): a longer step (a
local prefill) is cut into calls of this many."""


SOURCE = NativeSource(Path(__file__).with_name("cpu_moe_kernel.c"))


def isa_flags(cpu: hardware.Cpu) -> list[str]:
    """The compiler's target flags for this CPU, after PDSERVE_CPU_ISA's cap."""
    return SOURCE.variants(cpu)[0]


def build(cpu: hardware.Cpu | None = None) -> Path:
    """The kernel's shared library for this CPU (prebuilt, or compiled once into the cache: `native_build`);
    RuntimeError naming what to do when it cannot be had."""
    return native_build.build(SOURCE, cpu)[0]


@dataclass(frozen=True)
class Kernel:
    fn: ctypes._CFuncPtr
    """moe_experts(x, T, d, I, E, k, ids, weights, w13, w2, bf16, act, out, scratch) -> 0, or -1 (shape refused)."""
    width: int
    """Outputs per weight panel (`pack`): the hidden size and twice the expert width must be multiples of it."""
    how: str
    """How it was built, for the start-up line."""


@functools.cache
def load() -> Kernel | str:
    """The kernel, or why it is not here (once per process)."""
    try:
        path, how = native_build.build(SOURCE)
        lib = ctypes.CDLL(str(path))
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        return str(e)
    p, i = ctypes.c_void_p, ctypes.c_int
    fn = lib.moe_experts
    fn.argtypes = [p, i, i, i, i, i, p, p, p, p, i, i, p, p]
    fn.restype = ctypes.c_int
    return Kernel(fn, lib.moe_panel_width(), f"{how}, for {hardware.cpu().family}")


def takes(hidden: int, expert_size: int, weight_dtype: torch.dtype, width: int) -> str | None:
    """None where a kernel of panels `width` wide computes this layer, else why not."""
    if weight_dtype not in DTYPES:
        return f"it reads fp32 or bf16 expert weights, not {str(weight_dtype).removeprefix('torch.')}"
    if hidden % width or 2 * expert_size % width:
        return f"the hidden width ({hidden}) and twice the expert width ({expert_size}) must be multiples of {width}"
    return None


def pack(weight: torch.Tensor, width: int) -> torch.Tensor:
    """The experts' stacked weights [E, N, K] (out, in) -> panels [E, N / width, K, width] (a copy), as the kernel
    reads them."""
    E, N, K = weight.shape
    return weight.view(E, N // width, width, K).transpose(2, 3).contiguous()


def fused_experts(flat: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor,
                  down: torch.Tensor, act: str) -> torch.Tensor:
    """sum over each token's k experts of weight * down(act(gate(x)) * up(x)) -> [T, d] in flat's dtype (act: SiLU,
    else tanh-GELU, as `cpu_moe.activation`), in one kernel call per MAX_COPIES copies. flat [T, d]; weights f32
    [T, k]; experts int64 [T, k]; gate_up [E, 2 I / w, d, w] and down [E, d / w, I, w] in panels (`pack`)."""
    kernel = load()
    if isinstance(kernel, str):
        raise RuntimeError(f"the fused CPU MoE kernel is not built here: {kernel}")
    T, d = flat.shape
    E, _, _, width = gate_up.shape
    I = down.shape[2]
    k = experts.shape[1]
    x = flat.to(torch.float32).contiguous()
    ids = experts.to(torch.int64).contiguous()
    w = weights.to(torch.float32).contiguous()
    out = torch.empty(T, d, dtype=torch.float32)
    step = max(1, MAX_COPIES // k)
    scratch = torch.empty(min(T, step) * k * (3 * I + d), dtype=torch.float32)
    for t in range(0, T, step):
        n = min(step, T - t)
        rc = kernel.fn(x[t].data_ptr(), n, d, I, E, k, ids[t].data_ptr(), w[t].data_ptr(), gate_up.data_ptr(),
                       down.data_ptr(), DTYPES[gate_up.dtype], 0 if act == "silu" else 1, out[t].data_ptr(),
                       scratch.data_ptr())
        if rc:
            raise ValueError(f"the fused CPU MoE kernel refused d {d}, I {I}, k {k} (panels of {width}); serve the "
                             f"model with the loop (its start-up measures it)")
    return out.to(flat.dtype)
