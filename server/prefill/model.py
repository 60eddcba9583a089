"""The prefill model as pure JAX functions of (params, tokens): llama, mistral, qwen2, qwen3, gemma2, gemma3, mixtral,
qwen3_moe; DeepSeek-V2/V3's layers and params are deepseek.py's (the hooks below hand them over).

Per-layer weights are stacked on a leading layer axis, so the layer loop is one `jax.lax.scan` and
compile time does not grow with depth. The layers' linears, MLP and attention run the `Kernels` given at the
edge as `matmul` (kernels.py: XLA's einsum and attention by default, or oneDNN's matmuls and fused MLP on
weights held outside JAX with the host's attention; a bare `Matmul` is its matmul); matmuls run in the
compute dtype with fp32 accumulation;
norms, softmax and RoPE run in fp32. Shapes: B batch, S sequence, H hidden, V vocab, L layers,
Hq/Hkv query/kv heads, G = Hq // Hkv, D head dim, I intermediate.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pdserve.server.model.config import ModelConfig
from pdserve.server.model.rope import inv_freq
from pdserve.server.model.weights import EXPERT_NAMES
from pdserve.server.prefill.attention import NO_WINDOW
from pdserve.server.prefill.deepseek import deepseek_layer_group, load_deepseek_params, split_deepseek_layers
from pdserve.server.prefill.lora_rows import LayerLora, LoraRows, add_delta, one_layer
from pdserve.server.prefill.kernels import Kernels, as_kernels
from pdserve.server.prefill.matmul import Matmul, xla_matmul
from pdserve.server.prefill.moe import moe_mlp
from pdserve.server.prefill.quant import WEIGHT_FORMATS, dequantize, quantize_layers

Params = dict
"""A pytree of jax arrays: embed, final_norm, [lm_head], layers (each stacked over L; with `window` int32 [L],
each layer's sliding window, NO_WINDOW for a global layer, when the model has windowed layers)."""

F32 = jnp.float32


def compute_dtype(config: ModelConfig, weight_dtype: str, backend: str | None = None) -> str:
    """The activations' dtype: the weights' own, or for int8/fp8 weights the checkpoint's (fp32 or bf16),
    which on the CPU `backend` is fp32 for the reason `served_weight_dtype` gives (None: as on an
    accelerator)."""
    if weight_dtype in WEIGHT_FORMATS:
        checkpoint = config.dtype if config.dtype in ("float32", "bfloat16") else "float32"
        return served_weight_dtype("auto", checkpoint, backend or "")
    return weight_dtype


def served_weight_dtype(requested: str, checkpoint_dtype: str, backend: str) -> str:
    """The matmul weights' dtype a prefill worker serves where no matmul path is measured (matmul_choice.py
    chooses on the CPU backend; this rule serves TPU/GPU, quantized weights' compute dtype and a slice of several
    processes): --weight-dtype, whose `auto` is the checkpoint's dtype except for a bf16 checkpoint on the CPU
    backend, which is upcast to fp32 at load (exactly).

    XLA:CPU multiplies bf16 operands with fp32 accumulation at about half its fp32 rate (no AMX path;
    benchmarks/README.md, "Prefill on one core"), so there fp32 is faster and no less exact: a 128-token
    prefill of the Qwen2.5-0.5B shape took 1.25 s instead of 2.6 s on one core. The price is twice the host
    memory for weights; `--weight-dtype bfloat16` keeps them bf16. On TPU and GPU, bf16 stays bf16.
    """
    if requested != "auto":
        return requested
    if backend == "cpu" and checkpoint_dtype == "bfloat16":
        return "float32"
    return checkpoint_dtype


def load_params(config: ModelConfig, weights: dict[str, np.ndarray], dtype: str = "float32",
                backend: str | None = None) -> Params:
    """Device params from HF-named weights; matmul weights in `dtype`, norm weights in fp32.

    dtype int8/fp8: the layers' matmul weights are quantized at load (weight-only, per output channel,
    see prefill.quant); embeddings, lm_head and biases stay in the compute dtype (`compute_dtype` on
    `backend`, by default JAX's: fp32 on CPU).
    """
    if dtype not in ("float32", "bfloat16", *WEIGHT_FORMATS):
        raise ValueError(f"prefill dtype {dtype!r} is not supported (float32, bfloat16, int8, fp8)")
    quantized = dtype in WEIGHT_FORMATS
    dt = jnp.dtype(compute_dtype(config, dtype, backend or jax.default_backend()))
    if config.mla is not None:
        if quantized:
            raise ValueError(f"--weight-dtype {dtype}: the prefill tier serves {config.family} (latent attention) "
                             f"with float32 or bfloat16 weights only; use --weight-dtype auto")
        return load_deepseek_params(config, weights, dt)
    hq, hkv, d = config.num_heads, config.num_kv_heads, config.head_dim

    def get(name: str) -> np.ndarray:
        if name not in weights:
            raise ValueError(f"the checkpoint lacks the tensor {name!r} that {config.family} needs")
        return np.asarray(weights[name])

    def stack(suffix: str, fn: Callable = lambda w: w, as_dtype=dt) -> np.ndarray:
        per_layer = [fn(get(f"model.layers.{i}.{suffix}")) for i in range(config.num_layers)]
        return np.stack(per_layer).astype(np.float32 if quantized else as_dtype)

    def heads(n: int) -> Callable:
        return lambda w: w.T.reshape(-1, n, d)  # HF [n*D, H] -> [H, n, D]

    offset = 1.0 if config.norm_offset else 0.0  # Gemma's norms scale by (1 + w)

    def norm(suffix: str) -> np.ndarray:
        return stack(suffix, lambda w: w.astype(np.float32) + np.float32(offset), as_dtype=F32)

    mlp_norm = "pre_feedforward_layernorm" if config.sandwich_norms else "post_attention_layernorm"
    layers = {
        "attn_norm": norm("input_layernorm.weight"),  # [L, H]
        "wq": stack("self_attn.q_proj.weight", heads(hq)),  # [L, H, Hq, D]
        "wk": stack("self_attn.k_proj.weight", heads(hkv)),  # [L, H, Hkv, D]
        "wv": stack("self_attn.v_proj.weight", heads(hkv)),  # [L, H, Hkv, D]
        "wo": stack("self_attn.o_proj.weight", lambda w: w.T.reshape(hq, d, -1)),  # [L, Hq, D, H]
        "mlp_norm": norm(f"{mlp_norm}.weight"),  # [L, H]
    }
    if config.moe is None:
        layers["w_gate"] = stack("mlp.gate_proj.weight", np.transpose)  # [L, H, I]
        layers["w_up"] = stack("mlp.up_proj.weight", np.transpose)  # [L, H, I]
        layers["w_down"] = stack("mlp.down_proj.weight", np.transpose)  # [L, I, H]
    else:
        names = EXPERT_NAMES[config.family]
        experts = lambda proj: lambda i: np.stack(  # noqa: E731  [E, in, out] of layer i
            [get(f"model.layers.{i}.{names[proj]}".format(e=e)).T for e in range(config.moe.num_experts)])
        per_layer = lambda proj: np.stack([experts(proj)(i) for i in range(config.num_layers)])  # noqa: E731
        layers["router"] = stack(f"{names['router']}.weight", np.transpose)  # [L, H, E]
        layers["e_gate"] = per_layer("gate").astype(np.float32 if quantized else dt)  # [L, E, H, I]
        layers["e_up"] = per_layer("up").astype(np.float32 if quantized else dt)  # [L, E, H, I]
        layers["e_down"] = per_layer("down").astype(np.float32 if quantized else dt)  # [L, E, I, H]
    if config.qkv_bias:
        layers["bq"] = stack("self_attn.q_proj.bias", lambda b: b.reshape(hq, d))  # [L, Hq, D]
        layers["bk"] = stack("self_attn.k_proj.bias", lambda b: b.reshape(hkv, d))  # [L, Hkv, D]
        layers["bv"] = stack("self_attn.v_proj.bias", lambda b: b.reshape(hkv, d))  # [L, Hkv, D]
    if "model.layers.0.self_attn.o_proj.bias" in weights:  # llama with attention_bias
        layers["bo"] = stack("self_attn.o_proj.bias")  # [L, H]
    if config.qk_norm:
        layers["q_norm"] = norm("self_attn.q_norm.weight")  # [L, D]
        layers["k_norm"] = norm("self_attn.k_norm.weight")  # [L, D]
    if config.sandwich_norms:
        layers["attn_post_norm"] = norm("post_attention_layernorm.weight")  # [L, H]
        layers["mlp_post_norm"] = norm("post_feedforward_layernorm.weight")  # [L, H]
    if quantized:
        layers = quantize_layers(layers, dtype)  # int8/fp8 [L, ...] + float32 <name>_scale
        for name in ("attn_norm", "mlp_norm", "q_norm", "k_norm", "attn_post_norm", "mlp_post_norm"):
            if name in layers:
                layers[name] = layers[name].astype(np.float32)
        for name in ("bq", "bk", "bv", "bo", "router"):
            if name in layers:
                layers[name] = layers[name].astype(dt)
    if config.layer_windows:
        layers["window"] = np.array([w or NO_WINDOW for w in config.layer_windows], np.int32)  # [L]
    if config.local_rope is not None:  # which of embed's two RoPE tables each layer reads: 1 the local one
        layers["rope"] = np.array([int(config.window(i) is not None) for i in range(config.num_layers)], np.int32)
    params: Params = {
        "embed": jnp.asarray(get("model.embed_tokens.weight"), dtype=dt),  # [V, H]
        "final_norm": jnp.asarray(get("model.norm.weight").astype(np.float32) + np.float32(offset)),  # [H]
        "layers": {name: jnp.asarray(w) for name, w in layers.items()},
    }
    if not config.tie_word_embeddings:
        params["lm_head"] = jnp.asarray(get("lm_head.weight"), dtype=dt)  # [V, H]
    return params


def _rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis in fp32; returns x's dtype."""
    x32 = x.astype(F32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * w).astype(x.dtype)


def _rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """HF rotate_half RoPE in fp32. x [B, S, N, D]; cos, sin [B, S, D] at each token's position."""
    x32 = x.astype(F32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * cos[:, :, None] + rotated * sin[:, :, None]).astype(x.dtype)


class Packing(NamedTuple):
    """Where each token of a (possibly packed, possibly chunked) step sits; see attention.py's rule.

    A row may hold several prompts (segments) and, before its new tokens, context: the KV of earlier
    tokens of those prompts (earlier chunks, or a cached prefix), passed per layer beside it.
    """

    positions: jax.Array  # int32 [B, S]: each new token's position in its prompt
    segments: jax.Array  # int32 [B, S]: each new token's prompt; padding -1
    context_positions: jax.Array  # int32 [B, C]
    context_segments: jax.Array  # int32 [B, C]: padding -2

    @staticmethod
    def plain(batch: int, length: int) -> Packing:
        """One prompt a row, right-padded, no context: causal attention and nothing else."""
        positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
        empty = jnp.zeros((batch, 0), jnp.int32)
        return Packing(positions, jnp.zeros((batch, length), jnp.int32), empty, empty)


def _layer(config: ModelConfig, cos: jax.Array, sin: jax.Array, packing: Packing, x: jax.Array, p: Params,
           context_k: jax.Array, context_v: jax.Array, kernels: Kernels = Kernels(), lora: LayerLora | None = None):
    """One decoder layer. x [B, S, H], context k, v [B, C, Hkv, D] -> (x [B, S, H], (k, v) [B, S, Hkv, D]).
    cos, sin [B, S, D], or [2, B, S, D] (global, local) for a model whose windowed layers have their own RoPE.
    lora: the tokens' LoRA adapters (lora_rows.py), whose deltas join the projections they target."""
    eps = config.rms_norm_eps
    delta = partial(add_delta, lora)
    if "rope" in p:
        cos, sin = cos[p["rope"]], sin[p["rope"]]
    w = partial(dequantize, p, dtype=x.dtype)  # int8/fp8 weights -> the compute dtype, fused by XLA
    matmul = kernels.matmul
    h = _rms_norm(x, p["attn_norm"], eps)
    if "wqkv" in p:  # q, k, v packed in one weight [H, Hq + 2 Hkv, D] (matmul.py's OnednnWeights)
        qkv = matmul("bsh,hnd->bsnd", h, p["wqkv"])  # [B, S, Hq + 2 Hkv, D]
        hq, hkv = config.num_heads, config.num_kv_heads
        q, k, v = qkv[:, :, :hq], qkv[:, :, hq : hq + hkv], qkv[:, :, hq + hkv :]
        q, k, v = delta("q_proj", h, q), delta("k_proj", h, k), delta("v_proj", h, v)
    else:
        q = delta("q_proj", h, matmul("bsh,hnd->bsnd", h, w("wq")))  # [B, S, Hq, D]
        k = delta("k_proj", h, matmul("bsh,hnd->bsnd", h, w("wk")))  # [B, S, Hkv, D]
        v = delta("v_proj", h, matmul("bsh,hnd->bsnd", h, w("wv")))  # [B, S, Hkv, D]
    if config.qkv_bias:
        q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
    if config.qk_norm:
        q, k = _rms_norm(q, p["q_norm"], eps), _rms_norm(k, p["k_norm"], eps)
    q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    keys = jnp.concatenate([context_k.astype(k.dtype), k], axis=1)  # [B, C + S, Hkv, D]
    values = jnp.concatenate([context_v.astype(v.dtype), v], axis=1)
    key_pos = jnp.concatenate([packing.context_positions, packing.positions], axis=1)  # [B, C + S]
    key_seg = jnp.concatenate([packing.context_segments, packing.segments], axis=1)
    out = kernels.attention(q, keys, values, packing.positions, packing.segments, key_pos, key_seg, p.get("window"),
                    own_keys_from=context_k.shape[1], scale=config.scale,
                    softcap=config.attn_softcap)  # [B, S, Hq, D]
    attn = delta("o_proj", out, matmul("bsnd,ndh->bsh", out, w("wo")))  # [B, S, H]
    if "bo" in p:
        attn = attn + p["bo"]
    if config.sandwich_norms:
        attn = _rms_norm(attn, p["attn_post_norm"], eps)
    x = x + attn
    h = _rms_norm(x, p["mlp_norm"], eps)
    act = jax.nn.silu if config.hidden_act == "silu" else partial(jax.nn.gelu, approximate=True)
    fused = None
    if config.moe is None and kernels.mlp is not None and lora is None:
        fused = kernels.mlp(h, p["w_gate"], p["w_up"], p["w_down"], "silu" if config.hidden_act == "silu" else
                            "gelu_tanh")  # [B, S, H], or None where it cannot
    if fused is not None:
        mlp = fused
    elif config.moe is not None:
        mlp = moe_mlp(h, w("router"), w("e_gate"), w("e_up"), w("e_down"), config.moe, act)  # [B, S, H]
    else:
        gate = delta("gate_proj", h, matmul("bsh,hi->bsi", h, w("w_gate")))  # [B, S, I]
        up = delta("up_proj", h, matmul("bsh,hi->bsi", h, w("w_up")))  # [B, S, I]
        hidden = act(gate) * up
        mlp = delta("down_proj", hidden, matmul("bsi,ih->bsh", hidden, w("w_down")))
    if config.sandwich_norms:
        mlp = _rms_norm(mlp, p["mlp_post_norm"], eps)
    return x + mlp, (k, v)


def _no_context(config: ModelConfig, layers: int, batch: int, dtype) -> tuple[jax.Array, jax.Array]:
    shape = (layers, batch, 0, config.num_kv_heads, config.head_dim)
    return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)


def _hidden(params: Params, tokens: jax.Array, config: ModelConfig, matmul: Matmul | Kernels = xla_matmul):
    """tokens [B, S] -> (hidden [B, S, H] before the final norm, k, v [L, B, S, Hkv, D])."""
    b, s = tokens.shape
    packing = Packing.plain(b, s)
    x, cos, sin = embed(params, tokens, packing.positions, config=config)
    context = _no_context(config, config.num_layers, b, x.dtype)
    x, k, v = layer_group(params["layers"], x, cos, sin, packing, *context, config=config, matmul=matmul)
    return x, k, v


def embed(params: Params, tokens: jax.Array, positions: jax.Array, *, config: ModelConfig
          ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """tokens, positions [B, S] -> (x [B, S, H], cos, sin [B, S, D]): what every layer group starts from.
    With a local RoPE (Gemma 3), cos and sin are [2, B, S, D]: the global layers' table, then the local ones'."""
    ropes = [config.rope] if config.local_rope is None else [config.rope, config.local_rope]
    freqs = jnp.asarray(np.stack([inv_freq(config, rope) for rope in ropes]))  # [R, D/2]
    angles = positions.astype(F32)[None, ..., None] * freqs[:, None, None]  # [R, B, S, D/2]
    angles = jnp.concatenate([angles, angles], axis=-1)  # [R, B, S, D]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if config.rope.attention_factor != 1.0:  # YaRN's (DeepSeek): cos and sin scaled in fp32, as transformers does
        cos, sin = cos * config.rope.attention_factor, sin * config.rope.attention_factor
    if config.local_rope is None:
        cos, sin = cos[0], sin[0]
    x = jnp.take(params["embed"], tokens, axis=0, mode="clip")  # [B, S, H]
    if config.embed_scale is not None:
        x = x * jnp.asarray(config.embed_scale, x.dtype)
    return x, cos, sin


def layer_group(
    layers: Params, x: jax.Array, cos: jax.Array, sin: jax.Array, packing: Packing, context_k: jax.Array,
    context_v: jax.Array, lora: LoraRows | None = None, *, config: ModelConfig,
    matmul: Matmul | Kernels = xla_matmul
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The layers of one group: their own weight stack [size, ...] (`split_layers`), x [B, S, H],
    context k, v [size, B, C, Hkv, D] -> (x, k, v [size, B, S, Hkv, D]) of the new tokens. lora: the group's LoRA
    slot stacks [size, N, ...] and each token's slot (None, without --enable-lora: the program has no LoRA input).

    `lax.scan` over the group's stack, each step reading its layer as the scan's slice. Indexing one
    stack of all L layers by a traced layer index instead (`dynamic_index_in_dim` in the scan body)
    made XLA:CPU copy weights on every call: ~0.4 s a layer on the Qwen2.5-0.5B shape, whatever the
    prompt length (a 32-token prefill took 3.4 s on one core, vLLM's 0.36 s).

    DeepSeek's (MLA): `deepseek.deepseek_layer_group`; k is then the latent entries [size, B, S, 1, C + R], v empty.
    """
    if config.mla is not None:
        return deepseek_layer_group(layers, x, cos, sin, packing, context_k, context_v, config=config)

    kernels = as_kernels(matmul)
    if lora is None:
        def step(h: jax.Array, xs):
            p, ck, cv = xs
            return _layer(config, cos, sin, packing, h, p, ck, cv, kernels)

        x, (k, v) = jax.lax.scan(step, x, (layers, context_k, context_v))
        return x, k, v
    stacks, onehot, active = one_layer(lora)

    def lora_step(h: jax.Array, xs):
        p, ck, cv, layer_stacks = xs
        return _layer(config, cos, sin, packing, h, p, ck, cv, kernels, LayerLora(layer_stacks, onehot, active))

    x, (k, v) = jax.lax.scan(lora_step, x, (layers, context_k, context_v, stacks))
    return x, k, v


def split_layers(layers: Params, groups: list[tuple[int, int]]) -> list[Params]:
    """The stack of every layer [L, ...] -> one stack per (first layer, layers) group (a slice keeps
    the stack's sharding of the other axes). A single group of all layers is the stack itself; DeepSeek's two
    stacks (dense and MoE layers) split by `deepseek.split_deepseek_layers`."""
    if set(layers) == {"dense", "moe"}:
        return split_deepseek_layers(layers, groups)
    num_layers = next(iter(jax.tree.leaves(layers))).shape[0]
    if groups == [(0, num_layers)]:
        return [layers]
    return [jax.tree.map(lambda w: w[start : start + size], layers) for start, size in groups]


def head(params: Params, x: jax.Array, index: jax.Array, *, config: ModelConfig) -> jax.Array:
    """x [B, S, H] after the last layer -> logits f32[R, V] at the flat token indexes index int32[R]."""
    x_last = jnp.take(x.reshape(-1, x.shape[-1]), index, axis=0, mode="clip")  # [R, H]
    return _logits(params, x_last, config)


def group_sizes(num_layers: int, num_groups: int) -> list[tuple[int, int]]:
    """(start, size) of each layer group: num_groups (at most num_layers) groups of even size."""
    size = -(-num_layers // max(1, min(num_groups, num_layers)))
    return [(start, min(size, num_layers - start)) for start in range(0, num_layers, size)]


HEAD_ROWS = 8
"""On the CPU backend, the lm_head multiplies at least this many rows: XLA:CPU's bf16 dot of a few rows by the
[V, H] head takes a matrix-vector path that reads the head as fp32 (~290 ms for Qwen2.5-0.5B's on one core),
where 8 rows take its matrix-matrix one (~38 ms); the padded rows' logits are dropped."""


def _logits(params: Params, x: jax.Array, config: ModelConfig) -> jax.Array:
    """x [..., H] -> f32 [..., V]."""
    h = _rms_norm(x, params["final_norm"], config.rms_norm_eps)
    head = params.get("lm_head", params["embed"])  # [V, H]
    rows = h.shape[0] if h.ndim == 2 else 0
    if 0 < rows < HEAD_ROWS and jax.default_backend() == "cpu":
        padded = jnp.pad(h, ((0, HEAD_ROWS - rows), (0, 0)))  # [HEAD_ROWS, H]
        logits = jnp.einsum("rh,vh->rv", padded, head, preferred_element_type=F32)[:rows]
    else:
        logits = jnp.einsum("...h,vh->...v", h, head, preferred_element_type=F32)
    cap = config.final_softcap
    return logits if cap is None else cap * jnp.tanh(logits / cap)


def prefill(
    params: Params, tokens: jax.Array, lengths: jax.Array, *, config: ModelConfig,
    matmul: Matmul | Kernels = xla_matmul
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """tokens int32[B, S] right-padded, lengths int32[B] -> (logits f32[B, V] at lengths-1, k, v).

    k, v [L, B, S, Hkv, D] in the compute dtype, k post-RoPE (HF rotate_half); positions at or after
    a row's length hold garbage. Right padding needs no mask beyond the causal one.
    """
    x, k, v = _hidden(params, tokens, config, matmul)
    last = jnp.clip(lengths - 1, 0, tokens.shape[1] - 1)  # [B]
    x_last = jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0]  # [B, H]
    return _logits(params, x_last, config), k, v


def make_prefill_fn(config: ModelConfig, matmul: Matmul | Kernels = xla_matmul) -> Callable:
    """The jitted prefill, called as fn(params, tokens, lengths); one compile per (B, S) shape."""
    return jax.jit(partial(prefill, config=config, matmul=matmul))


def prompt_logprobs_head(
    params: Params, x: jax.Array, next_tokens: jax.Array, *, config: ModelConfig, top: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """What the final hidden state x [B, S, H] (after the last layer) predicts at each position.

    Returns f32[B, S]: log p(next_tokens[i] | the prompt up to i), and top_ids int32[B, S, top],
    top_logprobs f32[B, S, top]: the most likely next tokens. A prompt's logprob of token j comes
    from position j - 1, which in a chunked prompt may lie in the chunk before j's.
    """
    logprobs = jax.nn.log_softmax(_logits(params, x, config), axis=-1)  # [B, S, V]
    chosen = jnp.take_along_axis(logprobs, next_tokens[..., None], axis=-1)[..., 0]  # [B, S]
    top_logprobs, top_ids = jax.lax.top_k(logprobs, top)  # [B, S, top]
    return chosen, top_ids, top_logprobs


def forward_logits(params: Params, tokens: jax.Array, *, config: ModelConfig,
                   matmul: Matmul | Kernels = xla_matmul) -> jax.Array:
    """Logits f32[B, S, V] at every position (for tests and benchmarks)."""
    x, _, _ = _hidden(params, tokens, config, matmul)
    return _logits(params, x, config)
