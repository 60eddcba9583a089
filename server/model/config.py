"""The model's architecture, read from an HF `config.json` (transformers 4 or 5 style)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

Family = Literal["llama", "mistral", "qwen2", "qwen3"]

ARCHITECTURES: dict[str, Family] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


class ModelLoadError(ValueError):
    """The model directory is missing, corrupt or holds an unsupported model."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    kind: Literal["default", "llama3"] = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


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
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

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
        )


def _refused(setting: str, what: str) -> ModelLoadError:
    return ModelLoadError(f"config.json sets {setting}: {what}")


def _rope_from(raw: dict[str, Any]) -> RopeConfig:
    # transformers 5 writes `rope_parameters`; transformers 4 writes `rope_theta` + `rope_scaling`.
    # A missing rope_theta is transformers' default_theta, 10000, for all four families.
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
    raise _refused(f"{where}.{key} {kind!r}", "pdserve implements the default and llama3 RoPE only "
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
    if family == "mistral":  # every layer; transformers' MistralConfig takes 4096 when the key is absent
        window = raw.get("sliding_window", 4096)
        return (int(window),) * num_layers if window else ()
    window = raw.get("sliding_window")
    if family in ("qwen2", "qwen3"):  # use_sliding_window false: no window (Qwen2.5 ships one set, unused)
        if not raw.get("use_sliding_window", False) or not window:
            return ()
        if types is None:  # transformers 4: the layers from max_window_layers on
            first = int(raw.get("max_window_layers", 28))
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
    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise _refused(f"hidden_act {act!r}", "pdserve's MLP implements silu (SwiGLU) only")
    for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
        if raw.get(cap) is not None:
            raise _refused(f"{cap} {raw[cap]}", "pdserve does not implement logit soft-capping")
    if family in ("llama", "qwen3") and raw.get("attention_bias"):
        raise _refused("attention_bias true", "pdserve's decode tier does not implement the o_proj bias it "
                       "brings (q/k/v biases are implemented)")
    if family == "llama" and raw.get("mlp_bias"):
        raise _refused("mlp_bias true", "pdserve does not implement biases on the MLP's projections")


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
    if family is None:
        raise ModelLoadError(
            f"architecture {archs or raw.get('model_type')!r} is not supported; "
            f"pdserve serves {', '.join(ARCHITECTURES)}"
        )
    _refuse_unimplemented(family, raw)
    try:
        num_heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        head_dim = int(raw.get("head_dim") or hidden // num_heads)
        num_layers = int(raw["num_hidden_layers"])
        windows = _layer_windows(family, raw, num_layers)
        dtype_key = "torch_dtype" if raw.get("torch_dtype") else "dtype"
        dtype = raw.get(dtype_key) or "float32"
        if dtype not in ("float32", "bfloat16", "float16"):
            raise _refused(f"{dtype_key} {dtype!r}", "pdserve serves float32, bfloat16 and float16 weights")
        return ModelConfig(
            family=family,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=_rope_from(raw),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2",
            qk_norm=family == "qwen3",
            dtype=dtype,
            eos_token_ids=_eos_ids(model_dir, raw),
            bos_token_id=raw.get("bos_token_id"),
            sliding_window=next((w for w in windows if w is not None), None),
            layer_windows=windows,
            raw=raw,
        )
    except KeyError as e:
        raise ModelLoadError(f"config.json lacks the field {e.args[0]!r}") from e


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
