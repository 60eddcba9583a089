"""The mixture-of-experts MLP of the prefill tier (Mixtral, Qwen3-MoE), exact: every token reaches its top-k
experts, none is dropped for capacity.

The router's logits, softmax in fp32 over all experts, the top k (renormalised when the family does), then
the token copies sorted by expert so that each expert's tokens are one contiguous run: the gated MLP of all
experts is then three grouped matmuls (`jax.lax.ragged_dot`) over the sorted rows, each expert's weights
multiplying only its own rows. The outputs, weighted by their probabilities, are summed back per token.
Shapes are static (T tokens make T * k rows whatever the routing), so one compile serves every batch of a
bucket. Shapes: T tokens, H hidden, E experts, k experts per token, I an expert's intermediate size.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from pdserve.server.model.config import MoeConfig

F32 = jnp.float32


def route(logits: jax.Array, moe: MoeConfig) -> tuple[jax.Array, jax.Array]:
    """Router logits [T, E] -> (weights f32 [T, k], experts int32 [T, k]): softmax, top k, renormalised."""
    probs = jax.nn.softmax(logits.astype(F32), axis=-1)
    weights, experts = jax.lax.top_k(probs, moe.top_k)
    if moe.renormalize:
        weights = weights / weights.sum(-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def moe_mlp(x: jax.Array, router: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
            moe: MoeConfig, act: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """x [..., H]; router [H, E]; w_gate, w_up [E, H, I]; w_down [E, I, H] -> [..., H] in x's dtype."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])  # [T, H]
    logits = jnp.einsum("th,he->te", x, router, preferred_element_type=F32)  # [T, E]
    weights, experts = route(logits, moe)  # [T, k] each
    flat = experts.reshape(-1)  # [T k]: the k copies of each token, token-major
    order = jnp.argsort(flat, stable=True)  # [T k]: copies sorted by expert
    rows = x[order // moe.top_k]  # [T k, H]
    sizes = jnp.bincount(flat, length=moe.num_experts).astype(jnp.int32)  # [E] rows of each expert

    def grouped(a: jax.Array, w: jax.Array) -> jax.Array:
        return jax.lax.ragged_dot(a, w, sizes, preferred_element_type=F32).astype(x.dtype)

    h = act(grouped(rows, w_gate)) * grouped(rows, w_up)  # [T k, I]
    out = grouped(h, w_down).astype(F32) * weights.reshape(-1)[order][:, None]  # [T k, H]
    summed = jnp.zeros(x.shape, F32).at[order // moe.top_k].add(out)  # [T, H]
    return summed.astype(x.dtype).reshape(shape)
