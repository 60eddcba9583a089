"""The onednn-bf16 prefill's host work without Python: named XLA FFI targets (onednn_native.cc) that call torch's
C++ ops directly, the prepacked weights held on the C++ side by id.

A program names "pdserve_onednn_linear", "pdserve_onednn_mlp" or "pdserve_host_attention" with plain attributes,
so JAX's persistent cache keeps it (as host_call.py's target), and a call takes no GIL: a prefill worker's Python
threads (the gRPC server, the KV streams to the decode tier) never hold up its layers, nor do they wait on it.

The library is built once per machine (native_build.py) against torch's headers and libraries (the versions in its
cache key); where it cannot be built (no C++ compiler, a torch without its headers), `load` says why and
matmul.py/host_attention.py call the same ops through host_call.py (Python, under the GIL).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np

from pdserve.server import native_build
from pdserve.server.native_build import NativeSource, portable
from pdserve.server.prefill.host_call import _ffi_flags

log = logging.getLogger("pdserve.prefill")

SOURCE = NativeSource(Path(__file__).with_name("onednn_native.cc"), portable, cxx=True, extra=lambda: _flags())
TARGETS = ("pdserve_onednn_linear", "pdserve_onednn_mlp", "pdserve_host_attention")


@dataclass(frozen=True)
class Native:
    lib: ctypes.CDLL

    def hold(self, dense) -> int:
        """A dense bf16 torch weight [N, K] (out, in) prepacked and held on the C++ side -> its id."""
        dense = dense.contiguous()
        error = ctypes.create_string_buffer(1024)
        i = self.lib.pdserve_hold_weight(dense.data_ptr(), dense.shape[0], dense.shape[1], error, len(error))
        if i < 0:
            raise RuntimeError(f"oneDNN could not prepack a [{dense.shape[0]}, {dense.shape[1]}] bf16 weight: "
                               f"{error.value.decode()}; serve with --prefill-matmul xla-bf16")
        return i

    def release(self, ids: list[int]) -> None:
        for i in ids:
            self.lib.pdserve_release_weight(i)


def _flags() -> tuple[list[str], list[str]]:
    """(compile and link flags, versions) for building against jaxlib's FFI headers and this process's torch."""
    import torch
    from torch.utils import cpp_extension

    flags, versions = _ffi_flags()
    lib_dir = cpp_extension.library_paths()[0]
    flags += [f"-I{p}" for p in cpp_extension.include_paths()]
    flags += [f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", f"-L{lib_dir}", "-ltorch_cpu",
              "-lc10", f"-Wl,-rpath,{lib_dir}"]
    return flags, [*versions, torch.__version__]


@functools.cache
def load() -> Native | str:
    """The targets registered (once per process), or why not (logged once: the ops then run through Python)."""
    try:  # (_flags imports torch: its libraries are loaded before ours, which link against them)
        lib = ctypes.CDLL(str(native_build.build(SOURCE)[0]))
    except (ImportError, RuntimeError, OSError, subprocess.SubprocessError) as e:
        why = f"the oneDNN host calls run through Python (under the GIL): {SOURCE.path.name} is not built here ({e})"
        log.warning("%s", why)
        return why
    lib.pdserve_hold_weight.restype = ctypes.c_int64
    lib.pdserve_hold_weight.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_char_p,
                                        ctypes.c_int64]
    lib.pdserve_release_weight.argtypes = [ctypes.c_int64]
    for name in TARGETS:
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, name)), platform="cpu")
    return Native(lib)


def call(target: str, args: list, out: jax.ShapeDtypeStruct, **attrs) -> jax.Array:
    """One call of `target` (load() must have succeeded) from a jitted program; attrs: its attributes."""
    attrs = {k: np.float32(v) if isinstance(v, float) else v for k, v in attrs.items()}
    return jax.ffi.ffi_call(target, out)(*args, **attrs)
