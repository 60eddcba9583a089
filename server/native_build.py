"""The C kernels pdserve loads with ctypes: built once per machine with its compiler, or found prebuilt.

A kernel is a `NativeSource`: one C (or C++) file and the instruction-set variants it may be built for (`variants(cpu)`,
the best this CPU runs first). `build` returns its shared library:
1. prebuilt: `$PDSERVE_PREBUILT_KERNELS` (the images set it) holding a library for this source and one of the
   CPU's variants, so a container without a compiler still runs the kernel (the best variant found is taken);
2. else compiled with `cc` (or `$CC`; C++: `c++`, `$CXX`) for the best variant into `$PDSERVE_KERNEL_CACHE` (default
   ~/.cache/pdserve/kernels), under a name hashing the source, the flags and the compiler: reused while they stay;
3. else RuntimeError saying what to install or set.

`python -m pdserve.server.native_build --prebuild DIR` builds every variant of every kernel that runs on this
architecture into DIR (the images' build stage runs it; the runtime stage has no compiler).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pdserve.server import hardware

CACHE_ENV = "PDSERVE_KERNEL_CACHE"
PREBUILT_ENV = "PDSERVE_PREBUILT_KERNELS"
KERNELS = {"cpu_moe": "pdserve.server.decode.cpu_moe_kernel"}
"""Every kernel `--prebuild` builds: its name -> the module whose SOURCE (a NativeSource) it is."""
COMMON_FLAGS = ("-O3", "-fno-math-errno", "-fPIC", "-shared")


def isa_variants(cpu: hardware.Cpu) -> list[list[str]]:
    """The target flags a CPU runs, best first (after PDSERVE_CPU_ISA's cap): x86-64-v4 with 512-bit vectors
    where AVX-512 is, v3 where AVX2 and FMA are, the baseline always (aarch64: this CPU's own, then the baseline;
    `--prebuild` skips what names the build machine's CPU)."""
    if cpu.arch == "aarch64":
        return [["-mcpu=native"], []]
    if cpu.arch != "x86_64":
        return [[]]
    out = [["-march=x86-64-v4", "-mprefer-vector-width=512"]] if cpu.avx512 else []
    return out + ([["-march=x86-64-v3"]] if cpu.has("avx2", "fma") else []) + [[]]


def portable(cpu: hardware.Cpu) -> list[list[str]]:
    """One variant for every CPU: code whose speed is not in its loops (a dispatch shim)."""
    return [[]]


@dataclass(frozen=True)
class NativeSource:
    path: Path
    variants: Callable[[hardware.Cpu], list[list[str]]] = isa_variants
    """Target flags this CPU may run the kernel built with, best first; the last one must be portable."""
    cxx: bool = False
    """C++ (`c++`, or $CXX), not C."""
    extra: Callable[[], tuple[list[str], list[str]]] = lambda: ([], [])
    """(more flags, placed after the source: include and link flags; the versions of what they build against),
    asked for when building or naming: both go into the library's name."""

    @property
    def stem(self) -> str:
        return self.path.stem

    def library_name(self, flags: list[str], compiler: str = "") -> str:
        """The library's file name: the source and flags hashed (and the compiler's version, for a local build)."""
        more, versions = self.extra()
        text = "\0".join([self.path.read_text(), *COMMON_FLAGS, *flags, *more, *versions, compiler])
        return f"{self.stem}-{hashlib.sha256(text.encode()).hexdigest()[:16]}.so"

    def compiler_name(self) -> str:
        return os.environ.get("CXX", "c++") if self.cxx else os.environ.get("CC", "cc")


def compiler(source: NativeSource | None = None) -> str | None:
    return shutil.which(source.compiler_name() if source else os.environ.get("CC", "cc"))


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "pdserve" / "kernels")


def build(source: NativeSource, cpu: hardware.Cpu | None = None) -> tuple[Path, str]:
    """(the library, how it came: "prebuilt ..." or "built by ...") for this CPU; RuntimeError naming what to do
    when there is neither a prebuilt library nor a compiler."""
    cpu = cpu or hardware.cpu()
    variants = source.variants(cpu)
    prebuilt = os.environ.get(PREBUILT_ENV)
    if prebuilt:
        for flags in variants:
            path = Path(prebuilt) / source.library_name(flags)
            if path.exists():
                return path, f"prebuilt for {' '.join(flags) or 'the baseline'} ({path})"
    cc = compiler(source)
    if cc is None:
        where = f"none in ${PREBUILT_ENV} ({prebuilt}) for this CPU" if prebuilt else f"${PREBUILT_ENV} unset"
        kind, tools, env = ("C++", "g++ or clang++", "CXX") if source.cxx else ("C", "gcc or clang", "CC")
        raise RuntimeError(f"no {kind} compiler ({source.compiler_name()} not on PATH) and no prebuilt {source.stem} "
                           f"({where}): install {tools}, or set {env}, or prebuild with `python -m "
                           f"pdserve.server.native_build --prebuild DIR` and set {PREBUILT_ENV}=DIR")
    flags = variants[0]
    target = cache_dir() / source.library_name(flags, _version(cc))
    if not target.exists():
        compile_into(source, flags, cc, target)
    return target, f"built by {cc} {' '.join(flags)} ({target.name})"


def compile_into(source: NativeSource, flags: list[str], cc: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        cmd = [cc, *COMMON_FLAGS, *flags, "-o", str(built), str(source.path), *source.extra()[0]]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if done.returncode:
            raise RuntimeError(f"{cc} could not build {source.path.name} ({' '.join(flags)}): "
                               f"{done.stderr.strip()[-400:]}")
        os.replace(built, target)  # atomic: a concurrent start-up finds a whole file or none


def _version(cc: str) -> str:
    return subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.split("\n")[0]


def prebuild(out: Path, names: list[str] | None = None) -> list[Path]:
    """Every variant of the named kernels (all by default) this architecture runs, built into `out`."""
    every = hardware.read_cpu("flags : avx2 fma avx512f avx512bw avx512vl avx512dq\n", hardware.cpu().arch, cap="")
    built = []
    for name in names or list(KERNELS):
        source: NativeSource = importlib.import_module(KERNELS[name]).SOURCE
        cc = compiler(source)
        if cc is None:
            raise SystemExit(f"--prebuild {name} needs a compiler ({source.compiler_name()} not on PATH): install "
                             f"build-essential")
        for flags in source.variants(every):
            if any("native" in f for f in flags):
                continue
            target = out / source.library_name(flags)
            compile_into(source, flags, cc, target)
            print(f"{name}: {' '.join(flags) or 'baseline'} -> {target}", flush=True)
            built.append(target)
    return built


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdserve.server.native_build", description=__doc__.split("\n")[0])
    ap.add_argument("--prebuild", type=Path, required=True, metavar="DIR",
                    help=f"build every variant of the kernels into DIR (point {PREBUILT_ENV} at it where they run)")
    ap.add_argument("--kernel", action="append", choices=sorted(KERNELS), help="only these (default: all)")
    args = ap.parse_args(argv)
    prebuild(args.prebuild, args.kernel)
    return 0


if __name__ == "__main__":
    sys.exit(main())
