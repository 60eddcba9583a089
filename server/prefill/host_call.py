"""The prefill's calls to the host from a jitted program (the CPU backend's onednn-bf16 path), as one named XLA FFI
target, so the compiled program can be kept in JAX's persistent compilation cache.

A host call is `call(name, param, args, out)`: an op registered here by name (`register`: fn(inputs, outputs,
param) writing its results into `outputs`, torch tensors over XLA's own buffers) and a string parameter. The
program names the target "pdserve_host_call" with the attribute op = "name param", never a Python object: a Python
callback's address in the program (jax's `emit_python_callback`) keeps JAX from caching it, so a bf16 prefill
worker compiled its host-calling programs at every start.

The target's handler (host_call.cc) is built once per machine (native_build.py); at load it is given a function
(ctypes) that runs the op in Python, on the buffers in place (no copy either way). The onednn-bf16 prefill calls
onednn_native.py's targets instead, which run without Python (no GIL on the call path): these ops are their
fallback where torch's C++ library cannot be built against. Where this handler cannot be built either (no C++
compiler), the calls lower to Python callbacks as before (`load` says why, logged once): the same ops, and
programs compiled at every start.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import subprocess
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import numpy as np
from jax._src.callback import emit_python_callback
from jax.extend.core import Primitive
from jax.interpreters import mlir

from pdserve.server import native_build
from pdserve.server.native_build import NativeSource, portable

log = logging.getLogger("pdserve.prefill")

TARGET = "pdserve_host_call"
def _ffi_flags() -> tuple[list[str], list[str]]:
    """(flags, versions) for building against jaxlib's XLA FFI headers."""
    import jaxlib

    return ["-std=c++17", f"-I{jax.ffi.include_dir()}"], [jaxlib.__version__]


SOURCE = NativeSource(Path(__file__).with_name("host_call.cc"), portable, cxx=True, extra=_ffi_flags)
Op = Callable[[list, list, str], None]
"""fn(inputs, outputs, param): torch tensors over the call's argument and result buffers; writes every output."""
OPS: dict[str, Op] = {}

_XLA_DTYPES = {1: "bool", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "uint8", 10: "float16", 11: "float32",
               12: "float64", 16: "bfloat16"}
"""XLA's element type numbers (ffi::DataType) -> torch dtype names."""


def register(name: str, fn: Op) -> None:
    """Registers op `name` (no spaces) for `call`."""
    if " " in name:
        raise ValueError(f"host call op names hold no spaces: {name!r}")
    OPS[name] = fn


host_call_p = Primitive("pdserve_host_call")
"""*args -> the results of op `name` with `param` on the host, shapes given by `out_avals` (CPU backend only)."""
host_call_p.multiple_results = True
host_call_p.def_abstract_eval(lambda *args, name, param, out_avals: list(out_avals))


def call(name: str, param: str, args: Sequence[jax.Array], out: Sequence[jax.ShapeDtypeStruct]) -> list:
    """The results (shapes and dtypes `out`) of op `name` (`register`) on `args`, computed on the host from inside a
    jitted program."""
    avals = tuple(jax.core.ShapedArray(o.shape, o.dtype) for o in out)
    return host_call_p.bind(*args, name=name, param=param, out_avals=avals)


def _lower(ctx, *args, name: str, param: str, out_avals):
    if (why := load()) is None:
        return jax.ffi.ffi_lowering(TARGET)(ctx, *args, op=f"{name} {param}")

    def host(*arrays: np.ndarray) -> tuple[np.ndarray, ...]:
        import torch

        outputs = tuple(np.empty(a.shape, a.dtype) for a in ctx.avals_out)
        as_torch = lambda a: torch.from_numpy(np.ascontiguousarray(a).view(_int_like(a.dtype))).view(  # noqa: E731
            getattr(torch, str(a.dtype)))
        OPS[name]([as_torch(a) for a in arrays], [as_torch(a) for a in outputs], param)
        return outputs

    del why  # logged once by load()
    result, _, _ = emit_python_callback(ctx, host, None, list(args), ctx.avals_in, ctx.avals_out,
                                        has_side_effect=False, returns_token=False)
    return result


mlir.register_lowering(host_call_p, _lower, platform="cpu", cacheable=False)  # (the callback fallback is not)
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")  # the fallback's inputs: read only


def _int_like(dtype: np.dtype) -> np.dtype:
    """A numpy dtype torch.from_numpy takes, of dtype's width (bf16 has none in numpy's set torch reads)."""
    return np.dtype(f"int{dtype.itemsize * 8}") if dtype.kind == "V" or str(dtype) == "bfloat16" else dtype


_HOST_FN = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                            ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int64), ctypes.c_void_p,
                            ctypes.c_int64)


def _run(op: int, op_len: int, n_args: int, count: int, buffers, meta, error: int, error_len: int) -> int:
    """The handler's host function: runs the op on the call's buffers; 0, or 1 with the error written."""
    try:
        name, _, param = ctypes.string_at(op, op_len).decode().partition(" ")
        tensors, at = [], 0
        for i in range(count):
            dtype, rank = meta[at], meta[at + 1]
            shape = tuple(meta[at + 2 : at + 2 + rank])
            at += 2 + rank
            tensors.append(_tensor(buffers[i], dtype, shape))
        OPS[name](tensors[:n_args], tensors[n_args:], param)
        return 0
    except Exception as e:  # noqa: BLE001 -- reported through XLA, which raises it in the caller
        message = f"{type(e).__name__}: {e}".encode()[:error_len]
        ctypes.memmove(error, message, len(message))
        return 1


def _tensor(pointer: int | None, xla_dtype: int, shape: tuple[int, ...]):
    """A torch tensor over `pointer`'s buffer of XLA element type `xla_dtype`, in place."""
    dtype, width = _torch_dtype(xla_dtype)
    nbytes = math.prod(shape) * width
    if nbytes == 0 or not pointer:
        return _torch().empty(shape, dtype=dtype)
    return _torch().frombuffer((ctypes.c_byte * nbytes).from_address(pointer), dtype=dtype).view(shape)


@functools.cache
def _torch_dtype(xla_dtype: int) -> tuple:
    """(torch dtype, its width in bytes) of XLA's element type number; KeyError for one no op takes."""
    torch = _torch()
    dtype = getattr(torch, _XLA_DTYPES[xla_dtype])
    return dtype, torch.empty((), dtype=dtype).element_size()


@functools.cache
def _torch():
    import torch

    return torch


_host_fn = _HOST_FN(_run)  # kept alive for the process: the handler holds its address


@functools.cache
def load() -> str | None:
    """Registers the FFI target (once per process); None, or why the host calls fall back to Python callbacks."""
    try:
        lib = ctypes.CDLL(str(native_build.build(SOURCE)[0]))
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        why = f"the host calls' FFI handler is not built here ({e}): they run as Python callbacks, and the prefill's " \
              f"programs that call the host compile at every start (not kept in the compilation cache)"
        log.warning("%s", why)
        return why
    lib.pdserve_set_host_fn.argtypes = [_HOST_FN]
    lib.pdserve_set_host_fn(_host_fn)
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.pdserve_host_call), platform="cpu")
    return None
