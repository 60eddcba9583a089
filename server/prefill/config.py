"""The prefill worker's settings, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal


@dataclass(frozen=True)
class PrefillConfig:
    model_dir: Path
    port: int = 0
    host: str = "127.0.0.1"
    max_batch_size: int = 8
    """Most prompts run in one batch (padded to a power of two)."""
    max_batch_tokens: int = 8192
    """Most padded tokens in one batch."""
    min_bucket: int = 16
    """Prompt lengths are padded to powers of two from this up, so XLA compiles few shapes."""
    weight_dtype: Literal["auto", "float32", "bfloat16", "int8", "fp8"] = "auto"
    """auto: the checkpoint's dtype; int8/fp8: weight-only, per-output-channel scales, quantized at load."""
    max_model_len: int = 0
    """Longest prompt this worker prefills; 0: the model's."""

    def __post_init__(self) -> None:
        if self.max_model_len < 0:
            raise ValueError(f"--max-model-len must be >= 0 (0: the model's), got {self.max_model_len}")
        if self.max_batch_size <= 0:
            raise ValueError(f"--max-batch-size must be >= 1, got {self.max_batch_size}")
        if self.weight_dtype not in ("auto", "float32", "bfloat16", "int8", "fp8"):
            raise ValueError(f"--weight-dtype must be auto, float32, bfloat16, int8 or fp8, not {self.weight_dtype!r}")
        if self.min_bucket <= 0 or self.min_bucket & (self.min_bucket - 1):
            raise ValueError(f"--min-bucket must be a power of two, got {self.min_bucket}")
