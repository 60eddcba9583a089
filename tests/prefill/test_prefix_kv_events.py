"""The prefill worker's host prefix KV publishes what it stores and evicts (medium "CPU"), one batch per stored
prompt, its blocks named by vLLM's hash; a lookup publishes nothing."""

from __future__ import annotations

import numpy as np

from pdserve.kvcache.kv_event_publisher import ZmqEventPublisher
from pdserve.kvcache.kv_events import MEDIUM_CPU, KvEventRecorder
from pdserve.kvcache.kv_events_config import KvEventsConfig
from pdserve.server.prefill.prefix_kv import PrefixKv

from tests.kvcache.kv_events_helpers import Subscriber, chain, wire


def test_prefix_kv_publishes_stores_and_evictions():
    sub = Subscriber()
    publisher = ZmqEventPublisher(KvEventsConfig(enable_kv_cache_events=True, endpoint=sub.endpoint), topic="p")
    shape = (2, 4, 1, 2)  # layers, block_size, kv heads, head dim
    block_bytes = 2 * int(np.prod(shape)) * 4
    prefix = PrefixKv(num_layers=2, num_kv_heads=1, head_dim=2, dtype=np.float32, budget_bytes=3 * block_bytes,
                      block_size=4, kv_events=KvEventRecorder(MEDIUM_CPU, publisher))
    try:
        sub.sync(publisher)
        a = list(range(1, 12))  # 2 full blocks
        k = np.arange(2 * 11 * 2, dtype=np.float32).reshape(2, 11, 1, 2)
        prefix.store(a, k, k + 1)
        (_, _, (_, events, _)), = sub.probe(publisher)
        ha = chain(a, 4)
        assert events == [{"type": "BlockStored", "block_hashes": [wire(h) for h in ha], "parent_block_hash": None,
                           "token_ids": a[:8], "block_size": 4, "lora_id": None, "medium": "CPU", "lora_name": None,
                           "group_idx": 0}]
        hit = prefix.lookup(a + [99])
        assert hit is not None and hit[0].shape[1] == 8
        prefix.store(a, k, k + 1)  # again: nothing new
        assert sub.probe(publisher) == []
        b = list(range(50, 59))  # 2 more blocks: 1 free, the least recently used of a's evicted
        prefix.store(b, k[:, :9], k[:, :9])
        (_, _, (_, events, _)), = sub.probe(publisher)
        hb = chain(b, 4)
        assert events == [
            {"type": "BlockRemoved", "block_hashes": [wire(ha[0])], "medium": "CPU", "group_idx": 0},
            {"type": "BlockStored", "block_hashes": [wire(h) for h in hb], "parent_block_hash": None,
             "token_ids": b[:8], "block_size": 4, "lora_id": None, "medium": "CPU", "lora_name": None,
             "group_idx": 0}]
    finally:
        publisher.close()
        sub.close()


def test_an_adapters_blocks_hash_its_key_and_their_events_name_it():
    """A LoRA adapter's prompt: its blocks hash vLLM's extra key ("lora", name, path), so the same tokens under
    the base model or another adapter find nothing, and its BlockStored event carries lora_id, lora_name."""
    from pdserve.kvcache.adapter_key import AdapterKey
    from pdserve.kvcache.block_hash import DEFAULT_HASHER
    from pdserve.kvcache.kv_events import BlockStored

    published = []
    recorder = KvEventRecorder(MEDIUM_CPU, type("Sink", (), {"publish": lambda self, b: published.append(b)})())
    prefix = PrefixKv(num_layers=2, num_kv_heads=1, head_dim=2, dtype=np.float32, budget_bytes=1 << 16, block_size=4,
                      kv_events=recorder)
    ada, bob = AdapterKey(1, "ada", "/a"), AdapterKey(2, "bob", "/b")
    tokens = list(range(1, 12))  # 2 full blocks
    k = np.arange(2 * 11 * 2, dtype=np.float32).reshape(2, 11, 1, 2)
    prefix.store(tokens, k, k + 1, ada)
    assert prefix.lookup(tokens + [99]) is None and prefix.lookup(tokens + [99], adapter=bob) is None
    hit = prefix.lookup(tokens + [99], adapter=ada)
    assert hit is not None and np.array_equal(hit[0], k[:, :8])
    (stored,) = [e for batch in published for e in batch.events if isinstance(e, BlockStored)]
    assert (stored.lora_id, stored.lora_name, stored.extra_keys) == (1, "ada", [("ada",), ("ada",)])
    first = DEFAULT_HASHER.block(None, tokens[:4], (("lora", "ada", "/a"),))
    assert stored.block_hashes[0] == wire(first) and first != DEFAULT_HASHER.block(None, tokens[:4])
