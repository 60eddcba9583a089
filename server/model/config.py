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
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def max_model_len(self) -> int:
        """Longest sequence (prompt + output) served with exact full attention."""
        return self.max_position_embeddings

    def limited_to(self, max_model_len: int | None) -> ModelConfig:
        """This model served no longer than `max_model_len` (`--max-model-len`); at most its own length."""
        if max_model_len is None or max_model_len == self.max_model_len:
            return self
        if max_model_len > self.max_model_len:
            raise ModelLoadError(f"--max-model-len {max_model_len} exceeds the model's max_model_len "
                                 f"{self.max_model_len} (max_position_embeddings in config.json)")
        return replace(self, max_position_embeddings=max_model_len)

    def describe(self) -> str:
        return (
            f"{self.family} L={self.num_layers} d={self.hidden_size} heads={self.num_heads}/"
            f"{self.num_kv_heads}x{self.head_dim} vocab={self.vocab_size} {self.dtype}"
        )


def _rope_from(raw: dict[str, Any]) -> RopeConfig:
    # transformers 5 writes `rope_parameters`; transformers 4 writes `rope_theta` + `rope_scaling`.
    params = dict(raw.get("rope_parameters") or {})
    scaling = dict(raw.get("rope_scaling") or {})
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    merged = {**scaling, **params}
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
    raise ModelLoadError(f"rope type {kind!r} is not supported (supported: default, llama3)")


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
    try:
        num_heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        head_dim = int(raw.get("head_dim") or hidden // num_heads)
        max_pos = int(raw.get("max_position_embeddings", 2048))
        window = raw.get("sliding_window")
        if family == "mistral" and window and raw.get("use_sliding_window", True):
            # Full attention is exact only inside the window: serve no longer than it.
            max_pos = min(max_pos, int(window))
        dtype = raw.get("torch_dtype") or raw.get("dtype") or "float32"
        if dtype not in ("float32", "bfloat16", "float16"):
            raise ModelLoadError(f"weight dtype {dtype!r} is not supported (float32, bfloat16, float16)")
        return ModelConfig(
            family=family,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=_rope_from(raw),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2" or bool(raw.get("attention_bias", False)),
            qk_norm=family == "qwen3",
            dtype=dtype,
            eos_token_ids=_eos_ids(model_dir, raw),
            bos_token_id=raw.get("bos_token_id"),
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
