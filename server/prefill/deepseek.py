"""DeepSeek-V2/V3 in the prefill tier, as pure JAX: the params, a layer, and a layer group over them.

A DeepSeek layer is multi-head latent attention (mla.py) then a dense MLP in the first `MoeConfig.dense_layers`
layers, routed experts (moe.py, DeepSeek's routing) plus the shared experts' dense MLP in the others. The two
kinds' weights differ in shape, so the params hold two stacks, `dense` [Ld, ...] and `moe` [Lm, ...] (every
dense layer comes first: moe_layer_freq 1 is the only one served), and a layer group scans each of its runs.
Every layer's KV is its tokens' latent entries [.., 1, C + R]; its V is empty ([.., 1, 0]): nothing to send.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from pdserve.server.model.config import ModelConfig
from pdserve.server.model.weights import EXPERT_NAMES
from pdserve.server.prefill.mla import mla_attention, rms_norm
from pdserve.server.prefill.moe import moe_mlp

F32 = jnp.float32
Params = dict


def load_deepseek_params(config: ModelConfig, weights: dict[str, np.ndarray], dt: jnp.dtype) -> Params:
    """Device params from transformers-named weights: matmul weights in dt, norms (and the router's correction
    bias) in fp32. layers: {"dense": [Ld, ...], "moe": [Lm, ...]} (`split_deepseek_layers`)."""
    mla, moe, H, d = config.mla, config.moe, config.num_heads, config.hidden_size
    qk, nope, v = mla.qk_nope_head_dim + mla.qk_rope_head_dim, mla.qk_nope_head_dim, mla.v_head_dim

    def get(name: str) -> np.ndarray:
        if name not in weights:
            raise ValueError(f"the checkpoint lacks the tensor {name!r} that {config.family} needs "
                             f"({config.describe()})")
        return np.asarray(weights[name], np.float32)

    def layer(i: int) -> dict[str, np.ndarray]:
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        kv_b = get(f"{a}kv_b_proj.weight").reshape(H, nope + v, mla.kv_lora_rank)  # [H, N + V, C]
        out = {
            "attn_norm": get(f"model.layers.{i}.input_layernorm.weight"),  # [d]
            "mlp_norm": get(f"model.layers.{i}.post_attention_layernorm.weight"),  # [d]
            "wkv_a": get(f"{a}kv_a_proj_with_mqa.weight").T,  # [d, C + R]
            "kv_a_norm": get(f"{a}kv_a_layernorm.weight"),  # [C]
            "w_uk": kv_b[:, :nope].transpose(2, 0, 1),  # [C, H, N]
            "w_uv": kv_b[:, nope:].transpose(2, 0, 1),  # [C, H, V]
            "wo": get(f"{a}o_proj.weight").T.reshape(H, v, d),  # [H, V, d]
        }
        if mla.q_lora_rank is None:
            out["wq"] = get(f"{a}q_proj.weight").T.reshape(d, H, qk)  # [d, H, N + R]
        else:
            out["wq_a"] = get(f"{a}q_a_proj.weight").T  # [d, q_lora]
            out["q_a_norm"] = get(f"{a}q_a_layernorm.weight")  # [q_lora]
            out["wq_b"] = get(f"{a}q_b_proj.weight").T.reshape(mla.q_lora_rank, H, qk)  # [q_lora, H, N + R]
        if moe is None or i < moe.dense_layers:
            for proj in ("gate", "up", "down"):
                out[f"w_{proj}"] = get(f"{m}{proj}_proj.weight").T  # [d, I] ([I, d] down)
            return out
        names = EXPERT_NAMES[config.family]
        p = f"model.layers.{i}."
        out["router"] = get(p + names["router"] + ".weight").T  # [d, E]
        if moe.correction_bias:
            out["router_bias"] = get(p + names["router"] + ".e_score_correction_bias")  # [E]
        for proj in ("gate", "up", "down"):  # [E, d, I] ([E, I, d] down)
            out[f"e_{proj}"] = np.stack([get(p + names[proj].format(e=e)).T for e in range(moe.num_experts)])
        if moe.shared_intermediate_size:
            for proj in ("gate", "up", "down"):
                out[f"s_{proj}"] = get(f"{m}shared_experts.{proj}_proj.weight").T  # [d, Is] ([Is, d] down)
        return out

    fp32 = {"attn_norm", "mlp_norm", "kv_a_norm", "q_a_norm", "router_bias"}

    def stack(indexes: range) -> dict[str, jax.Array]:
        per_layer = [layer(i) for i in indexes]
        if not per_layer:
            return {}
        return {name: jnp.asarray(np.stack([w[name] for w in per_layer]), F32 if name in fp32 else dt)
                for name in per_layer[0]}

    dense = config.num_layers if moe is None else min(moe.dense_layers, config.num_layers)
    params: Params = {
        "embed": jnp.asarray(get("model.embed_tokens.weight"), dtype=dt),  # [V, d]
        "final_norm": jnp.asarray(get("model.norm.weight")),  # [d]
        "layers": {"dense": stack(range(dense)), "moe": stack(range(dense, config.num_layers))},
    }
    if not config.tie_word_embeddings:
        params["lm_head"] = jnp.asarray(get("lm_head.weight"), dtype=dt)  # [V, d]
    return params


def split_deepseek_layers(layers: Params, groups: list[tuple[int, int]]) -> list[Params]:
    """Each (first layer, layers) group's own {"dense", "moe"} stacks: the slices of each stack its layers cover."""
    dense = _count(layers["dense"])
    out = []
    for start, size in groups:
        d0, d1 = min(start, dense), min(start + size, dense)
        m0, m1 = max(start, dense) - dense, max(start + size, dense) - dense
        out.append({"dense": jax.tree.map(lambda w: w[d0:d1], layers["dense"]),  # noqa: B023
                    "moe": jax.tree.map(lambda w: w[m0:m1], layers["moe"])})  # noqa: B023
    return out


def _count(stack: Params) -> int:
    leaves = jax.tree.leaves(stack)
    return leaves[0].shape[0] if leaves else 0


def _gated(x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array) -> jax.Array:
    """down(silu(x gate) * (x up)): x [B, S, d]; gate, up [d, I]; down [I, d]."""
    g = jnp.einsum("bsd,di->bsi", x, gate, preferred_element_type=F32).astype(x.dtype)
    u = jnp.einsum("bsd,di->bsi", x, up, preferred_element_type=F32).astype(x.dtype)
    return jnp.einsum("bsi,id->bsd", jax.nn.silu(g) * u, down, preferred_element_type=F32).astype(x.dtype)


def deepseek_layer(config: ModelConfig, cos: jax.Array, sin: jax.Array, packing, x: jax.Array, p: Params,
                   context: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One layer: x [B, S, d], context [B, C_ctx, 1, C + R] -> (x, the new tokens' entries [B, S, 1, C + R])."""
    eps = config.rms_norm_eps
    key_pos = jnp.concatenate([packing.context_positions, packing.positions], axis=1)  # [B, C_ctx + S]
    key_seg = jnp.concatenate([packing.context_segments, packing.segments], axis=1)
    attn, entry = mla_attention(config, rms_norm(x, p["attn_norm"], eps), p, cos, sin, context,
                                packing.positions, packing.segments, key_pos, key_seg)
    x = x + attn
    h = rms_norm(x, p["mlp_norm"], eps)
    if "router" not in p:
        return x + _gated(h, p["w_gate"], p["w_up"], p["w_down"]), entry
    out = moe_mlp(h, p["router"], p["e_gate"], p["e_up"], p["e_down"], config.moe, jax.nn.silu, p.get("router_bias"))
    if "s_gate" in p:
        out = out + _gated(h, p["s_gate"], p["s_up"], p["s_down"])
    return x + out, entry


def deepseek_layer_group(layers: Params, x: jax.Array, cos: jax.Array, sin: jax.Array, packing,
                         context_k: jax.Array, context_v: jax.Array, *, config: ModelConfig
                         ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`model.layer_group` for DeepSeek: the group's {"dense", "moe"} stacks (`split_deepseek_layers`), x [B, S, d],
    context_k [size, B, C_ctx, 1, C + R] (context_v unread: a latent has no V) -> (x, k [size, B, S, 1, C + R],
    v [size, B, S, 1, 0]). Each run of one kind is one `lax.scan`."""
    entries = []
    at = 0
    for kind in ("dense", "moe"):
        n = _count(layers[kind])
        if n == 0:
            continue
        step: Callable = lambda h, xs: deepseek_layer(config, cos, sin, packing, h, *xs)  # noqa: E731
        x, k = jax.lax.scan(step, x, (layers[kind], context_k[at : at + n]))
        entries.append(k)
        at += n
    k = entries[0] if len(entries) == 1 else jnp.concatenate(entries, axis=0)  # [size, B, S, 1, C + R]
    return x, k, k[..., :0]
