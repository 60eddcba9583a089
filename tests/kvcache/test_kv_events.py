"""KV events in vLLM's wire format: the block hash, the config, the publisher's frames and replay, and what the
prefix cache emits, all checked by hand on a SUB socket (tests/decode/test_kv_events_engine.py: the engine)."""

from __future__ import annotations

import hashlib
import time

import cbor2
import msgspec
import pytest
import zmq

from pdserve.kvcache.block_hash import BlockHasher
from pdserve.kvcache.block_pool import BlockPool
from pdserve.kvcache.kv_event_publisher import END_SEQ, ZmqEventPublisher
from pdserve.kvcache.kv_events import MEDIUM_CPU, KvEventRecorder
from pdserve.kvcache.kv_events_config import KvEventsConfig, is_bind_endpoint, parse_kv_events_config
from pdserve.kvcache.prefix_cache import PrefixCache

from tests.kvcache.kv_events_helpers import Subscriber, chain, vllm_hash, wire


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_block_hashes_are_vllms(algo, monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    tokens = list(range(100, 137))
    got = BlockHasher(algo).hashes(tokens, 16)
    assert got == chain(tokens, 16, algo) and len(got) == 2
    if algo == "sha256_cbor":  # spelled out once more: sha256(cbor2 canonical (NONE_HASH, tokens, None))
        none = hashlib.sha256(cbor2.dumps("vllm-none-hash", canonical=True)).digest()
        first = hashlib.sha256(cbor2.dumps((none, tuple(tokens[:16]), None), canonical=True)).digest()
        assert got[0] == first
    monkeypatch.setenv("PYTHONHASHSEED", "42")
    seeded = BlockHasher(algo).hashes(tokens, 16)
    assert seeded == chain(tokens, 16, algo) and seeded[0] != got[0]  # NONE_HASH follows PYTHONHASHSEED


def test_unknown_algorithm_and_config_errors_name_the_fix():
    with pytest.raises(ValueError, match="--prefix-caching-hash-algo must be one of"):
        BlockHasher("md5")
    with pytest.raises(ValueError, match="unknown key.*bogus"):
        parse_kv_events_config('{"enable_kv_cache_events": true, "bogus": 1}')
    with pytest.raises(ValueError, match="publisher must be"):
        parse_kv_events_config('{"publisher": "kafka"}')
    with pytest.raises(ValueError, match="must be a JSON object"):
        parse_kv_events_config("{nope")
    config = parse_kv_events_config('{"enable_kv_cache_events": true, "topic": "kv@{worker}@m"}')
    assert (config.publisher, config.endpoint, config.buffer_steps, config.hwm, config.enabled) == \
        ("zmq", "tcp://*:5557", 10_000, 100_000, True)
    assert parse_kv_events_config('{"enable_kv_cache_events": false}').publisher == "null"
    assert not parse_kv_events_config('{"enable_kv_cache_events": true, "publisher": "null"}').enabled
    assert config.topic_for("10.0.0.7:9000") == "kv@10.0.0.7:9000@m"
    third = KvEventsConfig(True, endpoint="tcp://*:5557", replay_endpoint="tcp://*:5600").for_worker(2)
    assert (third.endpoint, third.replay_endpoint) == ("tcp://*:5559", "tcp://*:5602")
    assert KvEventsConfig(True, endpoint="tcp://*:0").for_worker(3).endpoint == "tcp://*:0"
    assert KvEventsConfig(True, endpoint="ipc:///tmp/kv").for_worker(1).endpoint == "ipc:///tmp/kv_dp1"
    # every worker connects to the one subscriber's socket; their replay sockets (bound) get a port each
    shared = KvEventsConfig(True, endpoint="tcp://indexer:5557", replay_endpoint="tcp://*:5600").for_worker(1)
    assert (shared.endpoint, shared.replay_endpoint) == ("tcp://indexer:5557", "tcp://*:5601")


def test_bind_or_connect_as_vllm():
    assert is_bind_endpoint("tcp://*:5557") and is_bind_endpoint("tcp://[::]:5557")
    assert is_bind_endpoint("ipc:///tmp/x") and is_bind_endpoint("inproc://x")
    assert not is_bind_endpoint("tcp://127.0.0.1:5557") and not is_bind_endpoint("tcp://router:5557")


def _publisher(sub: Subscriber, **kw) -> ZmqEventPublisher:
    config = KvEventsConfig(enable_kv_cache_events=True, endpoint=sub.endpoint, **kw)
    return ZmqEventPublisher(config, topic=config.topic_for("w0:1"))


def test_frames_and_events_of_a_prefix_cache_by_hand():
    sub = Subscriber()
    publisher = _publisher(sub, topic="kv@{worker}@tiny")
    try:
        last = sub.sync(publisher)
        recorder = KvEventRecorder(MEDIUM_CPU, publisher)
        cache = PrefixCache(BlockPool(3), hasher=BlockHasher(), events=recorder)
        tokens = list(range(1, 14))  # 3 full blocks of 4, one partial
        hashes = cache.hasher.hashes(tokens, 4)
        assert hashes == chain(tokens, 4)
        table = cache.allocate(3)
        cache.register(table, hashes, tokens[:12])
        cache.free(table)
        recorder.flush()
        topic, seq, (ts, events, rank) = sub.recv()
        assert (topic, seq, rank) == (b"kv@w0:1@tiny", last + 1, 0) and abs(ts - time.time()) < 60
        assert events == [{"type": "BlockStored", "block_hashes": [wire(h) for h in hashes], "parent_block_hash": None,
                           "token_ids": tokens[:12], "block_size": 4, "lora_id": None, "medium": "CPU",
                           "lora_name": None, "group_idx": 0}]
        # a hit stores nothing: the same prompt again publishes no batch at all
        hits = cache.lookup(hashes)
        cache.register(hits, hashes, tokens[:12])
        cache.free(hits)
        recorder.flush()
        assert sub.probe(publisher) == []
        # a longer prompt sharing two blocks: only its new block, its parent the shared second block's hash
        other = tokens[:8] + [90, 91, 92, 93]
        other_hashes = cache.hasher.hashes(other, 4)
        hits = cache.lookup(other_hashes)
        assert len(hits) == 2
        fresh = cache.allocate(1)  # evicts the least recently used evictable block: the third
        cache.register(hits + fresh, other_hashes, other)
        cache.free(hits + fresh)
        recorder.flush()
        (_, seq2, (_, events, _)), = sub.probe(publisher)
        assert seq2 == last + 3  # the probe after the hit took last + 2
        assert events == [
            {"type": "BlockRemoved", "block_hashes": [wire(hashes[2])], "medium": "CPU", "group_idx": 0},
            {"type": "BlockStored", "block_hashes": [wire(other_hashes[2])], "parent_block_hash": wire(hashes[1]),
             "token_ids": [90, 91, 92, 93], "block_size": 4, "lora_id": None, "medium": "CPU", "lora_name": None,
             "group_idx": 0}]
        assert other_hashes[2] == vllm_hash(hashes[1], [90, 91, 92, 93])
        cache.clear()  # every cached block evictable: one AllBlocksCleared, no BlockRemoved
        recorder.flush()
        (_, _, (_, events, _)), = sub.probe(publisher)
        assert events == [{"type": "AllBlocksCleared"}] and cache.num_cached == 0
    finally:
        publisher.close()
        sub.close()


def test_bytes_hashes_when_int_hashes_are_off(monkeypatch):
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    recorder = KvEventRecorder("GPU")
    h = BlockHasher().hashes([1, 2], 2)
    recorder.stored(h, None, [1, 2], 2)
    recorder.removed(h[0])
    events = msgspec.msgpack.decode(msgspec.msgpack.encode(recorder.pending))
    assert events[0]["block_hashes"] == h and events[1]["block_hashes"] == h and isinstance(h[0], bytes)


def test_replay_returns_the_buffered_batches_from_a_start_seq(tmp_path):
    sub = Subscriber()
    publisher = _publisher(sub, replay_endpoint="tcp://127.0.0.1:0", buffer_steps=3, topic="t")
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    try:
        recorder = KvEventRecorder("GPU", publisher)
        last = sub.sync(publisher)
        live = []
        for i in range(4):
            recorder.stored([bytes([i]) * 32], None, [i], 1)
            recorder.flush()
            live.append(sub.recv())
        assert [m[1] for m in live] == list(range(last + 1, last + 5))
        dealer.connect(publisher.replay_endpoint)
        dealer.send_multipart([b"", (last + 3).to_bytes(8, "big")])
        replies = []
        while True:
            assert dealer.poll(10_000), "no replay reply"
            frames = dealer.recv_multipart()
            if frames[2] == END_SEQ:
                assert frames == [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
                break
            empty, topic, seq, payload = frames
            assert (empty, topic) == (b"", b"t")
            replies.append((int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload)))
        assert replies == [(m[1], m[2]) for m in live[2:]]  # from the start seq, the buffer's last 3 hold them
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])  # from 0: only the last buffer_steps batches remain
        seqs = []
        while (frames := (dealer.poll(10_000) and dealer.recv_multipart()))[2] != END_SEQ:
            seqs.append(int.from_bytes(frames[2], "big"))
        assert seqs == [last + 2, last + 3, last + 4]
    finally:
        dealer.close(linger=0)
        publisher.close()
        sub.close()


def test_a_full_queue_drops_batches_instead_of_blocking_the_step():
    sub = Subscriber()
    publisher = _publisher(sub, max_queue_size=1)
    try:
        publisher.close()  # the thread gone, nothing drains the queue
        recorder = KvEventRecorder("GPU", publisher)
        t0 = time.monotonic()
        for i in range(5):
            recorder.stored([bytes([i]) * 32], None, [i], 1)
            recorder.flush()
        assert time.monotonic() - t0 < 1.0 and publisher.dropped >= 4
    finally:
        sub.close()
