"""The decode engine's KV events: every full block its prefix cache stores is a BlockStored with vLLM's hash, a
repeated prompt publishes nothing, evictions are BlockRemoved of stored blocks; one batch per step."""

from __future__ import annotations

import asyncio

from pdserve.kvcache.block_hash import BlockHasher
from pdserve.kvcache.kv_event_publisher import ZmqEventPublisher
from pdserve.kvcache.kv_events import MEDIUM_GPU, KvEventRecorder
from pdserve.kvcache.kv_events_config import KvEventsConfig

from tests.decode.test_engine import _admit, _all_back, _drain, _engine
from tests.kvcache.kv_events_helpers import Subscriber, chain, wire


async def _idle(engine, recorder: KvEventRecorder) -> None:
    """Every request retired and the step after it flushed its events."""
    for _ in range(2000):
        if not engine.sequences and not engine._deferred and not engine._busy and not recorder.pending:
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the engine never went idle")


async def _serve(engine, recorder, rid: str, prompt: list[int], max_tokens: int) -> list[int]:
    seq = await _admit(engine, rid, prompt, max_tokens)
    await _drain(seq)
    await _idle(engine, recorder)
    return seq.token_ids


def _events(messages: list) -> list[dict]:
    return [e for _, _, (_, events, _) in messages for e in events]


async def test_engine_publishes_stored_blocks_hits_nothing_and_evictions(tiny_model):
    sub = Subscriber()
    publisher = ZmqEventPublisher(KvEventsConfig(enable_kv_cache_events=True, endpoint=sub.endpoint), topic="kv@d0")
    recorder = KvEventRecorder(MEDIUM_GPU, publisher)
    engine = _engine(tiny_model("llama"), num_blocks=8, block_size=4, hasher=BlockHasher("sha256_cbor"),
                     kv_events=recorder)
    try:
        last = sub.sync(publisher)
        prompt = list(range(3, 13))  # 10 tokens: 2 full blocks
        tokens = await _serve(engine, recorder, "a", prompt, 3)
        got = sub.probe(publisher)
        assert [m[1] for m in got] == list(range(last + 1, last + 1 + len(got))) and all(m[0] == b"kv@d0" for m in got)
        events = _events(got)
        hashes = [wire(h) for h in chain(tokens, 4, "sha256_cbor")]
        assert events[0] == {"type": "BlockStored", "block_hashes": hashes[:2], "parent_block_hash": None,
                             "token_ids": prompt[:8], "block_size": 4, "lora_id": None, "medium": "GPU",
                             "lora_name": None, "group_idx": 0}  # the prompt's full blocks, when its KV arrived
        stored = [h for e in events for h in e["block_hashes"]]
        assert all(e["type"] == "BlockStored" for e in events) and stored == hashes[: len(stored)]
        assert len(stored) == 3  # and the answer's full block (12 of its 13 tokens have KV) at retire
        assert events[-1]["parent_block_hash"] == hashes[1] and events[-1]["token_ids"] == tokens[8:12]

        await _serve(engine, recorder, "b", prompt, 3)  # the same prompt: a prefix hit, the same answer
        assert sub.probe(publisher) == []

        other = list(range(50, 78))  # 28 tokens: 7 blocks of the 8, then an 8th: a's 3 cached blocks evicted
        others = await _serve(engine, recorder, "c", other, 2)
        events = _events(sub.probe(publisher))
        removed = [h for e in events if e["type"] == "BlockRemoved" for h in e["block_hashes"]]
        assert all(e["medium"] == "GPU" for e in events)
        assert sorted(removed) == sorted(stored) and all(len(e["block_hashes"]) == 1 for e in events
                                                          if e["type"] == "BlockRemoved")
        new = [h for e in events if e["type"] == "BlockStored" for h in e["block_hashes"]]
        assert new == [wire(h) for h in chain(others, 4, "sha256_cbor")][: len(new)] and len(new) == 7
        assert _all_back(engine)
    finally:
        await engine.close()
        publisher.close()
        sub.close()
