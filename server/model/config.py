"""The model's architecture, read from an HF `config.json` (transformers 4 or 5 style)."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

log = logging.getLogger("pdserve.model")

Family = Literal["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "mixtral", "qwen3_moe", "deepseek_v2",
                 "deepseek_v3"]

ARCHITECTURES: dict[str, Family] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}


UNSUPPORTED: dict[str, tuple[str, str]] = {
    "KimiK2ForCausalLM": ("multi-head latent attention (MLA) under Kimi's own names", "DeepseekV3ForCausalLM"),
    "JambaForCausalLM": ("a hybrid of Mamba and attention layers", "MixtralForCausalLM"),
    "MambaForCausalLM": ("Mamba state-space layers", "MistralForCausalLM"),
    "Mamba2ForCausalLM": ("Mamba state-space layers", "MistralForCausalLM"),
    "FalconH1ForCausalLM": ("a hybrid of Mamba and attention layers", "LlamaForCausalLM"),
    "Zamba2ForCausalLM": ("a hybrid of Mamba and attention layers", "MistralForCausalLM"),
    "NemotronHForCausalLM": ("a hybrid of Mamba and attention layers", "LlamaForCausalLM"),
    "Qwen3NextForCausalLM": ("a hybrid of linear (gated DeltaNet) and attention layers", "Qwen3MoeForCausalLM"),
    "Gemma3ForConditionalGeneration": ("a multimodal model (vision tower)", "Gemma3ForCausalLM"),
    "LlavaForConditionalGeneration": ("a multimodal model (vision tower)", "LlamaForCausalLM"),
    "Qwen2VLForConditionalGeneration": ("a multimodal model (vision tower)", "Qwen2ForCausalLM"),
    "Qwen2_5_VLForConditionalGeneration": ("a multimodal model (vision tower)", "Qwen2ForCausalLM"),
    "Mistral3ForConditionalGeneration": ("a multimodal model (vision tower)", "MistralForCausalLM"),
    "Llama4ForConditionalGeneration": ("a multimodal model (vision tower)", "MixtralForCausalLM"),
}
"""Architectures pdserve knows it does not serve: what they need, and the nearest it does serve."""


_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "head_dim", "max_position_embeddings")


def _family(sizes: tuple, **fields: Any) -> dict[str, Any]:
    return {**dict(zip(_SIZES, sizes)), "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "rope_theta": 10000.0,
            **fields}


_GEMMA = {"hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True, "attention_bias": False,
          "query_pre_attn_scalar": 256, "sliding_window": 4096, "use_bidirectional_attention": None}
_QWEN_WINDOWS = {"use_sliding_window": False, "sliding_window": 4096}
_DEEPSEEK = {"hidden_act": "silu", "attention_bias": False, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
             "v_head_dim": 128, "kv_lora_rank": 512}

DEFAULTS: dict[Family, dict[str, Any]] = {
    # (vocab, hidden, intermediate, layers, heads, kv heads (None: heads), head_dim (None: hidden // heads), positions)
    "llama": _family((32000, 4096, 11008, 32, 32, None, None, 2048), hidden_act="silu", attention_bias=False,
                     mlp_bias=False),
    "mistral": _family((32000, 4096, 14336, 32, 32, 8, None, 131072), hidden_act="silu", sliding_window=4096),
    "qwen2": _family((151936, 4096, 22016, 32, 32, 32, None, 32768), hidden_act="silu", max_window_layers=28,
                     **_QWEN_WINDOWS),
    "qwen3": _family((151936, 4096, 22016, 32, 32, 32, 128, 32768), hidden_act="silu", attention_bias=False,
                     max_window_layers=28, **_QWEN_WINDOWS),
    "gemma2": _family((256000, 2304, 9216, 26, 8, 4, 256, 8192), **_GEMMA, final_logit_softcapping=30.0,
                      attn_logit_softcapping=50.0),
    "gemma3": _family((262208, 2304, 9216, 26, 8, 4, 256, 131072), **dict(_GEMMA, use_bidirectional_attention=False),
                      final_logit_softcapping=None, attn_logit_softcapping=None, rope_theta=1_000_000.0,
                      rope_local_base_freq=10_000.0, sliding_window_pattern=6),
    "mixtral": _family((32000, 4096, 14336, 32, 32, 8, None, 131072), hidden_act="silu", rms_norm_eps=1e-5,
                       rope_theta=1_000_000.0, sliding_window=None, num_local_experts=8, num_experts_per_tok=2),
    "qwen3_moe": _family((151936, 2048, 6144, 24, 32, 4, None, 32768), hidden_act="silu", attention_bias=False,
                         **_QWEN_WINDOWS, decoder_sparse_step=1, moe_intermediate_size=768, num_experts_per_tok=8,
                         num_experts=128, norm_topk_prob=False, mlp_only_layers=None),
    # head_dim: transformers 5 writes qk_rope_head_dim there (V2 reads nothing else; pdserve refuses another in V3)
    "deepseek_v2": _family((102400, 4096, 11008, 32, 32, None, None, 2048), **_DEEPSEEK, q_lora_rank=1536,
                           moe_intermediate_size=1407, n_routed_experts=64, num_experts_per_tok=None,
                           n_shared_experts=2, first_k_dense_replace=0, routed_scaling_factor=1.0,
                           norm_topk_prob=False, topk_method="greedy", n_group=None, topk_group=None,
                           mlp_bias=False),
    "deepseek_v3": _family((129280, 7168, 18432, 61, 128, 128, None, 4096), **_DEEPSEEK, q_lora_rank=1536,
                           moe_intermediate_size=2048, n_routed_experts=256, num_experts_per_tok=8,
                           n_shared_experts=1, first_k_dense_replace=3, routed_scaling_factor=2.5,
                           norm_topk_prob=True, n_group=8, topk_group=4, rope_interleave=True),
}
"""What a config.json that omits a field means: the default of the family's transformers config class
(`Gemma2Config().attn_logit_softcapping` is 50.0, ...) for each field pdserve reads. transformers' config
classes import torch, which pdserve's model code does not, so they are mirrored here;
tests/model/test_config_fields.py compares this table to the classes."""

_ALIASES: dict[str, dict[str, str]] = {
    "qwen3_moe": {"num_local_experts": "num_experts"},
    "deepseek_v2": {"num_experts": "n_routed_experts"},
    "deepseek_v3": {"num_local_experts": "n_routed_experts", "num_mtp_layers": "num_nextn_predict_layers"},
}
"""Fields under the other name transformers writes or reads (the class's attribute_map): read as the second."""


def with_defaults(family: Family, raw: dict[str, Any]) -> dict[str, Any]:
    """config.json's fields over the family's transformers defaults (`DEFAULTS`); a field set to null stays
    null, as transformers keeps it."""
    aliases = _ALIASES.get(family, {})
    raw = {aliases.get(k, k): v for k, v in raw.items()}
    return {**DEFAULTS[family], **raw}


class ModelLoadError(ValueError):
    """The model directory is missing, corrupt or holds an unsupported model."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    kind: Literal["default", "llama3", "linear", "yarn"] = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    """YaRN: the rotations bounding the frequencies kept as they are (extrapolated)."""
    beta_slow: float = 1.0
    """YaRN: the rotations bounding the frequencies interpolated (divided by factor)."""
    truncate: bool = True
    """YaRN: the correction range rounded outwards to whole dimensions."""
    attention_factor: float = 1.0
    """cos and sin multiplied by it (YaRN's: mscale(factor, mscale) / mscale(factor, mscale_all_dim))."""


@dataclass(frozen=True)
class MoeConfig:
    """A sparse MLP: a router picks each token's `top_k` of `num_experts` gated MLPs (softmax over all the
    router's logits in fp32, then the top k), whose outputs are summed weighted by those probabilities."""

    num_experts: int
    top_k: int
    intermediate_size: int
    """Each expert's."""
    renormalize: bool
    """The top k probabilities divided by their sum (Mixtral always; Qwen3-MoE and DeepSeek-V3 iff
    norm_topk_prob; DeepSeek-V2 never)."""
    scoring: Literal["softmax", "sigmoid"] = "softmax"
    """How router logits become scores: softmax over all experts, or each expert's sigmoid (DeepSeek-V3)."""
    num_groups: int = 1
    """Group-limited routing (DeepSeek's n_group): the experts in this many equal groups, of which only the
    `topk_groups` best are chosen from; 1: no groups."""
    topk_groups: int = 1
    group_score: Literal["max", "top2_sum"] = "max"
    """A group's score: its best expert's (DeepSeek-V2 group_limited_greedy) or the sum of its best two
    (DeepSeek-V3, with the correction bias)."""
    correction_bias: bool = False
    """DeepSeek-V3's e_score_correction_bias: added to the scores to choose the experts, never to weigh them."""
    routed_scale: float = 1.0
    """The chosen experts' weights multiplied by it (DeepSeek's routed_scaling_factor)."""
    shared_intermediate_size: int = 0
    """A dense MLP of this size over every token, added to the experts' sum (DeepSeek's shared experts:
    moe_intermediate_size x n_shared_experts); 0: none."""
    dense_layers: int = 0
    """The first layers have a dense MLP of intermediate_size instead (DeepSeek's first_k_dense_replace)."""


@dataclass(frozen=True)
class MlaConfig:
    """Multi-head latent attention (DeepSeek-V2/V3). Each token caches one latent of `kv_lora_rank` values
    (kv_a_layernorm of kv_a_proj_with_mqa's first outputs) and one rotated key of `qk_rope_head_dim` values shared
    by every head; heads expand them through kv_b_proj (decode absorbs it into the query and the output)."""

    kv_lora_rank: int
    q_lora_rank: int | None
    """None: the query is one projection (q_proj, V2-Lite); else q_a_proj, q_a_layernorm, q_b_proj."""
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_pairs: Literal["halves", "deinterleaved", "interleaved"]
    """How the rope dimensions are rotated and laid out: halves (HF's rotate_half: V3 with rope_interleave
    false); deinterleaved (pairs (x[2i], x[2i+1]) rotated and written as [evens | odds]: V3's rope_interleave);
    interleaved (the same pairs written back in place: V2)."""

    @property
    def latent_dim(self) -> int:
        """Values a token caches per layer: the latent and the rotated key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class ModelConfig:
    family: Family
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    """Qwen2 carries biases on q/k/v projections."""
    qk_norm: bool
    """Qwen3 RMS-normalises q and k per head before RoPE."""
    dtype: Literal["float32", "bfloat16", "float16"]
    """The dtype the checkpoint's weights are stored in."""
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    sliding_window: int | None = None
    """The window of the checkpoint's sliding-window layers (a query at position p sees keys at positions
    p - W < j <= p, itself among them), None when every layer attends to all."""
    layer_windows: tuple[int | None, ...] = ()
    """Each layer's window (None: full attention), by transformers' rules for the family; () when no layer
    has one."""
    hidden_act: Literal["silu", "gelu_tanh"] = "silu"
    """The gated MLP's activation: silu (SwiGLU) or gelu with the tanh approximation (Gemma's GeGLU)."""
    norm_offset: bool = False
    """Gemma's RMSNorms scale by (1 + w): the loaders add the 1 to every norm weight (exact in fp32)."""
    sandwich_norms: bool = False
    """Gemma's layer: norms after attention and around the MLP (post_attention_layernorm normalises the
    attention's output; pre_/post_feedforward_layernorm the MLP's input and output)."""
    attn_scale: float | None = None
    """The scores' scale (Gemma: query_pre_attn_scalar ** -0.5); None: head_dim ** -0.5."""
    attn_softcap: float | None = None
    """Attention scores soft-capped to cap * tanh(s / cap) before the mask (Gemma 2's attn_logit_softcapping;
    transformers' Gemma 3 ignores its own, which pdserve refuses when set)."""
    final_softcap: float | None = None
    """Logits soft-capped the same way (Gemma 2's and Gemma 3's final_logit_softcapping)."""
    embed_scale: float | None = None
    """Embeddings multiplied by it (Gemma: sqrt(hidden_size), in the weights' dtype)."""
    local_rope: RopeConfig | None = None
    """The windowed layers' own RoPE (Gemma 3's rope_local_base_freq); None: every layer uses `rope`."""
    moe: MoeConfig | None = None
    """Every layer's MLP is a mixture of experts (Mixtral, Qwen3-MoE; DeepSeek's from `moe.dense_layers` on);
    None: a dense MLP."""
    mla: MlaConfig | None = None
    """Multi-head latent attention (DeepSeek): then num_kv_heads is 1 and head_dim the latent's width
    (`MlaConfig.latent_dim`), the shape of what the KV cache holds per token and layer (K only, no V)."""
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def rope_dim(self) -> int:
        """The dimensions RoPE rotates (MLA: qk_rope_head_dim; else the head's)."""
        return self.head_dim if self.mla is None else self.mla.qk_rope_head_dim

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5 if self.attn_scale is None else self.attn_scale

    def rope_of(self, layer: int) -> RopeConfig:
        """Layer `layer`'s RoPE."""
        return self.local_rope if self.local_rope is not None and self.window(layer) is not None else self.rope

    @property
    def max_model_len(self) -> int:
        """Longest sequence (prompt + output) served."""
        return self.max_position_embeddings

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s window (None: it attends to every earlier position)."""
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def all_windowed(self) -> bool:
        """Every layer has a window: KV older than the widest window is never read again."""
        return bool(self.layer_windows) and all(w is not None for w in self.layer_windows)

    def limited_to(self, max_model_len: int | None) -> ModelConfig:
        """This model served no longer than `max_model_len` (`--max-model-len`; None: its own length), every
        process's one way to its served length. ModelLoadError past the model's positions."""
        if max_model_len is not None and max_model_len > self.max_model_len:
            raise ModelLoadError(f"--max-model-len {max_model_len} exceeds the model's max_model_len "
                                 f"{self.max_model_len} (max_position_embeddings in config.json)")
        length = self.max_model_len if max_model_len is None else max_model_len
        return self if length == self.max_model_len else replace(self, max_position_embeddings=length)

    def describe(self) -> str:
        return (
            f"{self.family} L={self.num_layers} d={self.hidden_size} heads={self.num_heads}/"
            f"{self.num_kv_heads}x{self.head_dim} vocab={self.vocab_size} {self.dtype}"
            + ("" if self.moe is None else f" experts={self.moe.top_k}/{self.moe.num_experts}")
            + ("" if self.mla is None else f" mla latent={self.mla.kv_lora_rank}+{self.mla.qk_rope_head_dim}")
        )


def _refused(setting: str, what: str) -> ModelLoadError:
    return ModelLoadError(f"config.json sets {setting}: {what}")


def _gemma3_ropes(raw: dict[str, Any]) -> tuple[RopeConfig, RopeConfig]:
    """(global, local) RoPE of Gemma 3: transformers 5 writes rope_parameters per layer type; transformers 4
    rope_theta and rope_scaling for the global layers, rope_local_base_freq for the local ones."""
    params = raw.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:  # rope_scaling, if any, over the global's
        partial = {"partial_rotary_factor": raw["partial_rotary_factor"]} if "partial_rotary_factor" in raw else {}
        full = {"rope_theta": raw["rope_theta"], **partial, **(params.get("full_attention") or {}),
                **(raw.get("rope_scaling") or {})}
        local = {"rope_theta": raw["rope_local_base_freq"], **partial, **(params.get("sliding_attention") or {})}
        return _rope_from({"rope_parameters": full}), _rope_from({"rope_parameters": local})
    return _rope_from(raw), _rope_from({"rope_theta": raw["rope_local_base_freq"]})


def _rope_from(raw: dict[str, Any], yarn: bool = False) -> RopeConfig:
    # transformers 5 writes `rope_parameters`; transformers 4 writes `rope_theta` + `rope_scaling`.
    # A missing rope_theta is the family's (`DEFAULTS`: transformers' default_theta), else 10000.
    params = dict(raw.get("rope_parameters") or {})
    scaling = dict(raw.get("rope_scaling") or {})
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    merged = {**scaling, **params}
    partial = merged.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    if partial is not None and float(partial) != 1.0:
        raise _refused(f"partial_rotary_factor {partial}", "pdserve rotates every dimension of a head "
                       "(partial rotary embeddings are not implemented)")
    kind = merged.get("rope_type", merged.get("type", "default")) or "default"
    if kind == "default":
        return RopeConfig(theta=float(theta))
    if kind == "linear":
        return RopeConfig(theta=float(theta), kind="linear", factor=float(merged["factor"]))
    if kind == "llama3":
        return RopeConfig(
            theta=float(theta),
            kind="llama3",
            factor=float(merged["factor"]),
            low_freq_factor=float(merged["low_freq_factor"]),
            high_freq_factor=float(merged["high_freq_factor"]),
            original_max_position_embeddings=int(merged["original_max_position_embeddings"]),
        )
    if kind == "yarn" and yarn:
        return _yarn(float(theta), merged, int(raw["max_position_embeddings"]))
    where = "rope_parameters" if raw.get("rope_parameters") else "rope_scaling"
    key = "rope_type" if "rope_type" in merged else "type"
    served = "default, linear, llama3 and (for DeepSeek) yarn" if yarn else "default, linear and llama3 (yarn for " \
        "DeepSeek only)"
    raise _refused(f"{where}.{key} {kind!r}", f"pdserve implements the {served} RoPE only "
                   "(other types change the positions' angles, so would be served wrong)")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude scale, as transformers' (and DeepSeek's) get_mscale computes it."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(theta: float, params: dict[str, Any], max_positions: int) -> RopeConfig:
    """YaRN as transformers' _compute_yarn_parameters reads its parameters."""
    original = int(params["original_max_position_embeddings"])
    factor = float(params["factor"]) if params.get("factor") is not None else max_positions / original
    attention_factor = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if attention_factor is None:
        attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim) \
            if mscale and mscale_all_dim else yarn_mscale(factor)
    return RopeConfig(theta=theta, kind="yarn", factor=factor, original_max_position_embeddings=original,
                      beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
                      truncate=bool(params.get("truncate", True)), attention_factor=float(attention_factor))


def _mla_scale(raw: dict[str, Any], head_dim: int) -> float:
    """MLA's softmax scale (transformers' yarn_apply_mscale): (nope + rope) ** -0.5, times
    mscale(factor, mscale_all_dim) squared under a scaled RoPE that sets mscale_all_dim."""
    params = {**(raw.get("rope_scaling") or {}), **(raw.get("rope_parameters") or {})}
    scale = head_dim**-0.5
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind != "default" and params.get("mscale_all_dim"):
        m = yarn_mscale(float(params["factor"]), params["mscale_all_dim"])
        scale = scale * m * m
    return scale


def _layer_windows(family: Family, raw: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    """Each layer's window, by transformers' rules for the family; () when no layer has one."""
    types = raw.get("layer_types")
    if types is not None:
        unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise _refused(f"layer_types with {', '.join(map(repr, unknown))} layers",
                           "pdserve implements full_attention and sliding_attention layers only")
        if len(types) != num_layers:
            raise _refused(f"layer_types of {len(types)} layers", f"the model has {num_layers} layers")
    if family in ("gemma2", "gemma3") and types is None:  # transformers 4: alternating, every Nth layer global
        every = 2 if family == "gemma2" else int(raw["sliding_window_pattern"])
        types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(num_layers)]
    window = raw.get("sliding_window")
    if family in ("mistral", "mixtral") or (family == "qwen3_moe" and raw["use_sliding_window"]):  # every layer
        return (int(window),) * num_layers if window else ()
    if family == "qwen3_moe":
        return ()
    if family in ("qwen2", "qwen3"):  # use_sliding_window false: no window (Qwen2.5 ships one set, unused)
        if not raw["use_sliding_window"] or not window:
            return ()
        if types is None:  # transformers 4: the layers from max_window_layers on
            first = int(raw["max_window_layers"])
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    if types is None or "sliding_attention" not in types:
        return ()
    if family == "llama":
        raise _refused("layer_types with 'sliding_attention' layers", "transformers' Llama computes full attention "
                       "in every layer whatever layer_types says; a windowed model is another architecture")
    if not window:
        raise _refused("layer_types with 'sliding_attention' layers but no sliding_window",
                       "a sliding_attention layer needs the window's length")
    return tuple(int(window) if t == "sliding_attention" else None for t in types)


def _refuse_unimplemented(family: Family, raw: dict[str, Any]) -> None:
    """Refuses what config.json asks of the model that pdserve's models do not compute (so would serve
    approximately). Fields a family's transformers code ignores (Mistral's and Qwen2's attention_bias, their
    mlp_bias) are ignored here too."""
    quant = raw.get("quantization_config")
    if quant:
        from pdserve.server.model.fp8_checkpoint import Fp8Blocks

        try:
            Fp8Blocks.from_config(quant)
        except ValueError as e:
            method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
            raise _refused(f"quantization_config (quant_method {method!r})", str(e)) from e
    if family in ("gemma2", "gemma3"):
        act = raw.get("hidden_activation") or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise _refused(f"hidden_activation {act!r}", "pdserve's Gemma MLP implements gelu_pytorch_tanh only")
        if raw.get("attention_bias"):
            raise _refused("attention_bias true", "pdserve's Gemma has no attention biases")
        if raw.get("use_bidirectional_attention"):
            raise _refused("use_bidirectional_attention true", "pdserve serves causal language models only")
        if family == "gemma3" and raw.get("attn_logit_softcapping") is not None:
            raise _refused(f"attn_logit_softcapping {raw['attn_logit_softcapping']}",
                           "transformers' and vLLM's Gemma 3 never soft-cap its attention scores (qk-norm bounds "
                           "them; only Gemma 2 caps), so whether this checkpoint was trained capped is unknown; "
                           "set it to null to serve it as they do")
        return
    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise _refused(f"hidden_act {act!r}", "pdserve's MLP implements silu (SwiGLU) only")
    for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
        if raw.get(cap) is not None:
            raise _refused(f"{cap} {raw[cap]}", f"transformers' {family} does not soft-cap (Gemma 2 does)")
    if family in ("deepseek_v2", "deepseek_v3"):
        _refuse_unimplemented_mla(family, raw)
    if family in ("llama", "qwen3", "qwen3_moe") and raw.get("attention_bias"):
        raise _refused("attention_bias true", "pdserve's decode tier does not implement the o_proj bias it "
                       "brings (q/k/v biases are implemented)")
    if family == "llama" and raw.get("mlp_bias"):
        raise _refused("mlp_bias true", "pdserve does not implement biases on the MLP's projections")


def _refuse_unimplemented_mla(family: Family, raw: dict[str, Any]) -> None:
    """DeepSeek's fields that change what transformers computes in ways pdserve's MLA does not; the MTP layers
    (num_nextn_predict_layers), which transformers' forward never runs, are left out with a log line."""
    if raw.get("attention_bias"):
        raise _refused("attention_bias true", "pdserve's MLA has no biases on q_a_proj, kv_a_proj_with_mqa, o_proj")
    if raw.get("mlp_bias"):
        raise _refused("mlp_bias true", "pdserve does not implement biases on the MLP's projections")
    heads, kv_heads = raw["num_attention_heads"], raw["num_key_value_heads"]
    if kv_heads is not None and kv_heads != heads:
        raise _refused(f"num_key_value_heads {kv_heads} (num_attention_heads {heads})",
                       "MLA expands its latent into every query head; transformers' DeepSeek breaks when these differ")
    if raw.get("moe_layer_freq", 1) != 1:
        raise _refused(f"moe_layer_freq {raw['moe_layer_freq']}", "transformers' DeepSeek puts experts in every "
                       "layer from first_k_dense_replace on (it ignores the field; DeepSeek's own code would skip "
                       "layers), so which this checkpoint means is unknown; pdserve serves moe_layer_freq 1")
    scoring = "sigmoid" if family == "deepseek_v3" else "softmax"
    if raw.get("scoring_func", scoring) != scoring:
        raise _refused(f"scoring_func {raw['scoring_func']!r}", f"transformers' {family} routes by {scoring} scores")
    methods = ("noaux_tc",) if family == "deepseek_v3" else ("greedy", "group_limited_greedy")
    if (raw.get("topk_method") or methods[0]) not in methods:
        raise _refused(f"topk_method {raw['topk_method']!r}", f"transformers' {family} routes by "
                       f"{' or '.join(methods)}")
    if raw.get("num_nextn_predict_layers"):
        log.info("%s: the checkpoint's %d multi-token-prediction (MTP) layer(s) are not loaded (pdserve serves the "
                 "main model; transformers' forward does not run them either)", family,
                 raw["num_nextn_predict_layers"])


def _mla_from(family: Family, raw: dict[str, Any]) -> MlaConfig | None:
    if family not in ("deepseek_v2", "deepseek_v3"):
        return None
    q_lora = raw["q_lora_rank"]
    pairs = "interleaved" if family == "deepseek_v2" else "deinterleaved" if raw["rope_interleave"] else "halves"
    mla = MlaConfig(kv_lora_rank=int(raw["kv_lora_rank"]), q_lora_rank=None if q_lora is None else int(q_lora),
                    qk_nope_head_dim=int(raw["qk_nope_head_dim"]), qk_rope_head_dim=int(raw["qk_rope_head_dim"]),
                    v_head_dim=int(raw["v_head_dim"]), rope_pairs=pairs)
    head_dim = raw.get("head_dim")  # V2's config class overwrites it with qk_rope_head_dim; V3's keeps it
    if family == "deepseek_v3" and head_dim is not None and int(head_dim) != mla.qk_rope_head_dim:
        raise _refused(f"head_dim {head_dim} (qk_rope_head_dim {mla.qk_rope_head_dim})",
                       "DeepSeek-V3's head_dim is its rotary width (transformers 5 writes qk_rope_head_dim there and "
                       "rotates that many dimensions, failing on any other); drop it or set it to qk_rope_head_dim")
    if mla.qk_rope_head_dim % 2:
        raise _refused(f"qk_rope_head_dim {mla.qk_rope_head_dim}", "RoPE rotates pairs of dimensions: it must be even")
    return mla


def _deepseek_moe(family: Family, raw: dict[str, Any]) -> MoeConfig:
    if raw["num_experts_per_tok"] is None:
        raise _refused("num_experts_per_tok null", "a DeepSeek MoE routes each token to that many experts")
    v3 = family == "deepseek_v3"
    groups = int(raw["n_group"] or 1) if v3 or raw["topk_method"] == "group_limited_greedy" else 1
    experts = int(raw["n_routed_experts"])
    if experts % groups:
        raise _refused(f"n_group {groups}", f"the {experts} routed experts must split into equal groups")
    return MoeConfig(experts, int(raw["num_experts_per_tok"]), int(raw["moe_intermediate_size"]),
                     renormalize=v3 and bool(raw["norm_topk_prob"]), scoring="sigmoid" if v3 else "softmax",
                     num_groups=groups, topk_groups=int(raw["topk_group"] or 1) if groups > 1 else 1,
                     group_score="top2_sum" if v3 else "max", correction_bias=v3,
                     routed_scale=float(raw["routed_scaling_factor"]),
                     shared_intermediate_size=int(raw["moe_intermediate_size"]) * int(raw["n_shared_experts"] or 0),
                     dense_layers=int(raw["first_k_dense_replace"] or 0))


def _moe_from(family: Family, raw: dict[str, Any]) -> MoeConfig | None:
    if family in ("deepseek_v2", "deepseek_v3"):
        return _deepseek_moe(family, raw)
    if family == "mixtral":
        return MoeConfig(int(raw["num_local_experts"]), int(raw["num_experts_per_tok"]), int(raw["intermediate_size"]),
                         renormalize=True)
    if family != "qwen3_moe":
        return None
    if raw["mlp_only_layers"]:
        raise _refused(f"mlp_only_layers {raw['mlp_only_layers']}", "pdserve's Qwen3-MoE has experts in every layer")
    if int(raw["decoder_sparse_step"]) != 1:
        raise _refused(f"decoder_sparse_step {raw['decoder_sparse_step']}",
                       "pdserve's Qwen3-MoE has experts in every layer")
    # Qwen's checkpoints write num_experts, transformers 5 num_local_experts (`with_defaults` reads it as the first)
    return MoeConfig(int(raw["num_experts"]), int(raw["num_experts_per_tok"]), int(raw["moe_intermediate_size"]),
                     renormalize=bool(raw["norm_topk_prob"]))


def _eos_ids(model_dir: Path, raw: dict[str, Any]) -> tuple[int, ...]:
    eos: Any = raw.get("eos_token_id")
    gen_path = model_dir / "generation_config.json"
    if gen_path.exists():
        gen = json.loads(gen_path.read_text())
        if gen.get("eos_token_id") is not None:
            eos = gen["eos_token_id"]
    if eos is None:
        return ()
    return tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))


def parse_config(raw: dict[str, Any], model_dir: Path = Path(".")) -> ModelConfig:
    archs = raw.get("architectures") or []
    family = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    known = next((a for a in archs if a in UNSUPPORTED), None)
    if family is None and known is not None:
        what, nearest = UNSUPPORTED[known]
        raise ModelLoadError(f"architecture {known} is not supported: it needs {what}, which pdserve does not "
                             f"implement; the nearest it serves is {nearest} "
                             f"(pdserve serves {', '.join(ARCHITECTURES)})")
    if family is None:
        raise ModelLoadError(
            f"architecture {archs or raw.get('model_type')!r} is not supported; "
            f"pdserve serves {', '.join(ARCHITECTURES)}"
        )
    fields = with_defaults(family, raw)
    _refuse_unimplemented(family, fields)
    try:
        num_heads = int(fields["num_attention_heads"])
        hidden = int(fields["hidden_size"])
        mla = _mla_from(family, fields)
        head_dim = mla.latent_dim if mla else int(fields.get("head_dim") or hidden // num_heads)
        num_layers = int(fields["num_hidden_layers"])
        windows = _layer_windows(family, fields, num_layers)
        dtype_key = "torch_dtype" if raw.get("torch_dtype") else "dtype"
        dtype = raw.get(dtype_key) or "float32"
        if dtype not in ("float32", "bfloat16", "float16"):
            raise _refused(f"{dtype_key} {dtype!r}", "pdserve serves float32, bfloat16 and float16 weights")
        gemma = family in ("gemma2", "gemma3")
        rope, local_rope = _gemma3_ropes(fields) if family == "gemma3" else (_rope_from(fields, mla is not None), None)
        scalar = fields["query_pre_attn_scalar"] if gemma else None
        qk_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim if mla else 0
        return ModelConfig(
            family=family,
            vocab_size=int(fields["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(fields["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=1 if mla else int(fields["num_key_value_heads"] or num_heads),
            head_dim=head_dim,
            rms_norm_eps=float(fields["rms_norm_eps"]),
            rope=rope,
            max_position_embeddings=int(fields["max_position_embeddings"]),
            tie_word_embeddings=bool(fields["tie_word_embeddings"]),
            qkv_bias=family == "qwen2",
            qk_norm=family in ("qwen3", "gemma3", "qwen3_moe"),
            dtype=dtype,
            eos_token_ids=_eos_ids(model_dir, raw),
            bos_token_id=raw.get("bos_token_id"),
            sliding_window=next((w for w in windows if w is not None), None),
            layer_windows=windows,
            hidden_act="gelu_tanh" if gemma else "silu",
            norm_offset=gemma,
            sandwich_norms=gemma,
            attn_scale=_mla_scale(fields, qk_dim) if mla else None if scalar is None else float(scalar) ** -0.5,
            attn_softcap=_cap(fields, "attn_logit_softcapping") if family == "gemma2" else None,
            final_softcap=_cap(fields, "final_logit_softcapping") if gemma else None,
            embed_scale=hidden**0.5 if gemma else None,
            local_rope=local_rope,
            moe=_moe_from(family, fields),
            mla=mla,
            raw=raw,
        )
    except KeyError as e:
        raise ModelLoadError(f"config.json lacks the field {e.args[0]!r}") from e


def _cap(raw: dict[str, Any], name: str) -> float | None:
    value = raw.get(name)
    return None if value is None else float(value)


def load_config(model_dir: str | Path) -> ModelConfig:
    model_dir = Path(model_dir)
    path = model_dir / "config.json"
    if not model_dir.is_dir():
        raise ModelLoadError(f"model directory {str(model_dir)!r} does not exist")
    if not path.exists():
        raise ModelLoadError(f"{path} is missing: point --model at an HF checkpoint directory")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from e
    return parse_config(raw, model_dir)


def served_model_name(model_dir: str | Path) -> str:
    """The name clients give `model` by default: the checkpoint directory's name."""
    return Path(model_dir).resolve().name


def resolve_max_model_len(model_max: int, flag: int = 0, capacity: int | None = None) -> int:
    """A tier's max_model_len: `--max-model-len` (0: the model's), capped by what its cache holds.

    Raises ValueError when the flag asks for more than the model's positions.
    """
    if flag > model_max:
        raise ValueError(f"--max-model-len {flag} exceeds the model's max_model_len {model_max}")
    length = flag or model_max
    return length if capacity is None else min(length, capacity)
