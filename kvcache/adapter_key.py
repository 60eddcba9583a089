"""AdapterKey: the LoRA adapter a block's KV was computed with, as vLLM names it in a block's hash and KV events.

vLLM 0.32 (`kv_cache_utils._gen_lora_extra_hash_keys`) hashes every block of an adapter's request with the extra
key `("lora", lora_name, lora_path)` (the path too: a name re-pointed at other weights reuses no KV), and its
BlockStored events carry `lora_id` (the adapter's int id), `lora_name` and, untagged, `extra_keys` `(lora_name,)`
per block (`to_event_extra_keys`). A base-model block has no extra keys (None), as in vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AdapterKey:
    id: int
    """vLLM's lora_int_id (the coordinator numbers adapters from 1 as they load)."""
    name: str
    path: str

    @property
    def extra_keys(self) -> tuple[tuple[str, str, str], ...]:
        """What enters each of its blocks' hashes (vLLM's `generate_block_hash_extra_keys` for a LoRA request)."""
        return (("lora", self.name, self.path),)

    @property
    def event_extra_keys(self) -> tuple[str, ...]:
        """One block's `extra_keys` entry in a BlockStored event (vLLM's untagged form)."""
        return (self.name,)


def extra_keys(adapter: AdapterKey | None) -> tuple | None:
    """A block's extra hash keys for requests of `adapter` (None: the base model's, none)."""
    return None if adapter is None else adapter.extra_keys
