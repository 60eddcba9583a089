"""The mixture-of-experts MLP of the prefill tier (Mixtral, Qwen3-MoE, DeepSeek), exact: every token reaches its
top-k experts, none is dropped for capacity.

The router's logits, softmax in fp32 over all experts, the top k (renormalised when the family does; DeepSeek-V3:
sigmoid scores, chosen with a correction bias among the best groups of experts, scaled by routed_scaling_factor;
`route` is the decode tier's `decode/moe.py route` in JAX), then
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


def route(logits: jax.Array, moe: MoeConfig, bias: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Router logits [T, E] -> (weights f32 [T, k], experts int32 [T, k]): softmax (or DeepSeek-V3's sigmoid)
    scores, the top k, renormalised when the family does, times routed_scale. bias [E] (DeepSeek-V3's correction
    bias) is added to the scores to choose the experts only; the weights are the scores themselves."""
    logits = logits.astype(F32)
    scores = jax.nn.softmax(logits, axis=-1) if moe.scoring == "softmax" else jax.nn.sigmoid(logits)  # [T, E]
    if moe.num_groups == 1 and bias is None:
        weights, experts = jax.lax.top_k(scores, moe.top_k)
    else:
        choice = scores if bias is None else scores + bias.astype(F32)
        if moe.num_groups > 1:
            choice = _in_best_groups(choice, moe)
        experts = jax.lax.top_k(choice, moe.top_k)[1]  # [T, k]
        weights = jnp.take_along_axis(scores, experts, axis=-1)
    if moe.renormalize:
        # DeepSeek-V3 (sigmoid scores) guards the sum as transformers does; softmax's never needs it
        weights = weights / (weights.sum(-1, keepdims=True) + (1e-20 if moe.scoring == "sigmoid" else 0.0))
    if moe.routed_scale != 1.0:
        weights = weights * moe.routed_scale
    return weights, experts.astype(jnp.int32)


def _in_best_groups(choice: jax.Array, moe: MoeConfig) -> jax.Array:
    """choice [T, E] with the experts outside each token's `topk_groups` best groups set to -inf; a group's
    score is its best expert's (V2) or the sum of its best two (V3)."""
    T, E = choice.shape
    grouped = choice.reshape(T, moe.num_groups, E // moe.num_groups)  # [T, G, E / G]
    if moe.group_score == "max":
        group_scores = grouped.max(-1)
    else:
        group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [T, G]
    best = jax.lax.top_k(group_scores, moe.topk_groups)[1]  # [T, topk_groups]
    keep = jnp.zeros(group_scores.shape, bool).at[jnp.arange(T)[:, None], best].set(True)  # [T, G]
    return jnp.where(keep[..., None], grouped, -jnp.inf).reshape(T, E)


def moe_mlp(x: jax.Array, router: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
            moe: MoeConfig, act: Callable[[jax.Array], jax.Array], bias: jax.Array | None = None) -> jax.Array:
    """x [..., H]; router [H, E]; w_gate, w_up [E, H, I]; w_down [E, I, H]; bias [E] the router's correction
    bias (DeepSeek-V3) -> [..., H] in x's dtype."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])  # [T, H]
    logits = jnp.einsum("th,he->te", x, router, preferred_element_type=F32)  # [T, E]
    weights, experts = route(logits, moe, bias)  # [T, k] each
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
