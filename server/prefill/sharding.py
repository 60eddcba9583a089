"""Tensor and expert parallelism for the prefill model over a 2-D device mesh (axes "ep" x "tp"), Megatron style.

q/k/v and gate/up are split by output (heads, intermediate), o and down by input over "tp", so each device
runs whole heads and XLA inserts one all-reduce after attention and one after the MLP. The lm_head
is split over the vocabulary when it divides; embeddings, norms and o/down biases are replicated.
A mixture-of-experts model's experts are split over both axes ("ep" and "tp" together: each of the ep x tp
devices holds num_experts / (ep x tp) whole experts, vLLM's EP = TP x DP), the router is replicated. The
attention and dense weights are replicated over "ep": every ep group computes the same heads, so an expert
axis is the way to hold more experts' weights apart than the kv heads let tensor parallelism split
(`--expert-parallel-size`; 1, a 1 x tp mesh, is plain tensor parallelism with the experts over tp). XLA
splits the grouped matmul (`jax.lax.ragged_dot`) by expert: each device multiplies only its experts' rows and
one all-reduce sums the [T k, H] outputs; no expert weight moves (tests/prefill/test_expert_parallel.py).
The model code is unchanged: jit the same prefill and pass it sharded params; activations and the
KV (split over kv heads) follow the params' shardings, and `np.asarray` gathers a batch's KV to the host.

DeepSeek (multi-head latent attention; params in two stacks, {"dense", "moe"}) splits the same way by query
heads: wq / wq_b, kv_b_proj's halves (w_uk, w_uv) by output head over "tp", wo by input head, so each device
expands the latents into its own heads' keys and values. The latent itself (wkv_a, its norm, the q LoRA's
down-projection and norm) is computed replicated on every device: the KV entry each layer returns is the same
whole [.., 1, C + R] whatever the mesh, no gather. The dense first layers and the shared experts split like the
other families' MLPs over "tp", the routed experts over "ep" x "tp" as above.

`start_distributed` joins a multi-host slice through `jax.distributed` before the mesh is made, so the
mesh spans every process's devices (see README, "Prefill on a device mesh"); the same number of them on
each process. There process 0 reads the outputs it needs on the host, so the engine's programs return
them replicated over the mesh (`host_readable`), and every process replays process 0's steps (replay.py).
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
EXPERT_AXIS = "ep"
EXPERTS = (EXPERT_AXIS, AXIS)
"""The mesh axes the experts split over, together."""

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
    "e_gate": P(None, EXPERTS, None, None),  # [L, E, H, I]: experts split over every device (expert parallelism)
    "e_up": P(None, EXPERTS, None, None),  # [L, E, H, I]
    "e_down": P(None, EXPERTS, None, None),  # [L, E, I, H]
    # DeepSeek's latent attention (wq [L, H, Hq, N + R] and wo [L, Hq, V, H] as above) and shared experts
    "wq_b": P(None, None, AXIS, None),  # [L, q_lora, Hq, N + R]
    "w_uk": P(None, None, AXIS, None),  # [L, C, Hq, N]
    "w_uv": P(None, None, AXIS, None),  # [L, C, Hq, V]
    "s_gate": P(None, None, AXIS),  # [L, H, Is]
    "s_up": P(None, None, AXIS),  # [L, H, Is]
    "s_down": P(None, AXIS, None),  # [L, Is, H]
}


def start_distributed(coordinator_address: str | None, num_processes: int | None, process_id: int | None) -> bool:
    """Joins a multi-host slice (`jax.distributed.initialize`) when a coordinator address is given (or
    JAX_COORDINATOR_ADDRESS is set); num_processes / process_id left None are auto-detected on TPU
    slices. Must run before anything touches a device. Returns whether it joined."""
    if coordinator_address is None and not os.environ.get("JAX_COORDINATOR_ADDRESS") and not num_processes:
        return False
    jax.distributed.initialize(coordinator_address, num_processes, process_id)
    return True


def _unsplittable(config: ModelConfig, tp: int, ep: int = 1) -> list[str]:
    """What of the model a tp x ep mesh does not split evenly, each named with its size."""
    moe = config.moe
    if moe is None:
        sizes = [("num_kv_heads", config.num_kv_heads), ("intermediate_size", config.intermediate_size)]
    elif config.mla is not None:  # DeepSeek: query heads (one latent for all), dense first layers, shared experts
        sizes = [("num_attention_heads", config.num_heads)]
        sizes += [("intermediate_size", config.intermediate_size)] * (moe.dense_layers > 0)
        sizes += [("the shared experts' intermediate size", moe.shared_intermediate_size)] * \
            (moe.shared_intermediate_size > 0)
    else:
        sizes = [("num_kv_heads", config.num_kv_heads)]
    bad = [f"{what} ({n})" for what, n in sizes if n % tp]
    if moe is not None and moe.num_experts % (tp * ep):  # over tp x ep together
        bad.append(f"num_experts ({moe.num_experts})")
    return bad


def _fitting_sizes(config: ModelConfig, num_devices: int, num_processes: int, ep: int = 1) -> list[int]:
    """The tensor-parallel sizes that split the model evenly beside `ep` and take the same share of every
    process's devices."""
    return [tp for tp in range(1, num_devices // ep + 1)
            if (tp * ep) % num_processes == 0 and not _unsplittable(config, tp, ep)]


def default_size(config: ModelConfig, num_devices: int | None = None, num_processes: int | None = None,
                 expert_parallel: int = 1) -> int:
    """The default --tensor-parallel-size: all devices (beside the expert axis: num_devices / ep), or the most
    of them that split the model's kv heads and intermediate size (its experts: over tp x ep) evenly (a model
    with 2 kv heads on 8 chips runs on 2); in a slice of several processes, the mesh a multiple of their
    number (each holds a share of it)."""
    n = len(jax.devices()) if num_devices is None else num_devices
    p = jax.process_count() if num_processes is None else num_processes
    sizes = _fitting_sizes(config, n, p, expert_parallel)
    if not sizes:
        raise ValueError(f"no mesh of this slice's {n} devices (expert parallel {expert_parallel}) splits the "
                         f"model's kv heads ({config.num_kv_heads}) over all its {p} processes; run fewer "
                         f"processes (or one worker per host), or change --expert-parallel-size")
    return max(sizes)


def make_mesh(num_devices: int | None = None, expert_parallel: int = 1) -> Mesh:
    """An ep x tp mesh ("ep", "tp") of num_devices x expert_parallel devices (tp: all of them / ep by default):
    the first ones; in a slice of several processes, the first (tp x ep) / processes devices of each process,
    so every process runs its share of each step. Neighbouring devices share a tp group."""
    devices, p = jax.devices(), jax.process_count()
    if expert_parallel < 1:
        raise ValueError(f"--expert-parallel-size must be >= 1, got {expert_parallel}")
    tp = len(devices) // expert_parallel if num_devices is None else num_devices
    n = tp * expert_parallel
    if not 1 <= n <= len(devices) or tp < 1:
        shape = f" ({tp} x {expert_parallel}: tensor x expert parallel)" if expert_parallel > 1 else ""
        raise ValueError(f"a mesh of {n} devices{shape} was asked for; {len(devices)} are present")
    if p == 1:
        return Mesh(np.array(devices[:n]).reshape(expert_parallel, tp), (EXPERT_AXIS, AXIS))
    if n % p:
        raise ValueError(f"--tensor-parallel-size {tp} x --expert-parallel-size {expert_parallel} does not split "
                         f"over the slice's {p} processes: every process holds the same share of the mesh; make "
                         f"their product a multiple of {p}")
    per_process = [[d for d in devices if d.process_index == i][: n // p] for i in range(p)]
    flat = [d for share in per_process for d in share]
    return Mesh(np.array(flat).reshape(expert_parallel, tp), (EXPERT_AXIS, AXIS))


def host_readable(params: Params) -> dict:
    """jax.jit's keyword arguments for programs whose outputs the host reads: on a mesh that spans
    processes, the outputs replicated over it (process 0 holds only its own shards otherwise); else none."""
    sharding = params["embed"].sharding
    if isinstance(sharding, NamedSharding) and sharding.mesh.is_multi_process:
        return {"out_shardings": NamedSharding(sharding.mesh, P())}
    return {}


def param_specs(params: Params, mesh: Mesh, config: ModelConfig) -> dict:
    """The PartitionSpec of every param (same tree structure as params)."""
    tp, ep = mesh.shape[AXIS], mesh.shape.get(EXPERT_AXIS, 1)
    if ep > 1 and config.moe is None:
        raise ValueError(f"--expert-parallel-size {ep} splits a mixture of experts; {config.family} has none: "
                         f"use --expert-parallel-size 1 (and --tensor-parallel-size for the dense layers)")
    if bad := _unsplittable(config, tp, ep):
        fits = _fitting_sizes(config, len(jax.devices()), jax.process_count(), ep)
        split = f"tensor parallelism {tp}" + (f" x expert parallelism {ep}" if ep > 1 else "")
        heads = "heads" if config.mla is not None else "kv heads"
        raise ValueError(f"{split} must divide the model's {' and '.join(bad)}: each device holds whole {heads} "
                         f"(and whole experts); use --tensor-parallel-size {' or '.join(map(str, fits)) or 'of 1'}"
                         + (" or another --expert-parallel-size" if ep > 1 else ""))
    specs = {name: P() for name in params if name != "layers"}
    specs["layers"] = _layer_specs(params["layers"])
    if "lm_head" in params and config.vocab_size % tp == 0:
        specs["lm_head"] = P(AXIS, None)  # [V, H]
    return specs


def _layer_specs(layers: Params) -> dict:
    """The layer stacks' specs by weight name; DeepSeek's two stacks ({"dense", "moe"}) each so."""
    return {name: _layer_specs(w) if isinstance(w, dict) else _LAYER_SPECS.get(name, P())
            for name, w in layers.items()}


def shard_params(params: Params, mesh: Mesh, config: ModelConfig) -> Params:
    """params placed on the mesh, split for tensor parallelism (see the module docstring)."""
    specs = param_specs(params, mesh, config)
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=is_spec)
    if not mesh.is_multi_process:
        return jax.device_put(params, shardings)
    # Every process loaded the same weights: each places its own shards (device_put would first
    # compare the whole of every weight across processes).
    return jax.tree.map(lambda w, s: _from_host(np.asarray(w), s), params, shardings)


def _from_host(weight: np.ndarray, sharding: NamedSharding) -> jax.Array:
    return jax.make_array_from_callback(weight.shape, sharding, lambda index: weight[index])
