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
  only activations and ids to the host: one `pdserve_onednn_linear` call per matmul, whose output shape is
  static (onednn_native.py: a named XLA FFI target calling torch's C++ ops on the buffers in place, no Python;
  where that library cannot be built, host_call.py's target runs the same ops in Python). Fewer, larger
  calls: q, k and v are held as one packed weight `wqkv` [H, Hq + 2 Hkv, D] (one linear, split in XLA), and
  the MLP is one host call (`OnednnWeights.mlp`:
  gate with the activation fused, up with the product fused, down; oneDNN post-ops), so a layer crosses
  to the host 3 times instead of 7 and the [T, I] intermediates never leave it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from pdserve.server.prefill import host_call, onednn_native

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


PACKED: list = []
"""The prepacked weights ([N, K] bf16 in oneDNN's blocked layout) of the Python ops (host_call.py's, where
onednn_native.py's library is not built), indexed by a `Resident`'s ids: the programs pass ids, never a bank, so a
compiled program is the same in every process."""


def _release(native, ids: list[int]) -> None:
    if isinstance(native, onednn_native.Native):
        native.release(ids)
    else:
        for i in ids:
            PACKED[i] = None


class OnednnWeights:
    """The prefill's dense layer weights prepacked for oneDNN's bf16 linear (torch), one per (weight, layer), held
    while the bank lives: on the C++ side (onednn_native.py: the calls take no GIL), or where that library is not
    built, in `PACKED` for the same ops in Python (host_call.py)."""

    def __init__(self, threads: int | None = None):
        import torch

        self._torch = torch
        self.native = onednn_native.load()
        """onednn_native.Native, or why the calls go through Python."""
        self.ids: list[int] = []
        self.nbytes = 0
        weakref.finalize(self, _release, self.native, self.ids)
        if threads:
            torch.set_num_threads(threads)

    @property
    def without_python(self) -> bool:
        return isinstance(self.native, onednn_native.Native)

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
            if self.without_python:
                ids.append(self.native.hold(dense))
            else:
                PACKED.append(torch.ops.mkldnn._reorder_linear_weight(dense, None))
                ids.append(len(PACKED) - 1)
            self.nbytes += dense.numel() * 2
        self.ids.extend(ids)
        return Resident(jnp.asarray(ids, jnp.int32), tuple(stack.shape[1:]))

    def mlp(self, h: jax.Array, w_gate, w_up, w_down, act: str) -> jax.Array:
        """A `FusedMlp`: h [B, S, H] -> down(act(h @ gate) * (h @ up)) [B, S, H] in one host call, for
        `Resident` weights and an activation oneDNN fuses (POST_OPS); None for any other (the caller's
        matmuls then compute it)."""
        weights = (w_gate, w_up, w_down)
        if act not in POST_OPS or not all(isinstance(w, Resident) for w in weights) or h.dtype != jnp.bfloat16:
            return None
        ids = jnp.stack([w.ids for w in weights])  # [3] (per layer, inside the scan)
        x2d = h.reshape(-1, h.shape[-1])  # [T, H]
        out = jax.ShapeDtypeStruct(x2d.shape, x2d.dtype)  # [T, H]
        if self.without_python:
            y = onednn_native.call("pdserve_onednn_mlp", [x2d, ids], out, act=act)
        else:
            y, = host_call.call("onednn_mlp", act, [x2d, ids], [out])
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
        n = int(np.prod(n_shape))
        out = jax.ShapeDtypeStruct((x2d.shape[0], n), x.dtype)  # [T, N]
        if self.without_python:
            y = onednn_native.call("pdserve_onednn_linear", [x2d, w.ids], out)
        else:
            y, = host_call.call("onednn_linear", "", [x2d, w.ids], [out])
        return y.reshape(*x.shape[:-k], *n_shape)


POST_OPS = {"silu": ("swish", ""), "gelu_tanh": ("gelu", "tanh")}
"""The MLP activations oneDNN fuses into the gate's linear: (post-op, algorithm)."""

CONTRACTED_AXES = {"wq": 1, "wk": 1, "wv": 1, "wo": 2, "w_gate": 1, "w_up": 1, "w_down": 1}
"""Each dense weight's contracted leading axes (of one layer's weight), as prefill.quant's CONTRACTED."""

def linear(inputs: list, outputs: list, param: str) -> None:
    """On the host: x bf16 [T, K] @ packed weight `index` -> y bf16 [T, N] (oneDNN, fp32 accumulation)."""
    import torch

    (x, index), (y,) = inputs, outputs
    y.copy_(torch.ops.mkldnn._linear_pointwise(x, PACKED[int(index)], None, "none", [], ""))


def mlp(inputs: list, outputs: list, act: str) -> None:
    """On the host: y = down(act(x @ gate) * (x @ up)) for x bf16 [T, H], ids int32 [3] (gate, up, down), the
    activation and the product fused into the linears (oneDNN post-ops)."""
    import torch

    linear = torch.ops.mkldnn._linear_pointwise
    (x, ids), (y,) = inputs, outputs
    gate_id, up_id, down_id = (int(i) for i in ids)
    attr, algorithm = POST_OPS[act]
    gate = linear(x, PACKED[gate_id], None, attr, [], algorithm)  # [T, I]
    hidden = linear.binary(x, gate, PACKED[up_id], None, "mul")  # [T, I]
    y.copy_(linear(hidden, PACKED[down_id], None, "none", [], ""))  # [T, H]


host_call.register("onednn_linear", linear)
host_call.register("onednn_mlp", mlp)
