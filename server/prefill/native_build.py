"""The prefill's C++ sources (host_call.cc, onednn_native.cc) built once per machine with the C++ compiler (`c++`, or
$CXX) against jaxlib's FFI headers, into $PDSERVE_KERNEL_CACHE (default ~/.cache/pdserve/kernels) under a name
hashing the source, the flags, the compiler and the versions it builds against (reused while they stay the same)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

CACHE_ENV = "PDSERVE_KERNEL_CACHE"


def compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "c++"))


def build(source: Path, flags: list[str] = (), versions: list[str] = ()) -> Path:
    """`source`'s shared library, compiled once into the cache with `flags` after the source (include and link
    flags); RuntimeError naming what to do when it cannot be built."""
    import jax
    import jaxlib

    cxx = compiler()
    if cxx is None:
        raise RuntimeError(f"no C++ compiler ({os.environ.get('CXX', 'c++')} not on PATH): install g++ or clang++, "
                           f"or set CXX")
    flags = ["-O2", "-std=c++17", "-fPIC", "-shared", f"-I{jax.ffi.include_dir()}", *flags]
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    key = hashlib.sha256("\0".join([source.read_text(), *flags, version, jaxlib.__version__, *versions]).encode())
    cache = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "pdserve" / "kernels")
    target = cache / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        built = Path(tmp) / target.name
        done = subprocess.run([cxx, "-o", str(built), str(source), *flags], capture_output=True, text=True,
                              timeout=600)
        if done.returncode:
            raise RuntimeError(f"{cxx} could not build {source.name}: {done.stderr.strip()[-400:]}")
        os.replace(built, target)  # atomic: a concurrent start-up finds a whole file or none
    return target
