"""The LoRA adapters the coordinator serves, by name: vLLM's OpenAIServingModels' `lora_requests`.

Adapters come from `--lora-modules` at start, and (with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True) from
`POST /v1/load_lora_adapter` / `/v1/unload_lora_adapter`. Each is checked here at load, against the base model's
config, with the decode tier's own reader (`server/model/lora.py`): a missing one is LoraNotFound (vLLM's 404), a
bad one (shape, rank, another base) LoraLoadError, and the server serves on. Each gets vLLM's int id (counted from
1 as loaded; reloading a name keeps it); requests carry (name, id, path) to their decode worker, which loads the
weights from the path on a miss.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from pdserve.v1 import worker_pb2
from pdserve.server.lora_config import LoraModule
from pdserve.server.model.config import ModelConfig
from pdserve.server.model.lora import load_lora

log = logging.getLogger("pdserve.coordinator")


@dataclass(frozen=True)
class Adapter:
    name: str
    id: int
    path: str
    base_model_name: str | None = None
    """The `parent` /v1/models names (None: the served model's name)."""

    def proto(self) -> worker_pb2.LoraAdapter:
        return worker_pb2.LoraAdapter(name=self.name, id=self.id, path=self.path)


class AdapterExists(ValueError):
    """A name already loaded (vLLM's 400)."""


class Adapters:
    def __init__(self, config: ModelConfig, max_rank: int, enabled: bool = True):
        self.config = config
        self.max_rank = max_rank
        self.enabled = enabled
        self._by_name: dict[str, Adapter] = {}
        self._next_id = 1
        self._lock = asyncio.Lock()

    def get(self, name: str) -> Adapter | None:
        return self._by_name.get(name) if self.enabled else None

    def __iter__(self):
        return iter(list(self._by_name.values()))

    def add(self, module: LoraModule, inplace: bool = False) -> Adapter:
        """Checks and adds one adapter (start-up: `--lora-modules`); raises LoraNotFound, LoraLoadError or
        AdapterExists (unless `inplace`: vLLM's load_inplace, the name re-pointed, its id kept)."""
        known = self._by_name.get(module.name)
        if known is not None and not inplace:
            raise AdapterExists(f"The lora adapter '{module.name}' has already been loaded. If you want to load "
                                f"the adapter in place, set 'load_inplace' to True.")
        began = time.perf_counter()
        ckpt = load_lora(module.name, module.path, self.config, self.max_rank)
        adapter = Adapter(module.name, known.id if known else self._next_id, module.path, module.base_model_name)
        self._next_id += known is None
        self._by_name[module.name] = adapter
        log.info("Loaded new LoRA adapter: name '%s', path '%s' (id %d, rank %d, %s; checked in %.1f ms)",
                 adapter.name, adapter.path, adapter.id, ckpt.rank, "/".join(ckpt.targets),
                 (time.perf_counter() - began) * 1e3)
        return adapter

    async def load(self, module: LoraModule, inplace: bool = False) -> Adapter:
        """`add` off the event loop (reading the checkpoint), one load or unload at a time."""
        async with self._lock:
            if module.name in self._by_name and not inplace:  # refused before the read, as vLLM does
                return self.add(module)
            return await asyncio.to_thread(self.add, module, inplace)

    async def unload(self, name: str) -> Adapter:
        """Removes it (KeyError if unknown); requests already running with it finish."""
        async with self._lock:
            adapter = self._by_name.pop(name)
        log.info("Removed LoRA adapter: name '%s'", name)
        return adapter
