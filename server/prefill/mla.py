"""Multi-head latent attention (DeepSeek-V2/V3) for the prefill tier, as pure JAX: the expanded form.

Each token's KV, per layer, is one entry of kv_lora_rank + qk_rope_head_dim values: the latent (kv_a_layernorm of
kv_a_proj_with_mqa's first kv_lora_rank outputs) and the rotated key its last qk_rope_head_dim outputs make, one
for every head. That entry is what the layer returns as its KV (num_kv_heads 1, no V) and what the wire carries;
the decode tier (`decode/mla.py`) attends to it in the absorbed form. Prefill expands the context's and the new
tokens' entries through kv_b_proj into every head's keys and values and runs the tier's ordinary attention.

The rope dimensions rotate as transformers' model does (`MlaConfig.rope_pairs`) and are kept as transformers'
cache keeps them (V3's rope_interleave pairs written de-interleaved, V2's left interleaved), the layout the decode
tier's `mla.rotate` writes too. Shapes: B batch, S new tokens, T context + new tokens, d hidden, H heads,
C kv_lora_rank, R qk_rope_head_dim, N qk_nope_head_dim, V v_head_dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pdserve.server.model.config import ModelConfig
from pdserve.server.prefill.attention import attention

F32 = jnp.float32
LORA_NORM_EPS = 1e-6
"""q_a_layernorm's and kv_a_layernorm's epsilon: transformers builds them with its RMSNorm's default, whatever
rms_norm_eps says."""


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis in fp32; returns x's dtype."""
    x32 = x.astype(F32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * w).astype(x.dtype)


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array, pairs: str) -> jax.Array:
    """x [B, S, n, R] rotated in fp32 by cos, sin [B, S, R] (HF's tables: [freqs | freqs]) as `pairs` says."""
    x32 = x.astype(F32)
    if pairs != "halves":
        x32 = jnp.concatenate([x32[..., 0::2], x32[..., 1::2]], axis=-1)  # [.., R] as [evens | odds]
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    out = x32 * cos[:, :, None] + rotated * sin[:, :, None]
    if pairs == "interleaved":  # back in place: (a0, b0, a1, b1, ...)
        out = jnp.stack([out[..., :half], out[..., half:]], axis=-1).reshape(out.shape)
    return out.astype(x.dtype)


def mla_attention(config: ModelConfig, h: jax.Array, p: dict, cos: jax.Array, sin: jax.Array, context: jax.Array,
                  q_pos: jax.Array, q_seg: jax.Array, k_pos: jax.Array, k_seg: jax.Array
                  ) -> tuple[jax.Array, jax.Array]:
    """h [B, S, d] normed, context [B, C_ctx, 1, C + R] (earlier tokens' entries) -> (attention output [B, S, d],
    the new tokens' entries [B, S, 1, C + R])."""
    mla = config.mla
    C, N = mla.kv_lora_rank, mla.qk_nope_head_dim
    if mla.q_lora_rank is None:
        q = jnp.einsum("bsd,dhq->bshq", h, p["wq"], preferred_element_type=F32).astype(h.dtype)  # [B, S, H, N + R]
    else:
        qa = jnp.einsum("bsd,dr->bsr", h, p["wq_a"], preferred_element_type=F32).astype(h.dtype)
        qa = rms_norm(qa, p["q_a_norm"], LORA_NORM_EPS)
        q = jnp.einsum("bsr,rhq->bshq", qa, p["wq_b"], preferred_element_type=F32).astype(h.dtype)
    kv = jnp.einsum("bsd,de->bse", h, p["wkv_a"], preferred_element_type=F32).astype(h.dtype)  # [B, S, C + R]
    latent = rms_norm(kv[..., :C], p["kv_a_norm"], LORA_NORM_EPS)  # [B, S, C]
    k_rot = rotate(kv[:, :, None, C:], cos, sin, mla.rope_pairs)  # [B, S, 1, R]
    q = jnp.concatenate([q[..., :N], rotate(q[..., N:], cos, sin, mla.rope_pairs)], axis=-1)
    entry = jnp.concatenate([latent[:, :, None], k_rot], axis=-1)  # [B, S, 1, C + R]
    entries = jnp.concatenate([context.astype(entry.dtype), entry], axis=1)[:, :, 0]  # [B, T, C + R]
    k_nope = jnp.einsum("btc,chn->bthn", entries[..., :C], p["w_uk"], preferred_element_type=F32).astype(h.dtype)
    values = jnp.einsum("btc,chv->bthv", entries[..., :C], p["w_uv"], preferred_element_type=F32).astype(h.dtype)
    k_rope = jnp.broadcast_to(entries[:, :, None, C:], (*k_nope.shape[:3], mla.qk_rope_head_dim))  # [B, T, H, R]
    keys = jnp.concatenate([k_nope, k_rope], axis=-1)  # [B, T, H, N + R]
    width = max(keys.shape[-1], mla.v_head_dim)  # one head dim for the tier's attention: zeros change nothing
    pad = lambda x: jnp.pad(x, ((0, 0),) * 3 + ((0, width - x.shape[-1]),))  # noqa: E731
    out = attention(pad(q), pad(keys), pad(values), q_pos, q_seg, k_pos, k_seg, None,
                    own_keys_from=context.shape[1], scale=config.scale)  # [B, S, H, width]
    out = out[..., : mla.v_head_dim]  # [B, S, H, V]
    return jnp.einsum("bshv,hvd->bsd", out, p["wo"], preferred_element_type=F32).astype(h.dtype), entry
