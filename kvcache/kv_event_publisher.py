"""ZmqEventPublisher: KV event batches on a ZMQ PUB socket, as vLLM 0.32's `ZmqEventPublisher` sends them.

Wire (what a vLLM subscriber reads):
- PUB: three frames per batch: the topic, an 8-byte big-endian sequence number (per publisher, from 0), the
  msgpack `KVEventBatch`. The endpoint is bound when it holds `*` or `::` or is ipc/inproc, otherwise
  connected (one subscriber binds, every worker connects: llm-d's indexer).
- Replay (ROUTER, bound, optional): a DEALER sends `[b"", start_seq (8 bytes big-endian)]` and gets, for each
  buffered batch from start_seq on, `[b"", topic, seq, payload]`, then the end marker `[b"", b"", -1 (8 bytes,
  signed), b""]`. The last `buffer_steps` batches are kept.

Life: `publish` (the engine's step, any thread) puts the batch on a bounded queue and returns at once; the
publisher's thread encodes and sends it and serves replay requests. Unlike vLLM's (whose put blocks when the
queue is full), a full queue drops the batch, counted in `dropped` and logged: a step never waits on a slow
subscriber (the PUB socket's `hwm` drops messages likewise). `close` sends what is queued (up to a second) and
closes the sockets.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from itertools import count

import msgspec
import zmq

from pdserve.kvcache.kv_events import EventBatch
from pdserve.kvcache.kv_events_config import KvEventsConfig, is_bind_endpoint

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class ZmqEventPublisher:
    SHUTDOWN_TIMEOUT = 1.0

    def __init__(self, config: KvEventsConfig, topic: str | None = None, data_parallel_rank: int = 0) -> None:
        """topic: the config's with its `{worker}` replaced (default: the config's as given)."""
        self.data_parallel_rank = data_parallel_rank
        self.topic = (config.topic if topic is None else topic).encode()
        self._queue: queue.Queue[EventBatch | None] = queue.Queue(maxsize=max(config.max_queue_size, 1))
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self.dropped = 0
        """Batches dropped because the queue was full."""
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay: zmq.Socket | None = None
        try:
            if is_bind_endpoint(config.endpoint):
                self._pub.bind(config.endpoint)
                self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                self._pub.connect(config.endpoint)
                self.endpoint = config.endpoint
            self.replay_endpoint = None
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(config.replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(f"--kv-events-config: cannot open {config.endpoint} / {config.replay_endpoint}: {e} "
                             f"(a port in use: pick another, or give each worker its own)") from e
        self._seq = count()
        self._running = True
        self._thread = threading.Thread(target=self._run, daemon=True, name="kv-events-publisher")
        self._thread.start()

    def publish(self, batch: EventBatch) -> None:
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self.data_parallel_rank
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.warning("KV events: %d batch(es) dropped, the publisher's queue is full (max_queue_size)",
                            self.dropped)

    def close(self) -> None:
        """Sends what is queued (up to SHUTDOWN_TIMEOUT), stops the thread, closes the sockets."""
        if not self._running:
            return
        self._running = False
        deadline = time.monotonic() + self.SHUTDOWN_TIMEOUT
        while True:
            try:
                self._queue.put(None, timeout=max(deadline - time.monotonic(), 0.001))
                break
            except queue.Full:
                if time.monotonic() >= deadline:
                    break
        self._thread.join(timeout=max(deadline - time.monotonic(), 0.0) + 0.2)
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        while True:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except Exception:
                    log.exception("KV events: a replay request failed")
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                if not self._running:
                    return
                continue
            if batch is None:
                return
            try:
                seq = next(self._seq)
                payload = encoder.encode(batch)
                self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
            except Exception:
                log.exception("KV events: publishing a batch failed")
                time.sleep(0.1)

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("KV events: a replay request of %d frames, not [identity, b\"\", start_seq]", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))


def open_publisher(config: KvEventsConfig | None, worker: str) -> ZmqEventPublisher | None:
    """The worker's publisher (its `{worker}` topic filled), or None when events are off."""
    if config is None or not config.enabled:
        return None
    return ZmqEventPublisher(config, topic=config.topic_for(worker))
