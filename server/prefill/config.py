"""The prefill worker's settings, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pdserve.server.prefill.scheduler import PREFILL_ORDERS, PrefillOrder


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
    kv_layer_groups: int = 4
    """The prefill runs as this many layer groups; each group's KV leaves while the next computes."""
    kv_streams: int = 1
    """Parallel PushKv streams (each its own connection) per transfer."""
    max_pushes: int = 64
    """KV pushes in flight at once; at the bound the worker takes no new prompt until one ends."""
    max_push_bytes: int = 8 * 2**30
    """Host bytes of KV held by pushes in flight (same rule); a prompt whose KV alone exceeds it is refused."""
    prefill_order: PrefillOrder = "shortest-first"
    """Which queued prompt runs next (`--prefill-order`, scheduler.py): shortest-first keeps short prompts'
    TTFT from waiting behind long ones (benchmarks/prefill_overload.py); fifo: by arrival."""
    prefill_ageing: float = 32.0
    """shortest-first: a prompt of n tokens waits at most n / this seconds for prompts that arrive later
    (1536 tokens: 48 s). Faster ageing turns the order back into fifo once the backlog is longer than
    that: at 256 tokens/s (6 s), short prompts still waited a minute behind old long ones (prefill_overload)."""

    max_model_len: int = 0
    """Longest prompt this worker prefills; 0: the model's."""

    def __post_init__(self) -> None:
        if self.max_model_len < 0:
            raise ValueError(f"--max-model-len must be >= 0 (0: the model's), got {self.max_model_len}")
        if self.max_batch_size <= 0:
            raise ValueError(f"--max-batch-size must be >= 1, got {self.max_batch_size}")
        if self.weight_dtype not in ("auto", "float32", "bfloat16", "int8", "fp8"):
            raise ValueError(f"--weight-dtype must be auto, float32, bfloat16, int8 or fp8, not {self.weight_dtype!r}")
        if self.prefill_order not in PREFILL_ORDERS:
            raise ValueError(f"--prefill-order must be one of {', '.join(PREFILL_ORDERS)}, not {self.prefill_order!r}")
        if not self.prefill_ageing > 0:
            raise ValueError(f"--prefill-ageing must be > 0 tokens/s, got {self.prefill_ageing}")
        if self.min_bucket <= 0 or self.min_bucket & (self.min_bucket - 1):
            raise ValueError(f"--min-bucket must be a power of two, got {self.min_bucket}")
        for flag, value in (("--kv-layer-groups", self.kv_layer_groups), ("--kv-streams", self.kv_streams),
                            ("--max-pushes", self.max_pushes), ("--max-push-bytes", self.max_push_bytes)):
            if value <= 0:
                raise ValueError(f"{flag} must be >= 1, got {value}")
