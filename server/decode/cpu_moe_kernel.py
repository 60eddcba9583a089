"""The fused mixture-of-experts step on the CPU (`cpu_moe_kernel.c`): built once per machine with the system's C
compiler, loaded through ctypes, called once per layer and step (`fused_experts`).

One call groups the step's token copies by expert, streams each chosen expert's gate|up and down weights once
over all its rows (4 at a time, the activation between), and writes the routing-weighted sum: no Python per
expert, no gather or scatter tensors, the weights read in place from the experts' stacked tensors
(`cuda_moe.stack_experts`, each expert's `Linear` a view of them), fp32 or bf16 (fp32 math). It is
single-threaded: `cpu_moe.prepare` measures it against the other paths at the worker's thread count.

Built with `-O3` and the instruction set `hardware.cpu()` reports (so `PDSERVE_CPU_ISA` caps it too), into
$PDSERVE_KERNEL_CACHE (default ~/.cache/pdserve/kernels) under a name hashing the source, the flags and the
compiler; a machine without a C compiler (`cc`, or $CC) gets the other paths, said at start-up.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from pdserve.server import hardware

SOURCE = Path(__file__).with_name("cpu_moe_kernel.c")
CACHE_ENV = "PDSERVE_KERNEL_CACHE"
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
"""The expert weight dtypes it reads (the value: the kernel's bf16 flag)."""
LANES = 16
"""Widths (hidden, expert) must be multiples of this (the kernel's vector width on AVX-512; 8 elsewhere)."""


def isa_flags(cpu: hardware.Cpu) -> list[str]:
    """The compiler's target flags for this CPU, after PDSERVE_CPU_ISA's cap."""
    if cpu.arch == "x86_64":
        if cpu.avx512:
            return ["-march=x86-64-v4", "-mprefer-vector-width=512"]
        return ["-march=x86-64-v3"] if cpu.has("avx2", "fma") else []
    return ["-mcpu=native"] if cpu.arch == "aarch64" else []


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc"))


def build(cpu: hardware.Cpu | None = None) -> Path:
    """The kernel's shared library for this CPU, compiled once into the cache (reused while the source, flags and
    compiler stay the same); RuntimeError naming what to do when it cannot be built."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError(f"no C compiler ({os.environ.get('CC', 'cc')} not on PATH): install gcc or clang, or set "
                           f"CC, for the fused CPU MoE step")
    flags = ["-O3", *isa_flags(cpu or hardware.cpu()), "-fno-math-errno", "-fPIC", "-shared"]
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    key = hashlib.sha256("\0".join([SOURCE.read_text(), *flags, version]).encode()).hexdigest()[:16]
    cache = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "pdserve" / "kernels")
    target = cache / f"cpu_moe-{key}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        built = Path(tmp) / target.name
        done = subprocess.run([cc, *flags, "-o", str(built), str(SOURCE)], capture_output=True, text=True,
                              timeout=120)
        if done.returncode:
            raise RuntimeError(f"{cc} could not build {SOURCE.name} ({' '.join(flags)}): {done.stderr.strip()[-400:]}")
        os.replace(built, target)  # atomic: a concurrent start-up finds a whole file or none
    return target


@functools.cache
def load() -> tuple[ctypes._CFuncPtr | None, str]:
    """(the kernel's entry point, how it was built) or (None, why not), once per process."""
    try:
        path = build()
        fn = ctypes.CDLL(str(path)).moe_experts
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        return None, str(e)
    p, i = ctypes.c_void_p, ctypes.c_int
    fn.argtypes = [p, i, i, i, i, i, p, p, p, p, i, i, p, p]
    fn.restype = ctypes.c_int
    return fn, f"built by {_compiler()} for {hardware.cpu().family} ({path.name})"


def takes(hidden: int, expert_size: int, weight_dtype: torch.dtype) -> str | None:
    """None where the kernel computes this layer, else why not."""
    if weight_dtype not in DTYPES:
        return f"it reads fp32 or bf16 expert weights, not {str(weight_dtype).removeprefix('torch.')}"
    if hidden % LANES or expert_size % LANES:
        return f"hidden ({hidden}) and expert ({expert_size}) widths must be multiples of {LANES}"
    return None


def fused_experts(flat: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor,
                  down: torch.Tensor, act: str) -> torch.Tensor:
    """sum over each token's k experts of weight * down(act(gate(x)) * up(x)) -> [T, d] in flat's dtype, in one
    kernel call (act: SiLU, else tanh-GELU, as `cpu_moe.activation`). flat [T, d]; weights f32 [T, k]; experts int64 [T, k]; gate_up [E, 2 I, d]; down [E, d, I]."""
    fn, why = load()
    if fn is None:
        raise RuntimeError(f"the fused CPU MoE kernel is not built here: {why}")
    T, d = flat.shape
    E, two_i, _ = gate_up.shape
    k = experts.shape[1]
    x = flat.to(torch.float32).contiguous()
    ids = experts.to(torch.int64).contiguous()
    w = weights.to(torch.float32).contiguous()
    out = torch.empty(T, d, dtype=torch.float32)
    scratch = torch.empty(T * k * (3 * two_i // 2 + d), dtype=torch.float32)
    rc = fn(x.data_ptr(), T, d, two_i // 2, E, k, ids.data_ptr(), w.data_ptr(), gate_up.data_ptr(), down.data_ptr(),
            DTYPES[gate_up.dtype], 0 if act == "silu" else 1, out.data_ptr(), scratch.data_ptr())
    if rc:
        raise ValueError(f"the fused CPU MoE kernel refused d {d}, I {two_i // 2}, T {T}, k {k} (widths must be "
                         f"multiples of {LANES}); run the loop (cpu_moe 'loop')")
    return out.to(flat.dtype)
