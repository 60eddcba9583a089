"""The prefill model's matmuls, chosen at load and handed to the model (model.py stays pure math).

A `Matmul` is called as matmul(spec, x, w) for every layer's linear: an einsum spec whose contracted
axes are x's trailing and w's leading ones ("bsh,hnd->bsnd"), x in the compute dtype, the result in
x's dtype, accumulated in fp32.

- `xla_matmul`: `jnp.einsum` with fp32 accumulation; XLA compiles it for its backend (every path's
  fallback, and the only one on TPU and GPU).
- `OnednnWeights.matmul`: oneDNN's bf16 linear through torch (AMX or AVX512-bf16 where the CPU has them,
  fp32 accumulation). The layers' dense weights live on the torch side, prepacked once into oneDNN's
  blocked layout (`OnednnWeights.take`); the params keep only a `Resident` handle per weight (its
  per-layer ids, so `lax.scan` and layer groups slice it as any weight), and the jitted program passes
  only activations to the host: one `onednn_linear` primitive per matmul, lowered to a host callback
  whose output shape is static.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax._src.callback import emit_python_callback
from jax.extend.core import Primitive
from jax.interpreters import mlir

F32 = jnp.float32
Matmul = Callable[[str, jax.Array, jax.Array], jax.Array]
DENSE = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
"""The layer weights a resident path holds (an MoE model's experts and router stay in XLA)."""


def xla_matmul(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.einsum(spec, x, w, preferred_element_type=F32).astype(x.dtype)


@jax.tree_util.register_pytree_node_class
@dataclass(frozen=True)
class Resident:
    """A weight held outside JAX: ids int32 [L] (one per layer; a scan step sees a scalar), and one
    layer's weight shape, e.g. (H, Hq, D) for wq."""

    ids: jax.Array
    shape: tuple[int, ...]

    def tree_flatten(self):
        return (self.ids,), self.shape

    @classmethod
    def tree_unflatten(cls, shape, children):
        return cls(children[0], shape)


def contraction(spec: str, x_ndim: int, w_ndim: int) -> int:
    """How many of x's trailing axes (= w's leading ones) the spec contracts; ValueError for another spec."""
    inputs, out = spec.replace(" ", "").split("->")
    xs, ws = inputs.split(",")
    contracted = [c for c in xs if c in ws and c not in out]
    k = len(contracted)
    if (len(xs), len(ws)) != (x_ndim, w_ndim) or not k or xs[-k:] != ws[:k] or out != xs[:-k] + ws[k:]:
        raise ValueError(f"matmul spec {spec!r} does not contract x's trailing axes with w's leading ones")
    return k


class OnednnWeights:
    """The prefill's dense layer weights prepacked for oneDNN's bf16 linear (torch), one per (weight, layer)."""

    def __init__(self, threads: int | None = None):
        import torch

        self._torch = torch
        self.packed: list = []
        """[N, K] bf16 weights in oneDNN's blocked layout, indexed by a Resident's ids."""
        self.nbytes = 0
        if threads:
            torch.set_num_threads(threads)

    def take(self, layers: dict[str, jax.Array]) -> dict:
        """The layer params with each dense weight [L, ...] moved here (bf16) and a `Resident` in its place."""
        out = dict(layers)
        for name in DENSE:
            if name in layers:
                out[name] = self.hold(np.asarray(layers[name].astype(F32)), CONTRACTED_AXES[name])
        return out

    def hold(self, stack: np.ndarray, k: int) -> Resident:
        """A stack of weights [L, K..., N...] whose k leading axes (after L) are contracted -> its handle."""
        torch = self._torch
        ids = []
        for w in stack:
            k2d = w.reshape(int(np.prod(w.shape[:k])), -1)  # [K, N]
            dense = torch.from_numpy(np.ascontiguousarray(k2d.T, np.float32)).to(torch.bfloat16)  # [N, K]
            self.packed.append(torch.ops.mkldnn._reorder_linear_weight(dense, None))
            self.nbytes += dense.numel() * 2
            ids.append(len(self.packed) - 1)
        return Resident(jnp.asarray(ids, jnp.int32), tuple(stack.shape[1:]))

    def linear(self, x: np.ndarray, index: np.ndarray) -> np.ndarray:
        """On the host: x bf16 [T, K] @ weight `index` -> bf16 [T, N] (oneDNN, fp32 accumulation)."""
        torch = self._torch
        xt = torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).view(torch.bfloat16)
        y = torch.ops.mkldnn._linear_pointwise(xt, self.packed[int(index)], None, "none", [], "")
        return y.view(torch.int16).numpy().view(ml_dtypes.bfloat16)

    def matmul(self, spec: str, x: jax.Array, w) -> jax.Array:
        """A `Matmul`: oneDNN for a `Resident` weight, XLA for any other."""
        if not isinstance(w, Resident):
            return xla_matmul(spec, x, w)
        if x.dtype != jnp.bfloat16:
            raise ValueError(f"the onednn-bf16 prefill matmul takes bf16 activations, not {x.dtype}")
        k = contraction(spec, x.ndim, len(w.shape))
        n_shape = w.shape[k:]
        x2d = x.reshape(-1, int(np.prod(x.shape[-k:])))  # [T, K]
        y = onednn_linear_p.bind(x2d, w.ids, bank=self, n=int(np.prod(n_shape)))  # [T, N]
        return y.reshape(*x.shape[:-k], *n_shape)


CONTRACTED_AXES = {"wq": 1, "wk": 1, "wv": 1, "wo": 2, "w_gate": 1, "w_up": 1, "w_down": 1}
"""Each dense weight's contracted leading axes (of one layer's weight), as prefill.quant's CONTRACTED."""

onednn_linear_p = Primitive("pdserve_onednn_linear")
"""x bf16 [T, K], index int32 [] -> bf16 [T, N]: weight `index` of `bank`, on the host (CPU backend only)."""
onednn_linear_p.def_abstract_eval(lambda x, index, *, bank, n: jax.core.ShapedArray((x.shape[0], n), x.dtype))


def _lower_onednn_linear(ctx, x, index, *, bank: OnednnWeights, n: int):
    # Not jax.pure_callback: its implementation device_puts the arguments and reads them back, which can
    # wait on XLA:CPU's own thread pool from inside the running program (a deadlock on one core).
    def host(x: np.ndarray, index: np.ndarray) -> tuple[np.ndarray]:
        return (bank.linear(x, index),)

    result, _, _ = emit_python_callback(ctx, host, None, [x, index], ctx.avals_in, ctx.avals_out,
                                        has_side_effect=False, returns_token=False)
    return result


mlir.register_lowering(onednn_linear_p, _lower_onednn_linear, platform="cpu", cacheable=False)
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")  # read only, never written
