"""KvSubscriber against pdserve's real publisher (kvcache/kv_event_publisher.py) over tcp: a reader started after
the worker published snapshots it through the replay endpoint, then follows it live; a worker whose hashes differ
is refused; a worker that leaves is dropped."""

from __future__ import annotations

import time

from pdserve.kvcache.block_hash import BlockHasher
from pdserve.kvcache.kv_event_publisher import ZmqEventPublisher
from pdserve.kvcache.kv_events import BlockRemoved, BlockStored, KVEventBatch
from pdserve.kvcache.kv_events_config import KvEventsConfig
from pdserve.server.coordinator.kv_index import KvIndex
from pdserve.server.coordinator.kv_subscriber import KvSubscriber, Source
from pdserve.server.kv_events_source import kv_events_source, reachable

HASHER = BlockHasher("sha256")
TOKENS = list(range(100, 164))
HASHES = HASHER.hashes(TOKENS, 16)


def _stored(first: int, last: int) -> KVEventBatch:
    return KVEventBatch(ts=time.time(), events=[BlockStored(
        block_hashes=[int.from_bytes(h, "big") & ((1 << 64) - 1) for h in HASHES[first:last]],
        parent_block_hash=None, token_ids=TOKENS[16 * first : 16 * last], block_size=16, lora_id=None, medium="GPU",
        lora_name=None)])


def _until(check, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_reachable_names_the_workers_host_for_a_wildcard():
    assert reachable("tcp://0.0.0.0:5557", "10.1.2.3:50061") == "tcp://10.1.2.3:5557"
    assert reachable("tcp://[::]:5557", "10.1.2.3:50061") == "tcp://10.1.2.3:5557"
    assert reachable("tcp://10.9.9.9:5557", "10.1.2.3:50061") == "tcp://10.9.9.9:5557"
    assert reachable("ipc:///tmp/kv", "10.1.2.3:50061") == "ipc:///tmp/kv"
    assert reachable(None, "10.1.2.3:50061") == ""


def test_a_late_reader_snapshots_then_follows_the_worker_live():
    config = KvEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:0", replay_endpoint="tcp://*:0",
                            topic="kv@{worker}@tiny")
    publisher = ZmqEventPublisher(config, topic=config.topic_for("127.0.0.1:7001"))
    index = KvIndex()
    subscriber = KvSubscriber(index, HASHER)
    try:
        publisher.publish(_stored(0, 2))  # before any coordinator reads: only the replay endpoint has it
        publisher.publish(_stored(2, 3))
        source = kv_events_source(publisher, config.endpoint, "127.0.0.1:7001", HASHER, 16)
        assert source.topic == "kv@127.0.0.1:7001@tiny" and source.endpoint.startswith("tcp://127.0.0.1:")
        _until(lambda: len(publisher._buffer) == 2)
        subscriber.start()
        subscriber.set_sources({"127.0.0.1:7001": Source.of("decode", source)})
        _until(lambda: index.state("127.0.0.1:7001") == "live")
        assert index.longest_prefix("127.0.0.1:7001", HASHES) == (3, [("GPU",)] * 3)
        assert index.views["127.0.0.1:7001"].next_seq == 2
        publisher.publish(KVEventBatch(ts=time.time(), events=[BlockRemoved(
            block_hashes=[int.from_bytes(HASHES[1], "big") & ((1 << 64) - 1)], medium="GPU")]))
        _until(lambda: index.longest_prefix("127.0.0.1:7001", HASHES)[0] == 1)
        assert index.views["127.0.0.1:7001"].next_seq == 3 and index.state("127.0.0.1:7001") == "live"
        other = BlockHasher("sha256_cbor")  # another algorithm: its hashes would never match a prompt's
        wrong = kv_events_source(publisher, config.endpoint, "127.0.0.1:7002", other, 16)
        subscriber.set_sources({"127.0.0.1:7001": Source.of("decode", source),
                                "127.0.0.1:7002": Source.of("decode", wrong)})
        time.sleep(0.3)
        assert "127.0.0.1:7002" not in index.views
        subscriber.set_sources({})  # the worker left the pool
        _until(lambda: index.views == {})
    finally:
        subscriber.close()
        publisher.close()
