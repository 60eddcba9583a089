"""`pdserve up --kv-events-config`: both tiers connect to one subscriber (llm-d's indexer shape), each worker on
its own topic; the prompt's full blocks appear as BlockStored with vLLM's hash from the decode worker (GPU) and
the prefill worker's host prefix KV (CPU); a repeated prompt publishes nothing before the next new prompt's."""

from __future__ import annotations

import json

from tests.e2e.cluster import pdserve_up
from tests.e2e.procs import generate, request
from tests.kvcache.kv_events_helpers import Subscriber, chain, wire


def _stored(events: list[dict]) -> list[int]:
    return [h for e in events if e["type"] == "BlockStored" for h in e["block_hashes"]]


def test_pdserve_up_publishes_each_workers_blocks(tiny_model, tmp_path):
    sub = Subscriber()
    config = {"enable_kv_cache_events": True, "endpoint": sub.endpoint, "topic": "kv@{worker}@tiny"}
    try:
        with pdserve_up(tiny_model("llama"), tmp_path, prefill_workers=1, decode_workers=1,
                        extra_args=["--kv-events-config", json.dumps(config)]) as state:
            topics = {f"kv@{state['decode'][0]}@tiny".encode(): "GPU", f"kv@{state['prefill'][0]}@tiny".encode(): "CPU"}
            seqs: dict[bytes, list[int]] = {t: [] for t in topics}

            def until(hashes: list[int]) -> dict[bytes, list[dict]]:
                """Every worker's events until each has stored `hashes` (in order, from the chain's start)."""
                got: dict[bytes, list[dict]] = {t: [] for t in topics}
                while any(_stored(got[t])[: len(hashes)] != hashes for t in topics):
                    topic, seq, (_, events, rank) = sub.recv(timeout=60)
                    assert topic in topics and rank == 0
                    seqs[topic].append(seq)
                    assert all(e.get("medium", topics[topic]) == topics[topic] for e in events)
                    got[topic] += events
                return got

            prompt = [(7 * i) % 300 + 3 for i in range(40)]  # 2 full blocks of 16
            hashes = [wire(h) for h in chain(prompt, 16)[:2]]
            assert generate(state["coordinator"], request(prompt, 4))
            first = until(hashes)
            for topic, medium in topics.items():
                assert first[topic][0] == {
                    "type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None, "token_ids": prompt[:32],
                    "block_size": 16, "lora_id": None, "medium": medium, "lora_name": None, "group_idx": 0}
            assert generate(state["coordinator"], request(prompt, 4))  # a prefix hit on both tiers: nothing new
            other = [(11 * i) % 300 + 5 for i in range(40)]
            assert generate(state["coordinator"], request(other, 4))
            after = until([wire(h) for h in chain(other, 16)[:2]])
            for topic in topics:  # the next events each worker published are the new prompt's
                assert _stored(after[topic]) == [wire(h) for h in chain(other, 16)[:2]]
                assert seqs[topic] == list(range(len(seqs[topic])))  # per publisher, from 0, none missed
    finally:
        sub.close()
