"""A worker's `KvEventsSource`: where the coordinator's index (coordinator/kv_index.py) reads its KV events.

A worker whose publisher binds (the default `tcp://*:5557`, offset per worker by `pdserve up`) advertises that
socket with its wildcard host replaced by the host of its own address, beside its replay socket, its topic and how
it names blocks (algorithm, block size, and a probe hash that tells the coordinator whether PYTHONHASHSEED agrees).
A publisher that connects out to an external subscriber's socket advertises no endpoint: no coordinator can
subscribe to it (its replay socket still serves snapshots). The vLLM decode engine's publisher is vLLM's own, inside
its engine core: what it bound is read back from vLLM (`EventStream`, built by `decode/vllm/worker.py`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from pdserve.kvcache.block_hash import BlockHasher
from pdserve.kvcache.kv_event_publisher import ZmqEventPublisher
from pdserve.kvcache.kv_events_config import is_bind_endpoint
from pdserve.v1 import worker_pb2 as pb

WILDCARD_HOSTS = ("*", "0.0.0.0", "[::]", "::", "[::0]")


@dataclass(frozen=True)
class EventStream:
    """A publisher pdserve did not open (vLLM's): where it publishes, as `ZmqEventPublisher` says it."""

    endpoint: str
    """Its PUB socket's endpoint: the bound one (a port of 0 resolved), or the one it connects to."""
    replay_endpoint: str | None
    topic: bytes


def probe_hash(hasher: BlockHasher, block_size: int) -> int:
    """The wire hash (low 64 bits, as `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES` sends it) of the parentless block
    [0, 1, .., block_size-1]: equal on two processes iff their algorithm and NONE_HASH seed agree."""
    return int.from_bytes(hasher.block(None, list(range(block_size))), "big") & ((1 << 64) - 1)


def reachable(endpoint: str | None, address: str) -> str:
    """A bound endpoint as another host dials it: a wildcard host replaced by `address`'s host."""
    if not endpoint:
        return ""
    if not endpoint.startswith("tcp://"):
        return endpoint
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    if host in WILDCARD_HOSTS:
        host = address.rpartition(":")[0] or "127.0.0.1"
    return f"tcp://{host}:{port}"


def kv_events_source(publisher: ZmqEventPublisher | EventStream, configured_endpoint: str, address: str, hasher: BlockHasher,
                     block_size: int) -> pb.KvEventsSource:
    """The source a worker with `publisher` (opened from `configured_endpoint`) at `address` advertises."""
    bound = is_bind_endpoint(configured_endpoint)
    return pb.KvEventsSource(
        endpoint=reachable(publisher.endpoint, address) if bound else "",
        replay_endpoint=reachable(publisher.replay_endpoint, address), topic=publisher.topic.decode(),
        hash_algo=hasher.algo, block_size=block_size, probe_hash=probe_hash(hasher, block_size),
        epoch=time.time_ns())
