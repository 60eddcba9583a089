"""The LoRA deltas of a packed prefill step, as pure JAX: every token's adapter by its device slot, static shapes.

Each projection an adapter may change (q/k/v/o_proj, gate/up/down_proj) has, per layer, a stack of every slot's
matrices, A [N, in, R] and B [N, R, out] (scaling folded into B), N = --max-loras + 1 slots of rank R =
--max-lora-rank (a smaller rank padded with zeros); slot 0 is all zeros: the base model. A token in slot s gets

    delta[t] = (x[t] @ A[s]) @ B[s]

computed for the whole buffer as (x @ A[n]) for every slot n, masked by the token's one-hot slot, then summed over
(n, r) against B: two einsums whose shapes depend on the step's shape and the flags alone, never on which adapters
are loaded (a TPU compiles each program once; loading an adapter writes array contents). A base token's delta is
exactly zero, so base rows of a mixed step compute what a base-only step computes; a step with no adapter token
skips the deltas (`lax.cond` on the step's slots: one program, the branch chosen on the device).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

F32 = jnp.float32

Stacks = dict
"""Projection name (q_proj ...) -> (A [l, N, in, R], B [l, N, R, out]): the slots' matrices of l layers."""


class LoraRows(NamedTuple):
    """The adapters of one step: every slot's matrices, and each token's slot."""

    stacks: Stacks
    slots: jax.Array  # int32 [B, S]: each token's slot (0: the base model, also for padding)


class LayerLora(NamedTuple):
    """LoraRows within one layer (the layer scan's slice of the stacks)."""

    stacks: Stacks  # projection -> (A [N, in, R], B [N, R, out])
    onehot: jax.Array  # f32 [B, S, N]: each token's slot
    active: jax.Array  # bool []: some token of the step has an adapter


def one_layer(rows: LoraRows) -> tuple[Stacks, jax.Array, jax.Array]:
    """What the layer scan takes: the stacks to slice per layer, the tokens' one-hot slots [B, S, N], and whether
    any token has an adapter."""
    num_slots = next(iter(rows.stacks.values()))[0].shape[1]
    return rows.stacks, jax.nn.one_hot(rows.slots, num_slots, dtype=F32), jnp.any(rows.slots > 0)


def add_delta(lora: LayerLora | None, proj: str, x: jax.Array, y: jax.Array) -> jax.Array:
    """y [B, S, ...out] (the base projection of x [B, S, ...in]) plus each token's adapter delta, in y's dtype."""
    if lora is None or proj not in lora.stacks:
        return y
    a, b = lora.stacks[proj]  # [N, in, R], [N, R, out]

    def with_delta() -> jax.Array:
        flat = x.reshape(*x.shape[:2], -1)  # [B, S, in]
        xa = jnp.einsum("bsi,nir->bsnr", flat, a, preferred_element_type=F32) * lora.onehot[..., None]  # [B,S,N,R]
        delta = jnp.einsum("bsnr,nro->bso", xa, b.astype(F32), preferred_element_type=F32)  # [B, S, out]
        return (y.astype(F32) + delta.reshape(y.shape)).astype(y.dtype)

    return jax.lax.cond(lora.active, with_delta, lambda: y)
