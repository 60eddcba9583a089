"""The decode worker's settings, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal


@dataclass(frozen=True)
class DecodeConfig:
    model_dir: Path
    port: int = 0
    host: str = "127.0.0.1"
    block_size: int = 16
    kv_cache_tokens: int = 16384
    """Capacity of the paged KV cache in tokens (rounded up to whole blocks)."""
    max_running: int = 64
    """Most requests holding blocks at once (running or receiving their KV); more wait in the queue."""
    max_queue: int = 256
    """Most new requests waiting for blocks; one more is refused with RESOURCE_EXHAUSTED."""
    max_model_len: int = 0
    """Longest prompt + output; 0: the model's, capped by what the KV cache holds."""
    enable_prefix_caching: bool = True
    """Keep finished sequences' full blocks, reuse them for requests sharing the prefix (vLLM's name)."""
    weight_dtype: Literal["auto", "float32", "bfloat16", "int8", "fp8"] = "auto"
    """auto: the dtype the checkpoint is stored in; int8/fp8: weight-only, per-output-channel scales,
    computing in the checkpoint's dtype."""
    kv_dtype: Literal["auto", "float32", "bfloat16", "float16", "fp8_e4m3", "int8"] = "auto"
    """auto: the model's compute dtype; fp8_e4m3/int8 keep a float32 scale per block per kv head."""
    threads: int = 0
    """torch intra-op threads; 0 leaves torch's default."""
    engine: Literal["native", "vllm"] = "native"
    """native: pdserve's torch engine; vllm: vLLM's engine fed through pdserve's KV connector."""

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"--block-size must be a power of two, got {self.block_size}")
        if self.kv_cache_tokens < self.block_size:
            raise ValueError(f"--kv-cache-tokens must hold at least one block ({self.block_size} tokens)")
        if self.weight_dtype not in ("auto", "float32", "bfloat16", "int8", "fp8"):
            raise ValueError(f"--weight-dtype must be auto, float32, bfloat16, int8 or fp8, not {self.weight_dtype!r}")
        if self.kv_dtype not in ("auto", "float32", "bfloat16", "float16", "fp8_e4m3", "int8"):
            raise ValueError(
                f"--kv-dtype must be auto, float32, bfloat16, float16, fp8_e4m3 or int8, not {self.kv_dtype!r}"
            )
        if self.engine not in ("native", "vllm"):
            raise ValueError(f"--engine must be native or vllm, not {self.engine!r}")
        if self.max_running <= 0:
            raise ValueError(f"--max-running must be >= 1, got {self.max_running}")
        if self.max_queue < 0:
            raise ValueError(f"--max-queue must be >= 0, got {self.max_queue}")
        if self.max_model_len < 0:
            raise ValueError(f"--max-model-len must be >= 0 (0: the model's), got {self.max_model_len}")

    @property
    def num_blocks(self) -> int:
        return -(-self.kv_cache_tokens // self.block_size)
