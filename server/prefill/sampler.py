"""Batched sampling of one token per row, on device: greedy, temperature, top-k, top-p, seeded.

Order (as in transformers and vLLM): temperature, then top-k, then top-p over the renormalised
top-k distribution. Row r draws with key fold_in(key(seed[r]), index[r]), so a (seed, index) pair
always yields the same token, whatever the batch around it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _sample_row(logits: jax.Array, temperature, top_k, top_p, seed, index) -> jax.Array:
    """logits f32[V] and scalar settings -> int32 token."""
    vocab = logits.shape[-1]
    scaled = logits / jnp.maximum(temperature, 1e-6)
    order = jnp.argsort(-scaled)  # [V] token ids, most likely first (stable)
    ranked = scaled[order]  # [V]
    rank = jnp.arange(vocab)
    ranked = jnp.where(rank < jnp.where(top_k > 0, top_k, vocab), ranked, -jnp.inf)
    probs = jax.nn.softmax(ranked)  # [V]
    before = jnp.cumsum(probs) - probs  # probability mass ranked strictly above each token
    ranked = jnp.where((before < top_p) | (rank == 0), ranked, -jnp.inf)
    key = jax.random.fold_in(jax.random.key(seed), index)
    drawn = order[jax.random.categorical(key, ranked)]
    return jnp.where(temperature > 0, drawn, jnp.argmax(logits)).astype(jnp.int32)


def sample(logits, temperature, top_k, top_p, seed, index) -> jax.Array:
    """logits f32[B, V]; temperature f32[B] (0: greedy); top_k int32[B] (0: off); top_p f32[B] in (0, 1];
    seed uint32[B]; index int32[B] (which output token this is) -> int32[B]."""
    return jax.vmap(_sample_row)(
        logits.astype(jnp.float32),
        jnp.asarray(temperature, jnp.float32),
        jnp.asarray(top_k, jnp.int32),
        jnp.asarray(top_p, jnp.float32),
        jnp.asarray(seed, jnp.uint32),
        jnp.asarray(index, jnp.int32),
    )


sample_jit = jax.jit(sample)
