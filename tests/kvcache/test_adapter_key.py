"""A LoRA adapter's blocks are named as vLLM 0.32 names them: ("lora", name, path) in every block's hash, and
BlockStored events carrying lora_id, lora_name and the untagged extra keys."""

from __future__ import annotations

import hashlib
import pickle

import msgspec

from pdserve.kvcache.adapter_key import AdapterKey
from pdserve.kvcache.block_hash import BlockHasher
from pdserve.kvcache.kv_events import KvEventRecorder, KVEventBatch

ADA = AdapterKey(1, "ada", "/adapters/ada")


def test_an_adapters_block_hash_is_vllms():
    hasher = BlockHasher("sha256")
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    got = hasher.hashes(tokens, 4, extra_keys=ADA.extra_keys)
    first = hashlib.sha256(pickle.dumps((hasher.none_hash, (1, 2, 3, 4), (("lora", "ada", "/adapters/ada"),)),
                                        protocol=pickle.HIGHEST_PROTOCOL)).digest()
    second = hashlib.sha256(pickle.dumps((first, (5, 6, 7, 8), (("lora", "ada", "/adapters/ada"),)),
                                         protocol=pickle.HIGHEST_PROTOCOL)).digest()
    assert got == [first, second]
    base = hasher.hashes(tokens, 4)
    moved = hasher.hashes(tokens, 4, extra_keys=AdapterKey(1, "ada", "/adapters/ada-v2").extra_keys)
    other = hasher.hashes(tokens, 4, extra_keys=AdapterKey(2, "bob", "/adapters/ada").extra_keys)
    assert len({tuple(got), tuple(base), tuple(moved), tuple(other)}) == 4  # name and path both count


def test_stored_events_carry_the_adapter_as_vllm_publishes_it():
    published = []
    recorder = KvEventRecorder("GPU", type("P", (), {"publish": lambda self, b: published.append(b)})(),
                               int_hashes=False)
    recorder.stored([b"h1", b"h2"], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, ADA)
    recorder.stored([b"h3"], None, [9, 9, 9, 9], 4)
    recorder.flush()
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(published[0]), type=KVEventBatch)
    ada, base = wire.events
    assert (ada.lora_id, ada.lora_name, ada.extra_keys) == (1, "ada", [("ada",), ("ada",)])
    assert (base.lora_id, base.lora_name, base.extra_keys) == (None, None, None)
