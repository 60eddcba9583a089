"""`--speculative-config`: vLLM's flag and JSON keys, parsed and validated once (no torch here: the CLI
parses it).

    --speculative-config '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                           "prompt_lookup_min": 2}'
    --speculative-config '{"method": "draft_model", "model": "/models/small", "num_speculative_tokens": 3}'

Keys (vLLM's names): method (ngram or draft_model), num_speculative_tokens (k, the most tokens proposed per
sequence per step), disable_by_batch_size (speculation off for a step whose batch has at least this many
sequences); for ngram prompt_lookup_min / prompt_lookup_max (the n-gram lengths matched, longest first); for
draft_model model (the draft checkpoint's directory: any family the native engine serves, sharing the target's
tokenizer, checked by `draft_checkpoint.py`) and draft_tensor_parallel_size (1 only: the draft runs on the
target's one device). Any other key, or a key of the other method, is refused by name, so a vLLM config that
means more than pdserve does is never half-applied.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal, get_args

SpecMethod = Literal["ngram", "draft_model"]
SPEC_METHODS: tuple[str, ...] = get_args(SpecMethod)


@dataclass(frozen=True)
class SpeculativeConfig:
    method: SpecMethod = "ngram"
    num_speculative_tokens: int = 3
    """k: the most proposed tokens a sequence verifies per step (k + 1 query positions)."""
    prompt_lookup_min: int = 1
    """The shortest suffix n-gram looked up in the sequence's earlier tokens."""
    prompt_lookup_max: int = 3
    """The longest suffix n-gram looked up (tried first)."""
    disable_by_batch_size: int | None = None
    """vLLM's key: no speculation in a step of at least this many sequences (beside the measured-cost rule)."""
    model: str | None = None
    """draft_model: the draft checkpoint's directory."""
    draft_tensor_parallel_size: int = 1
    """draft_model: vLLM's key; the native engine runs the draft on the target's one device (1 only)."""

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"--speculative-config: method must be one of {', '.join(SPEC_METHODS)}, "
                             f"not {self.method!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"--speculative-config: num_speculative_tokens must be >= 1, got "
                             f"{self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"--speculative-config: need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.method == "draft_model" and not self.model:
            raise ValueError("--speculative-config: method 'draft_model' needs model, the draft checkpoint's "
                             "directory")
        if self.method != "draft_model" and self.model is not None:
            raise ValueError(f"--speculative-config: model is the draft_model method's key; method "
                             f"{self.method!r} takes no model")
        if self.draft_tensor_parallel_size != 1:
            raise ValueError(f"--speculative-config: draft_tensor_parallel_size {self.draft_tensor_parallel_size}: "
                             f"the native decode engine runs the draft on the target's one device; use 1 (or drop "
                             f"the key)")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(f"--speculative-config: disable_by_batch_size must be >= 1, got "
                             f"{self.disable_by_batch_size}")


_INT_KEYS = ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size",
             "draft_tensor_parallel_size")
_METHOD_KEYS = {"ngram": ("prompt_lookup_min", "prompt_lookup_max"),
                "draft_model": ("model", "draft_tensor_parallel_size")}
"""Keys that belong to one method: given with the other, they are refused by name."""


def parse_speculative_config(text: str | None) -> SpeculativeConfig | None:
    """The config from the flag's JSON (None: speculation off); ValueError naming what is wrong.

    vLLM's defaulting: with only one of prompt_lookup_min/max given, the other takes its value."""
    if text is None or not text.strip():
        return None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--speculative-config must be a JSON object: {e}") from e
    if not isinstance(raw, dict):
        raise ValueError(f"--speculative-config must be a JSON object, got {text!r}")
    known = {"method", "model", *_INT_KEYS}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"--speculative-config: pdserve does not take {', '.join(unknown)} (it takes "
                         f"{', '.join(sorted(known))})")
    for key in _INT_KEYS:
        if key in raw and raw[key] is not None and (not isinstance(raw[key], int) or isinstance(raw[key], bool)):
            raise ValueError(f"--speculative-config: {key} must be an integer, got {raw[key]!r}")
    if "model" in raw and raw["model"] is not None and not isinstance(raw["model"], str):
        raise ValueError(f"--speculative-config: model must be a directory's path, got {raw['model']!r}")
    for method, keys in _METHOD_KEYS.items():
        stray = [key for key in keys if key in raw and raw.get("method") not in (None, method)]
        if stray and raw.get("method") in SPEC_METHODS:
            raise ValueError(f"--speculative-config: {', '.join(stray)}: a key of method {method!r}, which method "
                             f"{raw['method']!r} does not take")
    if raw.get("draft_tensor_parallel_size", 0) is None:  # vLLM's default: the target's
        del raw["draft_tensor_parallel_size"]
    if "prompt_lookup_min" in raw and "prompt_lookup_max" not in raw:
        raw["prompt_lookup_max"] = raw["prompt_lookup_min"]
    elif "prompt_lookup_max" in raw and "prompt_lookup_min" not in raw:
        raw["prompt_lookup_min"] = raw["prompt_lookup_max"]
    if "method" not in raw:
        raise ValueError("--speculative-config: method is required (ngram or draft_model)")
    return SpeculativeConfig(**raw)
