"""Tensor parallelism for the prefill model over a 1-D device mesh (axis "tp"), Megatron style.

q/k/v and gate/up are split by output (heads, intermediate), o and down by input, so each device
runs whole heads and XLA inserts one all-reduce after attention and one after the MLP. The lm_head
is split over the vocabulary when it divides; embeddings, norms and o/down biases are replicated.
The model code is unchanged: jit the same prefill and pass it sharded params; activations and the
KV (split over kv heads) follow the params' shardings, and `np.asarray` gathers a batch's KV to the host.

`start_distributed` joins a multi-host slice through `jax.distributed` before the mesh is made, so the
mesh spans every process's devices (see README, "Prefill on a device mesh").
"""

from __future__ import annotations

import os

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


def start_distributed(coordinator_address: str | None, num_processes: int | None, process_id: int | None) -> bool:
    """Joins a multi-host slice (`jax.distributed.initialize`) when a coordinator address is given (or
    JAX_COORDINATOR_ADDRESS is set); num_processes / process_id left None are auto-detected on TPU
    slices. Must run before anything touches a device. Returns whether it joined."""
    if coordinator_address is None and not os.environ.get("JAX_COORDINATOR_ADDRESS") and not num_processes:
        return False
    jax.distributed.initialize(coordinator_address, num_processes, process_id)
    return True


def _unsplittable(config: ModelConfig, tp: int) -> list[str]:
    return [f"{what} ({n})" for what, n in (("num_kv_heads", config.num_kv_heads),
                                            ("intermediate_size", config.intermediate_size)) if n % tp]


def default_size(config: ModelConfig, num_devices: int | None = None) -> int:
    """The default --tensor-parallel-size: all devices, or the most of them that split the model's kv
    heads and intermediate size evenly (a model with 2 kv heads on 8 chips runs on 2)."""
    n = len(jax.devices()) if num_devices is None else num_devices
    return max(tp for tp in range(1, n + 1) if not _unsplittable(config, tp))


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
    if bad := _unsplittable(config, tp):
        fits = [n for n in range(1, len(jax.devices()) + 1) if not _unsplittable(config, n)]
        raise ValueError(f"tensor parallelism {tp} must divide the model's {' and '.join(bad)}: each device "
                         f"holds whole kv heads; use --tensor-parallel-size {' or '.join(map(str, fits))}")
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
