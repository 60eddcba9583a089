"""A KV event subscriber for the tests: a SUB socket bound on 127.0.0.1 (the workers connect, as to llm-d's
indexer), frames read by hand, payloads decoded into plain lists and dicts; block hashes recomputed with hashlib."""

from __future__ import annotations

import hashlib
import os
import pickle
import queue
import threading
import time

import cbor2
import msgspec
import zmq

from pdserve.kvcache.kv_event_publisher import ZmqEventPublisher
from pdserve.kvcache.kv_events import KVEventBatch


def vllm_hash(parent: bytes | None, tokens: list[int], algo: str = "sha256") -> bytes:
    """vLLM 0.32's `hash_block_tokens`, written out: NONE_HASH from PYTHONHASHSEED or "vllm-none-hash"."""
    if algo == "sha256_cbor":
        fn = lambda v: hashlib.sha256(cbor2.dumps(v, canonical=True)).digest()
    else:
        fn = lambda v: hashlib.sha256(pickle.dumps(v, protocol=pickle.HIGHEST_PROTOCOL)).digest()
    none_hash = fn(os.environ.get("PYTHONHASHSEED", "vllm-none-hash"))
    return fn((parent or none_hash, tuple(tokens), None))


def chain(tokens: list[int], block_size: int, algo: str = "sha256") -> list[bytes]:
    out: list[bytes] = []
    for i in range(len(tokens) // block_size):
        out.append(vllm_hash(out[-1] if out else None, tokens[i * block_size : (i + 1) * block_size], algo))
    return out


def wire(h: bytes) -> int:
    """A hash as vLLM 0.32 sends it by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1)."""
    return int.from_bytes(h, "big") & ((1 << 64) - 1)


class Subscriber:
    """A SUB socket on its own thread, always polling, as a real subscriber is: libzmq sends a SUB's subscription
    to a newly connected PUB only when the socket is used, and a PUB drops what no subscription asked for."""

    def __init__(self, topic: bytes = b"") -> None:
        self.ctx = zmq.Context.instance()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        port = self.sub.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.received: list[tuple[bytes, int, list]] = []
        self.raw: queue.Queue[list[bytes]] = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.sub.poll(20):
                self.raw.put(self.sub.recv_multipart())
        self.sub.close(linger=0)

    def frames(self, timeout: float = 10.0) -> list[bytes]:
        try:
            return self.raw.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError("no KV event batch arrived") from None

    def pending(self, timeout: float) -> bool:
        """Whether a message arrives within `timeout` seconds (left queued)."""
        deadline = time.monotonic() + timeout
        while self.raw.empty() and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self.raw.empty()

    def recv(self, timeout: float = 10.0) -> tuple[bytes, int, list]:
        """(topic, seq, [ts, events, dp_rank]) of the next message, frames checked by hand."""
        frames = self.frames(timeout)
        assert len(frames) == 3, frames
        topic, seq, payload = frames
        assert len(seq) == 8
        decoded = msgspec.msgpack.decode(payload)
        assert isinstance(decoded, list) and len(decoded) == 3, decoded
        msg = (topic, int.from_bytes(seq, "big"), decoded)
        self.received.append(msg)
        return msg

    def sync(self, publisher: ZmqEventPublisher, timeout: float = 20.0) -> int:
        """Publishes empty probe batches until one arrives (a connecting PUB drops what it sends before the
        subscription reaches it); drains them; the last probe's sequence number."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            publisher.publish(KVEventBatch(ts=time.time(), events=[]))
            if self.pending(0.1):
                break
        else:
            raise AssertionError("the publisher never reached the subscriber")
        last = self.recv()[1]
        while self.pending(0.3):
            last = self.recv()[1]
        return last

    def probe(self, publisher: ZmqEventPublisher) -> list:
        """Everything published before a probe batch (the probe's arrival proves nothing else is on its way)."""
        publisher.publish(KVEventBatch(ts=time.time(), events=[]))
        got = []
        while True:
            msg = self.recv()
            if msg[2][1] == []:
                return got
            got.append(msg)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
