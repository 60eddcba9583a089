"""Batched sampling of one token per row, on device: greedy, temperature, top-k, top-p, min-p, seeded;
`penalize` applies vLLM's penalties and min_tokens to the logits first.

Order (as in vLLM): penalties on the raw logits, the structured-output mask (a packed int32 row per
prompt, all ones when it has none: data, not a shape, so no request compiles anything), temperature, then
min-p and top-k, then top-p over the renormalised rest. Row r draws the uniform number of `server/seeded.py`
for (seed[r], index[r]) and picks by the inverse CDF in the decode tier's order (`decode/sampler.py`), so a
(seed, index) pair yields the same token whatever the batch around it, and whichever tier samples it.

The pick (`_pick`, the decode tier's `pick`) never lands on a token of probability 0 (masked, filtered,
blocked: -inf logits): it takes the first token of positive probability whose running sum passes the target,
not a binary search of the sums, which XLA computes as a parallel scan that need not rise where a
probability is 0 (a masked token between two kept ones could hold the step).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _allowed(bitmask: jax.Array, vocab: int) -> jax.Array:
    """int32[W] packed (bit i of word w: token 32w + i) -> bool[vocab]."""
    bits = (bitmask[:, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [W, 32]
    return bits.reshape(-1)[:vocab] > 0


def _mix(x: jax.Array) -> jax.Array:
    """lowbias32 on uint32 (wrapping), as `server/seeded.py` computes it on the host."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def _uniform(seed, index) -> jax.Array:
    """`server/seeded.uniform` of (folded seed uint32, index): f32 in [0, 1)."""
    bits = _mix(_mix(seed) ^ index.astype(jnp.uint32)) >> 8
    return bits.astype(jnp.float32) * jnp.float32(2.0**-24)


def _pick(probs: jax.Array, u) -> jax.Array:
    """probs f32[V] >= 0 (any total), u in [0, 1) -> int32: the inverse CDF's index, only ever one whose
    probability is > 0: the first such index whose running sum (made monotone) exceeds u x the total, the last
    such index if rounding leaves none; -1 if no probability is > 0 (a NaN or all -inf row)."""
    vocab = probs.shape[-1]
    cdf = jax.lax.cummax(jnp.cumsum(probs), axis=0)  # [V] made monotone: a parallel scan's sums need not rise
    ids = jnp.arange(vocab, dtype=jnp.int32)  # [V]
    kept = probs > 0  # [V]
    first = jnp.min(jnp.where(kept & (cdf > u * cdf[-1]), ids, vocab))
    last = jnp.max(jnp.where(kept, ids, -1))
    return jnp.where(first < vocab, first, last)


def _sample_row(logits: jax.Array, temperature, top_k, top_p, seed, index, min_p, bitmask) -> jax.Array:
    """logits f32[V], scalar settings and bitmask int32[W] -> int32 token: the decode tier's draw
    (`decode/sampler.py`) for the same logits, settings and (seed, index)."""
    vocab = logits.shape[-1]
    logits = jnp.where(_allowed(bitmask, vocab), logits, -jnp.inf)
    greedy = jnp.argmax(logits).astype(jnp.int32)
    scaled = logits * (1 / jnp.maximum(temperature, 1e-6))  # what XLA makes of a division; the decode tier too
    u = _uniform(seed, index)
    log_min_p = jnp.log(jnp.maximum(min_p, 1e-30))  # p_i < min_p x p_0 <=> l_i < l_0 + log(min_p)
    # Without top-k/top-p: the inverse CDF over the vocabulary in id order.
    plain = jnp.where((min_p > 0) & (scaled < jnp.max(scaled) + log_min_p), -jnp.inf, scaled)
    in_vocab_order = _pick(jax.nn.softmax(plain), u)
    in_vocab_order = jnp.where(in_vocab_order < 0, greedy, in_vocab_order)  # nothing finite: argmax's answer
    # With them: top-k, min-p, then top-p over the logits sorted once (stable), the inverse CDF in that order.
    order = jnp.argsort(-scaled, stable=True)  # [V] token ids, most likely first
    ranked = scaled[order]  # [V]
    rank = jnp.arange(vocab)
    ranked = jnp.where(rank < jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab), ranked, -jnp.inf)
    ranked = jnp.where((min_p > 0) & (ranked < ranked[0] + log_min_p), -jnp.inf, ranked)
    probs = jax.nn.softmax(ranked)  # [V]
    before = jnp.cumsum(probs) - probs  # probability mass ranked strictly above each token
    probs = jnp.where(before > top_p, 0.0, probs)
    in_rank_order = order[jnp.maximum(_pick(probs, u), 0)]  # nothing finite: rank 0, the argmax
    ranked_row = ((top_k > 0) & (top_k < vocab)) | (top_p < 1.0)
    drawn = jnp.where(ranked_row, in_rank_order, in_vocab_order)
    return jnp.where(temperature > 0, drawn, greedy).astype(jnp.int32)


def sample(logits, temperature, top_k, top_p, seed, index, min_p=None, bitmask=None) -> jax.Array:
    """logits f32[B, V]; temperature f32[B] (0: greedy); top_k int32[B] (0: off); top_p f32[B] in (0, 1];
    seed uint32[B] (`seeded.fold` of the request's); index int32[B] (which output token this is); min_p f32[B] (0: off); bitmask int32[B,
    ceil(V / 32)] (the allowed tokens, packed; -1: all) -> int32[B]."""
    words = (logits.shape[-1] + 31) // 32
    return jax.vmap(_sample_row)(
        logits.astype(jnp.float32),
        jnp.asarray(temperature, jnp.float32),
        jnp.asarray(top_k, jnp.int32),
        jnp.asarray(top_p, jnp.float32),
        jnp.asarray(seed, jnp.uint32),
        jnp.asarray(index, jnp.int32),
        jnp.zeros(logits.shape[0], jnp.float32) if min_p is None else jnp.asarray(min_p, jnp.float32),
        jnp.full((logits.shape[0], words), -1, jnp.int32) if bitmask is None else jnp.asarray(bitmask, jnp.int32),
    )


sample_jit = jax.jit(sample)


def _penalize_row(logits, tokens, length, num_outputs, presence, frequency, repetition, blocked) -> jax.Array:
    """logits f32[V]; tokens int32[S] right-padded to length, whose last num_outputs are outputs
    (after a migration); blocked bool[V] -> f32[V]."""
    position = jnp.arange(tokens.shape[0])  # [S]
    valid = position < length
    is_output = valid & (position >= length - num_outputs)
    counts = jnp.zeros_like(logits).at[tokens].add(is_output.astype(jnp.float32))  # [V]
    seen = jnp.zeros(logits.shape, jnp.int32).at[tokens].max(valid.astype(jnp.int32)) > 0  # [V]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / repetition, logits * repetition), logits)
    logits = logits - frequency * counts - presence * (counts > 0)
    return jnp.where(blocked, -jnp.inf, logits)


@jax.jit
def penalize(logits, tokens, lengths, num_outputs, presence, frequency, repetition, blocked) -> jax.Array:
    """vLLM's penalties per row: logits f32[B, V]; tokens int32[B, S]; lengths, num_outputs int32[B];
    presence, frequency, repetition f32[B]; blocked bool[B, V] (EOS and stop ids before min_tokens)."""
    return jax.vmap(_penalize_row)(logits.astype(jnp.float32), tokens, lengths, num_outputs, presence, frequency,
                                   repetition, blocked)
