"""KvSubscriber: the coordinator's reader of every worker's KV events, on a thread of its own, into its KvIndex.

The coordinator learns where to read from the workers themselves: each worker with `--kv-events-config` advertises
a `KvEventsSource` in its WorkerInfo (its bound PUB socket, replay socket, topic, and how it names blocks), which
the coordinator sees at registration and on every GetInfo round. So nothing is configured on the coordinator, and
under `pdserve up --kv-events-config` every coordinator replica reads every worker.

Life:
1. `set_sources` (the event loop, after each pool change) hands over the workers' sources; the thread picks them
   up within a poll interval.
2. A new source: a SUB socket connects to its endpoint (its topic subscribed), the worker's view is tracked and
   snapshotted through its replay endpoint (a DEALER: `[b"", start_seq]`, vLLM's replay protocol), so a replica
   started later converges on the same view as the others. A source whose probe hash differs from this
   coordinator's hasher (another --prefix-caching-hash-algo or PYTHONHASHSEED) is refused, loudly: its hashes
   could never match a prompt's.
3. Each batch is decoded with vLLM's `KVEventBatch` struct and handed to the index, which asks the replay socket
   for any gap (kv_index.py).
4. A source that changed (a new epoch: the worker restarted) starts over; one that is gone (the worker left the
   pool) is closed and its view dropped. `close` ends the thread and its sockets.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
import zmq

from pdserve.kvcache.block_hash import BlockHasher
from pdserve.kvcache.kv_events import KVEventBatch
from pdserve.server import metrics
from pdserve.server.coordinator.kv_index import STATES, KvIndex
from pdserve.server.kv_events_source import probe_hash
from pdserve.v1 import worker_pb2 as pb

if TYPE_CHECKING:
    from pdserve.server.coordinator.worker_pool import Worker

log = logging.getLogger("pdserve.coordinator")

END_SEQ = -1


@dataclass(frozen=True)
class Source:
    """A worker's advertised events, as read from its info."""

    tier: str
    endpoint: str
    replay_endpoint: str
    topic: str
    block_size: int
    probe_hash: int
    epoch: int

    @classmethod
    def of(cls, tier: str, source: pb.KvEventsSource) -> Source:
        return cls(tier, source.endpoint, source.replay_endpoint, source.topic, source.block_size or 1,
                   source.probe_hash, source.epoch)


def sources_of(workers: dict[str, Worker]) -> dict[str, Source]:
    """The sources the workers advertise (those without `--kv-events-config` advertise none)."""
    return {address: Source.of(w.role, w.info.kv_events) for address, w in workers.items()
            if w.info is not None and w.info.HasField("kv_events")}


class KvSubscriber:
    POLL_MS = 50
    REPLAY_TIMEOUT = 2.0
    """Seconds a replay may take before its range counts as lost (the view resyncs)."""
    MAX_BATCHES_PER_POLL = 256
    MAX_MESSAGE_BYTES = 64 << 20
    """A larger frame from a worker is dropped by zmq (a gap, then a replay or a resync), never held in memory."""

    def __init__(self, index: KvIndex, hasher: BlockHasher) -> None:
        """hasher: names the prompts' blocks on this coordinator; a source whose probe hash it does not reproduce
        is not read."""
        self.index = index
        self.hasher = hasher
        self._ctx = zmq.Context.instance()
        self._decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self._wanted: dict[str, Source] = {}
        self._wanted_version = 0
        self._lock = threading.Lock()
        self._sources: dict[str, Source] = {}
        self._subs: dict[str, zmq.Socket] = {}
        self._refused: set[tuple[str, int]] = set()
        self._running = True
        self._thread = threading.Thread(target=self._run, daemon=True, name="kv-events-subscriber")

    # ---- the event loop's side -----------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def set_sources(self, sources: dict[str, Source]) -> None:
        """Every worker's source now (a worker left out is dropped)."""
        with self._lock:
            if sources != self._wanted:
                self._wanted = dict(sources)
                self._wanted_version += 1

    def close(self) -> None:
        self._running = False
        if self._thread.is_alive():
            self._thread.join(timeout=self.REPLAY_TIMEOUT + 1.0)
        for sub in self._subs.values():
            sub.close(linger=0)
        self._subs.clear()

    # ---- the thread ----------------------------------------------------------------

    def _run(self) -> None:
        seen_version = -1
        poller = zmq.Poller()
        while self._running:
            with self._lock:
                version, wanted = self._wanted_version, self._wanted
            if version != seen_version:
                seen_version = version
                poller = self._reconcile(wanted)
                self._report()
            try:
                ready = dict(poller.poll(self.POLL_MS)) if self._subs else {}
                if not self._subs:
                    time.sleep(self.POLL_MS / 1000)
                for worker, sub in list(self._subs.items()):
                    if sub in ready:
                        self._drain(worker, sub)
            except Exception:  # never let one bad batch end the thread
                log.exception("KV index: reading the workers' events failed")
                time.sleep(0.1)
            self._report()

    def _reconcile(self, wanted: dict[str, Source]) -> zmq.Poller:
        for worker in [w for w in self._sources if wanted.get(w) != self._sources[w]]:
            self._subs.pop(worker).close(linger=0)
            del self._sources[worker]
            self.index.drop(worker)
        for worker, source in wanted.items():
            if worker in self._sources or not self._usable(worker, source):
                continue
            sub = self._ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.MAXMSGSIZE, self.MAX_MESSAGE_BYTES)
            sub.setsockopt(zmq.SUBSCRIBE, source.topic.encode())
            sub.connect(source.endpoint)
            self._subs[worker], self._sources[worker] = sub, source
            self.index.track(worker, source.tier, source.block_size)
            state = self.index.snapshot(worker, self._replayer(source))
            log.info("KV index: reading %s worker %s's events from %s (view %s, %d blocks)", source.tier, worker,
                     source.endpoint, state, self.index.num_blocks(worker))
        poller = zmq.Poller()
        for sub in self._subs.values():
            poller.register(sub, zmq.POLLIN)
        return poller

    def _usable(self, worker: str, source: Source) -> bool:
        if not source.endpoint:
            self._refuse(worker, source, "its publisher connects out to another subscriber (its --kv-events-config "
                                         "endpoint has no `*`): bind it, e.g. tcp://*:5557, for the coordinator to read")
            return False
        if source.probe_hash != probe_hash(self.hasher, source.block_size):
            self._refuse(worker, source, "its block hashes differ from this coordinator's: give every process the "
                                         "same --prefix-caching-hash-algo and PYTHONHASHSEED")
            return False
        return True

    def _refuse(self, worker: str, source: Source, why: str) -> None:
        if (worker, source.epoch) not in self._refused:
            self._refused.add((worker, source.epoch))
            log.log(logging.WARNING if not source.endpoint else logging.ERROR,"KV index: not reading %s worker %s's KV events: %s; it is routed to without them",
                      source.tier, worker, why)

    def _drain(self, worker: str, sub: zmq.Socket) -> None:
        replay = self._replayer(self._sources[worker])
        for _ in range(self.MAX_BATCHES_PER_POLL):
            try:
                frames = sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3:
                log.warning("KV index: worker %s sent %d frames, not [topic, seq, batch]", worker, len(frames))
                continue
            seq = int.from_bytes(frames[1], "big")
            try:
                batch = self._decoder.decode(frames[2])
            except (msgspec.DecodeError, msgspec.ValidationError):
                self.index.corrupt(worker, seq)
                metrics.kv_index_resyncs.labels("partial").inc()
                continue
            metrics.kv_index_event_lag.observe(max(time.time() - batch.ts, 0.0))
            before = self.index.views.get(worker)
            expected = before.next_seq if before is not None else None
            self.index.receive(worker, seq, batch, replay)
            if expected is not None and seq > expected:
                outcome = "partial" if self.index.state(worker) == "partial" else "replayed"
                metrics.kv_index_resyncs.labels(outcome).inc()

    def _replayer(self, source: Source):
        if not source.replay_endpoint:
            return None
        return lambda start: self._replay(source.replay_endpoint, start)

    def _replay(self, endpoint: str, start: int) -> list[tuple[int, KVEventBatch]] | None:
        """vLLM's replay protocol: every buffered batch from `start`, up to the end marker; None without one in
        REPLAY_TIMEOUT."""
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.MAXMSGSIZE, self.MAX_MESSAGE_BYTES)
        try:
            dealer.connect(endpoint)
            dealer.send_multipart((b"", start.to_bytes(8, "big")))
            deadline = time.monotonic() + self.REPLAY_TIMEOUT
            got: list[tuple[int, KVEventBatch]] = []
            while (left := deadline - time.monotonic()) > 0:
                if not dealer.poll(int(left * 1000)):
                    break
                frames = dealer.recv_multipart()
                if len(frames) != 4:
                    continue
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq == END_SEQ:
                    return got
                try:
                    got.append((seq, self._decoder.decode(frames[3])))
                except (msgspec.DecodeError, msgspec.ValidationError):
                    return None
            log.warning("KV index: no replay from %s within %.1f s", endpoint, self.REPLAY_TIMEOUT)
            return None
        finally:
            dealer.close(linger=0)

    def _report(self) -> None:
        counts = self.index.counts_by_state()
        for state in STATES:
            metrics.kv_index_workers.labels(state).set(counts[state])
