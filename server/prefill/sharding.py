"""Tensor parallelism for the prefill model over a 1-D device mesh (axis "tp"), Megatron style.

q/k/v and gate/up are split by output (heads, intermediate), o and down by input, so each device
runs whole heads and XLA inserts one all-reduce after attention and one after the MLP. The lm_head
is split over the vocabulary when it divides; embeddings, norms and o/down biases are replicated.
The model code is unchanged: jit the same prefill and pass it sharded params.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pdserve.server.model.config import ModelConfig
from pdserve.server.prefill.model import Params

AXIS = "tp"

_LAYER_SPECS = {
    "wq": P(None, None, AXIS, None),  # [L, H, Hq, D]
    "wk": P(None, None, AXIS, None),  # [L, H, Hkv, D]
    "wv": P(None, None, AXIS, None),  # [L, H, Hkv, D]
    "bq": P(None, AXIS, None),  # [L, Hq, D]
    "bk": P(None, AXIS, None),  # [L, Hkv, D]
    "bv": P(None, AXIS, None),  # [L, Hkv, D]
    "wo": P(None, AXIS, None, None),  # [L, Hq, D, H]
    "w_gate": P(None, None, AXIS),  # [L, H, I]
    "w_up": P(None, None, AXIS),  # [L, H, I]
    "w_down": P(None, AXIS, None),  # [L, I, H]
}


def make_mesh(num_devices: int | None = None) -> Mesh:
    """A 1-D "tp" mesh over the first num_devices devices (all of them by default)."""
    devices = jax.devices()
    n = len(devices) if num_devices is None else num_devices
    if not 1 <= n <= len(devices):
        raise ValueError(f"a mesh of {n} devices was asked for; {len(devices)} are present")
    return Mesh(np.array(devices[:n]), (AXIS,))


def param_specs(params: Params, mesh: Mesh, config: ModelConfig) -> dict:
    """The PartitionSpec of every param (same tree structure as params)."""
    tp = mesh.shape[AXIS]
    for what, n in (("num_kv_heads", config.num_kv_heads), ("intermediate_size", config.intermediate_size)):
        if n % tp:
            raise ValueError(f"tensor parallelism {tp} must divide the model's {what} ({n})")
    specs = {name: P() for name in params if name != "layers"}
    specs["layers"] = {name: _LAYER_SPECS.get(name, P()) for name in params["layers"]}
    if "lm_head" in params and config.vocab_size % tp == 0:
        specs["lm_head"] = P(AXIS, None)  # [V, H]
    return specs


def shard_params(params: Params, mesh: Mesh, config: ModelConfig) -> Params:
    """params placed on the mesh, split for tensor parallelism (see the module docstring)."""
    specs = param_specs(params, mesh, config)
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=is_spec)
    return jax.device_put(params, shardings)
