"""The model's architecture, read from an HF `config.json` (transformers 4 or 5 style)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

Family = Literal["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "mixtral", "qwen3_moe"]

ARCHITECTURES: dict[str, Family] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}


UNSUPPORTED: dict[str, tuple[str, str]] = {
    "DeepseekV2ForCausalLM": ("multi-head latent attention (MLA)", "Qwen3MoeForCausalLM"),
    "DeepseekV3ForCausalLM": ("multi-head latent attention (MLA)", "Qwen3MoeForCausalLM"),
    "KimiK2ForCausalLM": ("multi-head latent attention (MLA)", "Qwen3MoeForCausalLM"),
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
}
"""What a config.json that omits a field means: the default of the family's transformers config class
(`Gemma2Config().attn_logit_softcapping` is 50.0, ...) for each field pdserve reads. transformers' config
classes import torch, which pdserve's model code does not, so they are mirrored here;
tests/model/test_config_fields.py compares this table to the classes."""

_ALIASES: dict[str, str] = {"num_local_experts": "num_experts"}
"""Qwen3-MoE's fields under the other name transformers 5 writes (its attribute_map): read as the first."""


def with_defaults(family: Family, raw: dict[str, Any]) -> dict[str, Any]:
    """config.json's fields over the family's transformers defaults (`DEFAULTS`); a field set to null stays
    null, as transformers keeps it."""
    if family == "qwen3_moe":
        raw = {_ALIASES.get(k, k): v for k, v in raw.items()}
    return {**DEFAULTS[family], **raw}


class ModelLoadError(ValueError):
    """The model directory is missing, corrupt or holds an unsupported model."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    kind: Literal["default", "llama3", "linear"] = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class MoeConfig:
    """A sparse MLP: a router picks each token's `top_k` of `num_experts` gated MLPs (softmax over all the
    router's logits in fp32, then the top k), whose outputs are summed weighted by those probabilities."""

    num_experts: int
    top_k: int
    intermediate_size: int
    """Each expert's."""
    renormalize: bool
    """The top k probabilities divided by their sum (Mixtral always; Qwen3-MoE iff norm_topk_prob)."""


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
    """Every layer's MLP is a mixture of experts (Mixtral, Qwen3-MoE); None: a dense MLP."""
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

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


def _rope_from(raw: dict[str, Any]) -> RopeConfig:
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
    where = "rope_parameters" if raw.get("rope_parameters") else "rope_scaling"
    key = "rope_type" if "rope_type" in merged else "type"
    raise _refused(f"{where}.{key} {kind!r}", "pdserve implements the default, linear and llama3 RoPE only "
                   "(other types change the positions' angles, so would be served wrong)")


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
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
        raise _refused(f"quantization_config (quant_method {method!r})",
                       "pdserve does not load pre-quantized checkpoints; serve the unquantized checkpoint "
                       "and quantize at load with --quantization fp8 or int8")
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
    if family in ("llama", "qwen3", "qwen3_moe") and raw.get("attention_bias"):
        raise _refused("attention_bias true", "pdserve's decode tier does not implement the o_proj bias it "
                       "brings (q/k/v biases are implemented)")
    if family == "llama" and raw.get("mlp_bias"):
        raise _refused("mlp_bias true", "pdserve does not implement biases on the MLP's projections")


def _moe_from(family: Family, raw: dict[str, Any]) -> MoeConfig | None:
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
        head_dim = int(fields.get("head_dim") or hidden // num_heads)
        num_layers = int(fields["num_hidden_layers"])
        windows = _layer_windows(family, fields, num_layers)
        dtype_key = "torch_dtype" if raw.get("torch_dtype") else "dtype"
        dtype = raw.get(dtype_key) or "float32"
        if dtype not in ("float32", "bfloat16", "float16"):
            raise _refused(f"{dtype_key} {dtype!r}", "pdserve serves float32, bfloat16 and float16 weights")
        gemma = family in ("gemma2", "gemma3")
        rope, local_rope = _gemma3_ropes(fields) if family == "gemma3" else (_rope_from(fields), None)
        scalar = fields["query_pre_attn_scalar"] if gemma else None
        return ModelConfig(
            family=family,
            vocab_size=int(fields["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(fields["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(fields["num_key_value_heads"] or num_heads),
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
            attn_scale=None if scalar is None else float(scalar) ** -0.5,
            attn_softcap=_cap(fields, "attn_logit_softcapping") if family == "gemma2" else None,
            final_softcap=_cap(fields, "final_logit_softcapping") if gemma else None,
            embed_scale=hidden**0.5 if gemma else None,
            local_rope=local_rope,
            moe=_moe_from(family, fields),
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
