"""LoRA adapters on the prefill tier: loaded by the decode tier's PEFT reader, held in an LRU of host copies and an
LRU of device slots, written into the static-shaped stacks the jitted layer groups read (lora_rows.py).

Residency follows the decode tier's rule (`server/decode/lora.py`): `--max-loras` device slots, 1..max_loras (slot 0
is the base model's zeros), least recently used out first; `--max-cpu-loras` adapters packed in host memory (loaded
from their path on a miss, the load time logged), least recently used evicted, never refused. A prompt holds its
packed adapter for its life, so an eviction never strands it. A step packs the prompts of at most max_loras adapters
(the scheduler's `max_adapters`); the rest wait a step. Loading an adapter into a slot writes the stacks' contents
(one small jitted program per layer group size, compiled at start): no step program recompiles.

Packing (`PrefillAdapter.pack`): per projection p the adapter targets, A [L, in, R] (lora_A transposed) and B [L, R,
out] (lora_B transposed, times its scaling), its rank r padded to R = --max-lora-rank with zeros; a projection it
does not target (or a layer it skips) stays zeros.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from pdserve.kvcache.adapter_key import AdapterKey
from pdserve.server.model.config import ModelConfig
from pdserve.server.model.lora import LoraCheckpoint, projection_shapes
from pdserve.server.model.lora_host import HostAdapters
from pdserve.server.prefill.lora_rows import Stacks

log = logging.getLogger("pdserve.prefill")


@dataclass(frozen=True)
class PrefillAdapter:
    """One adapter packed on the host: projection -> (A [L, in, R], B [L, R, out] scaled), numpy."""

    key: AdapterKey
    weights: dict[str, tuple[np.ndarray, np.ndarray]]
    rank: int

    @classmethod
    def pack(cls, key: AdapterKey, ckpt: LoraCheckpoint, config: ModelConfig, max_rank: int,
             dtype: np.dtype) -> PrefillAdapter:
        shapes, L = projection_shapes(config), config.num_layers
        packed = {}
        for proj in ckpt.targets:
            fan_in, fan_out = shapes[proj]
            a, b = np.zeros((L, fan_in, max_rank), np.float32), np.zeros((L, max_rank, fan_out), np.float32)
            for (layer, p), (la, lb) in ckpt.weights.items():
                if p == proj:
                    r = la.shape[0]
                    a[layer, :, :r] = la.T
                    b[layer, :r] = lb.T * np.float32(ckpt.scaling)
            packed[proj] = (a.astype(dtype), b.astype(dtype))
        return cls(key, packed, ckpt.rank)

    def layers(self, start: int, size: int, config: ModelConfig, max_rank: int) -> Stacks:
        """Its matrices of layers [start, start + size) for every projection (zeros where it targets none): one
        pytree shape whatever it targets, so writing it into a slot is one program per layer group size."""
        out = {}
        for proj, (fan_in, fan_out) in projection_shapes(config).items():
            if proj in self.weights:
                a, b = self.weights[proj]
                out[proj] = (a[start : start + size], b[start : start + size])
            else:
                out[proj] = (np.zeros((size, fan_in, max_rank), self.dtype), np.zeros((size, max_rank, fan_out),
                                                                                       self.dtype))
        return out

    @property
    def dtype(self) -> np.dtype:
        return next(iter(self.weights.values()))[0].dtype


def _write_slot(stacks: Stacks, slot: jax.Array, adapter: Stacks) -> Stacks:
    """The stacks with slot `slot` holding `adapter`'s matrices [size, ...] of each projection."""
    out = {}
    for proj, (a, b) in stacks.items():  # a [size, N, in, R], b [size, N, R, out]
        new_a, new_b = adapter[proj]  # [size, in, R], [size, R, out]
        out[proj] = (a.at[:, slot].set(new_a.astype(a.dtype)), b.at[:, slot].set(new_b.astype(b.dtype)))
    return out


class PrefillLoras:
    """The prefill worker's adapters: packed on the host (an LRU of max_cpu_loras) and in device slots (an LRU of
    max_loras) of every layer group's stacks."""

    def __init__(self, config: ModelConfig, groups: list[tuple[int, int]], max_loras: int, max_cpu_loras: int,
                 max_rank: int, dtype):
        if max_cpu_loras < max_loras:
            raise ValueError(f"--max-cpu-loras ({max_cpu_loras}) must be >= --max-loras ({max_loras})")
        self.config, self.groups = config, groups
        self.max_loras, self.max_cpu_loras, self.max_rank = max_loras, max_cpu_loras, max_rank
        self.dtype = np.dtype(dtype)
        self.host: HostAdapters[PrefillAdapter] = HostAdapters(
            config, max_cpu_loras, max_rank, lambda key, ckpt: PrefillAdapter.pack(key, ckpt, config, max_rank,
                                                                                  self.dtype), log)
        self.resident: OrderedDict[AdapterKey, int] = OrderedDict()
        """Adapter -> its device slot (1..max_loras), least recently used first."""
        shapes, n = projection_shapes(config), max_loras + 1
        self.stacks: list[Stacks] = [
            {proj: (jnp.zeros((size, n, fan_in, max_rank), self.dtype), jnp.zeros((size, n, max_rank, fan_out),
                                                                                     self.dtype))
             for proj, (fan_in, fan_out) in shapes.items()}
            for _, size in groups]
        """Each layer group's slot stacks: projection -> (A [size, N, in, R], B [size, N, R, out])."""
        self._write = jax.jit(_write_slot)
        for stacks in {size: s for (_, size), s in zip(groups, self.stacks)}.values():  # compiled now, not mid-step
            zeros = {proj: (a[:, 0], b[:, 0]) for proj, (a, b) in stacks.items()}
            jax.block_until_ready(self._write(stacks, jnp.int32(0), zeros))

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for stacks in self.stacks for a, b in stacks.values())

    def adapter(self, key: AdapterKey) -> PrefillAdapter:
        """The adapter packed on the host (`HostAdapters.get`)."""
        return self.host.get(key)

    def slots(self, adapters: Sequence[PrefillAdapter | None]) -> list[int]:
        """Each segment's device slot (0: the base model), loading the adapters not resident into the least
        recently used slots. At most max_loras distinct adapters (the scheduler packs no more)."""
        wanted = list(dict.fromkeys(a.key for a in adapters if a is not None))
        if len(wanted) > self.max_loras:
            raise ValueError(f"a step of {len(wanted)} adapters; --max-loras is {self.max_loras}")
        by_key = {a.key: a for a in adapters if a is not None}
        for key in wanted:
            if key in self.resident:
                self.resident.move_to_end(key)
                continue
            slot = self._free_slot(set(wanted))
            adapter = by_key[key]
            for g, (start, size) in enumerate(self.groups):
                layers = adapter.layers(start, size, self.config, self.max_rank)
                self.stacks[g] = self._write(self.stacks[g], jnp.int32(slot), layers)
            self.resident[key] = slot
        return [0 if a is None else self.resident[a.key] for a in adapters]

    def _free_slot(self, keep: set[AdapterKey]) -> int:
        used = set(self.resident.values())
        for slot in range(1, self.max_loras + 1):
            if slot not in used:
                return slot
        victim = next(k for k in self.resident if k not in keep)
        slot = self.resident.pop(victim)
        log.info("LoRA adapter %r left device slot %d (--max-loras %d)", victim.name, slot, self.max_loras)
        return slot
