"""The LoRA flags, vLLM 0.32's spelling and meaning (`vllm/config/lora.py`, `--lora-modules` of its OpenAI server):
the coordinator takes --enable-lora, --lora-modules and --max-lora-rank (which adapters it serves, checked at load),
the prefill and decode workers `LoraConfig`'s (adapters per step, in host memory, their rank and dtype); `pdserve up`
passes each tier its own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from pdserve.server.model.lora import MAX_LORA_RANKS

LoraDtype = Literal["auto", "float16", "bfloat16"]
"""vLLM's `--lora-dtype` choices (auto: the model's compute dtype)."""


@dataclass(frozen=True)
class LoraModule:
    """One `--lora-modules` entry (vLLM's LoRAModulePath)."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_modules(specs: tuple[str, ...]) -> tuple[LoraModule, ...]:
    """`name=path` or the JSON form `{"name", "path", "base_model_name"}`, each as vLLM's LoRAParserAction reads
    it (an entry with "=" and no "," is name=path, any other JSON); ValueError naming the bad one."""
    modules = []
    for item in specs:
        if not item:
            continue
        if "=" in item and "," not in item:
            name, path = item.split("=", 1)
            modules.append(LoraModule(name, path))
            continue
        try:
            raw = json.loads(item)
            modules.append(LoraModule(**{k: raw[k] for k in raw if k != "is_3d_lora_weight"}))
        except json.JSONDecodeError:
            raise ValueError(f"Invalid JSON format for --lora-modules: {item}") from None
        except TypeError as e:
            raise ValueError(f"Invalid fields for --lora-modules: {item} - {e}") from None
        if not isinstance(modules[-1].name, str) or not isinstance(modules[-1].path, str) or not modules[-1].name:
            raise ValueError(f"--lora-modules: {item}: name and path must be non-empty strings")
    names = [m.name for m in modules]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"--lora-modules names an adapter twice: {', '.join(twice)}")
    return tuple(modules)


def check_max_lora_rank(rank: int) -> None:
    if rank not in MAX_LORA_RANKS:
        raise ValueError(f"--max-lora-rank must be one of {', '.join(map(str, MAX_LORA_RANKS))}, not {rank}")


@dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """vLLM's LoRA flags of a prefill or decode worker (a mixin of its config)."""

    enable_lora: bool = False
    """vLLM's flag: serve LoRA adapters (a request names one as its model; the coordinator says where it is)."""
    max_loras: int = 1
    """vLLM's flag: the most adapters in one prefill or decode step (device slots); more wait a step."""
    max_cpu_loras: int | None = None
    """vLLM's flag: adapters kept in host memory (>= --max-loras; default --max-loras); the least recently used
    beyond it is evicted, never refused."""
    max_lora_rank: int = 16
    """vLLM's flag: the largest adapter rank served, one of 1, 8, 16, 32, 64, 128, 256, 320, 512."""
    lora_dtype: LoraDtype = "auto"
    """vLLM's flag: the adapters' dtype on the workers (auto: the model's compute dtype)."""

    def check_lora(self) -> None:
        """Refuses what vLLM refuses (call from __post_init__)."""
        check_max_lora_rank(self.max_lora_rank)
        if self.max_loras < 1:
            raise ValueError(f"--max-loras must be >= 1, got {self.max_loras}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras}).")

    @property
    def cpu_loras(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras
