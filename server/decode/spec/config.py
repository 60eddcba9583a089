"""`--speculative-config`: vLLM's flag and JSON keys, parsed and validated once (no torch here: the CLI
parses it).

    --speculative-config '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                           "prompt_lookup_min": 2}'

Keys (vLLM's names): method (ngram; draft_model is refused until it is built), num_speculative_tokens (k,
the most tokens proposed per sequence per step), prompt_lookup_min / prompt_lookup_max (the n-gram lengths
matched, longest first), disable_by_batch_size (speculation off for a step whose batch has at least this
many sequences). Any other key is refused by name, so a vLLM config that means more than pdserve does is
never half-applied.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal, get_args

SpecMethod = Literal["ngram", "draft_model"]
SPEC_METHODS: tuple[str, ...] = get_args(SpecMethod)
BUILT_METHODS = ("ngram",)
"""Methods this decode engine runs; the others are refused at start, naming the one that runs."""


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
    """draft_model: the draft checkpoint (not built yet)."""

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"--speculative-config: method must be one of {', '.join(SPEC_METHODS)}, "
                             f"not {self.method!r}")
        if self.method not in BUILT_METHODS:
            raise ValueError(f"--speculative-config: method {self.method!r} is not built in pdserve's decode "
                             f"engine yet; use method 'ngram'")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"--speculative-config: num_speculative_tokens must be >= 1, got "
                             f"{self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"--speculative-config: need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(f"--speculative-config: disable_by_batch_size must be >= 1, got "
                             f"{self.disable_by_batch_size}")


_INT_KEYS = ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size")


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
    if "prompt_lookup_min" in raw and "prompt_lookup_max" not in raw:
        raw["prompt_lookup_max"] = raw["prompt_lookup_min"]
    elif "prompt_lookup_max" in raw and "prompt_lookup_min" not in raw:
        raw["prompt_lookup_min"] = raw["prompt_lookup_max"]
    if "method" not in raw:
        raise ValueError("--speculative-config: method is required (ngram)")
    return SpeculativeConfig(**raw)
