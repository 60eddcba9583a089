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
  whose output shape is static. Fewer, larger calls: q, k and v are held as one packed weight `wqkv`
  [H, Hq + 2 Hkv, D] (one linear, split in XLA), and the MLP is one host call (`OnednnWeights.mlp`:
  gate with the activation fused, up with the product fused, down; oneDNN post-ops), so a layer crosses
  to the host 3 times instead of 7 and the [T, I] intermediates never leave it.
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
        """The layer params with each dense weight [L, ...] moved here (bf16) and a `Resident` in its place;
        wq, wk, wv become one `wqkv` [L, H, Hq + 2 Hkv, D] (the model splits its result)."""
        out = dict(layers)
        if all(name in layers for name in ("wq", "wk", "wv")):
            qkv = np.concatenate([np.asarray(layers[n].astype(F32)) for n in ("wq", "wk", "wv")], axis=2)
            out["wqkv"] = self.hold(qkv, 1)
            del out["wq"], out["wk"], out["wv"]
        for name in DENSE:
            if name in out and not isinstance(out[name], Resident):
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

    def mlp_host(self, x: np.ndarray, ids: np.ndarray, act: str) -> np.ndarray:
        """On the host: down(act(x @ gate) * (x @ up)) for x bf16 [T, H], ids int32 [3] (gate, up, down)
        -> bf16 [T, H]; the activation and the product fused into the linears (oneDNN post-ops)."""
        torch = self._torch
        linear = torch.ops.mkldnn._linear_pointwise
        xt = torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).view(torch.bfloat16)
        gate_id, up_id, down_id = (int(i) for i in ids)
        attr, algorithm = POST_OPS[act]
        gate = linear(xt, self.packed[gate_id], None, attr, [], algorithm)  # [T, I]
        hidden = linear.binary(xt, gate, self.packed[up_id], None, "mul")  # [T, I]
        y = linear(hidden, self.packed[down_id], None, "none", [], "")  # [T, H]
        return y.view(torch.int16).numpy().view(ml_dtypes.bfloat16)

    def mlp(self, h: jax.Array, w_gate, w_up, w_down, act: str) -> jax.Array:
        """A `FusedMlp`: h [B, S, H] -> down(act(h @ gate) * (h @ up)) [B, S, H] in one host call, for
        `Resident` weights and an activation oneDNN fuses (POST_OPS); None for any other (the caller's
        matmuls then compute it)."""
        weights = (w_gate, w_up, w_down)
        if act not in POST_OPS or not all(isinstance(w, Resident) for w in weights) or h.dtype != jnp.bfloat16:
            return None
        ids = jnp.stack([w.ids for w in weights])  # [3] (per layer, inside the scan)
        x2d = h.reshape(-1, h.shape[-1])  # [T, H]
        y = onednn_mlp_p.bind(x2d, ids, bank=self, act=act)  # [T, H]
        return y.reshape(h.shape)

    def kernels(self, host_attention: bool = False):
        """The `Kernels` the model runs with these weights: this bank's matmul and fused MLP, and the host's
        attention (host_attention.py) where `host_attention`, else XLA's."""
        from pdserve.server.prefill.host_attention import host_attention as on_host
        from pdserve.server.prefill.kernels import Kernels

        return Kernels(matmul=self.matmul, mlp=self.mlp, **({"attention": on_host} if host_attention else {}))

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


POST_OPS = {"silu": ("swish", ""), "gelu_tanh": ("gelu", "tanh")}
"""The MLP activations oneDNN fuses into the gate's linear: (post-op, algorithm)."""

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

onednn_mlp_p = Primitive("pdserve_onednn_mlp")
"""x bf16 [T, H], ids int32 [3] -> bf16 [T, H]: `OnednnWeights.mlp_host` of `bank` (CPU backend only)."""
onednn_mlp_p.def_abstract_eval(lambda x, ids, *, bank, act: jax.core.ShapedArray(x.shape, x.dtype))


def _lower_onednn_mlp(ctx, x, ids, *, bank: OnednnWeights, act: str):
    def host(x: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray]:
        return (bank.mlp_host(x, ids, act),)

    result, _, _ = emit_python_callback(ctx, host, None, [x, ids], ctx.avals_in, ctx.avals_out,
                                        has_side_effect=False, returns_token=False)
    return result


mlir.register_lowering(onednn_mlp_p, _lower_onednn_mlp, platform="cpu", cacheable=False)
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")  # read only, never written
