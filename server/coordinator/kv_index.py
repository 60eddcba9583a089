"""KvIndex: which worker holds which KV block, on which medium, read from the workers' KV events.

The same stream an external router reads (vLLM's `KVEventBatch`es, kvcache/kv_events.py), one publisher per
worker, each with its own sequence numbers from 0. A worker's view:
1. `track` makes it, empty and `syncing`; the subscriber then `snapshot`s it through the worker's replay endpoint
   (every buffered batch from sequence 0), so a coordinator started late knows what the workers hold.
2. `receive` applies each live batch in sequence order: BlockStored adds its hashes on its medium, BlockRemoved
   takes them off that medium, AllBlocksCleared empties the view. A batch already applied (a replayed one seen
   again live) is skipped; one past the next expected is a gap: the missing range is asked of the replay endpoint
   (vLLM's replay protocol) and applied first.
3. A range the replay cannot give (no replay endpoint, the worker's buffer has moved past it, no answer) is a
   resync with AllBlocksCleared semantics: the view is emptied, what did arrive is applied, and the view is
   `partial` (a subset of what the worker holds) until the worker clears its cache or starts a new sequence.
   Routing on a partial view says so in its decision's reason (kv_routing.py).
4. `drop` forgets a worker that left the pool; `reset` restarts a worker's view (its publisher restarted).

Hashes are keyed by their low 64 bits, as vLLM sends them by default (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`);
a stream of raw 32-byte hashes, or the coordinator's own `BlockHasher` hashes, are reduced the same way (`key`).
A BlockStored or BlockRemoved without a medium is the device cache's ("GPU", as vLLM's block pool names it).
Memory is bounded: a view keeps at most `max_blocks` hashes (the earliest stored go first: a worker's cache evicts
least recently used blocks, so the oldest are the likeliest gone), and a worker that leaves takes its view along.

Only the subscriber's thread mutates the index, and never while it waits on a replay; every read and write holds
`lock`, so the event loop's lookups see each batch whole and never wait on the network.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from pdserve.kvcache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch

log = logging.getLogger("pdserve.coordinator")

DEVICE_MEDIUM = "GPU"
"""The medium of an event that names none: the worker's device cache (vLLM's MEDIUM_GPU, on any device)."""
MASK = (1 << 64) - 1

ViewState = Literal["syncing", "live", "partial"]
STATES: tuple[ViewState, ...] = ("syncing", "live", "partial")
Replay = Callable[[int], "list[tuple[int, EventBatch]] | None"]
"""replay(start_seq) -> the publisher's buffered (seq, batch) from start_seq on, in order; None: no answer."""


def key(block_hash: bytes | int) -> int:
    """A block hash as the index keys it: the low 64 bits of the big-endian hash (vLLM's int wire form)."""
    if isinstance(block_hash, int):
        return block_hash & MASK
    return int.from_bytes(block_hash, "big") & MASK


@dataclass
class WorkerView:
    tier: str
    """The worker's tier ("prefill" | "decode"): which pool its blocks serve."""
    block_size: int
    state: ViewState = "syncing"
    next_seq: int | None = None
    """The next batch's sequence number; None before the snapshot (or the first batch, with no replay)."""
    blocks: dict[int, tuple[str, ...]] = field(default_factory=dict)
    """hash key -> the media holding it, oldest stored first."""
    last_ts: float = 0.0
    """The newest applied batch's timestamp (the publisher's clock)."""


class KvIndex:
    def __init__(self, max_blocks: int = 1 << 19) -> None:
        self.max_blocks = max_blocks
        """Hashes kept per worker."""
        self.views: dict[str, WorkerView] = {}
        self.lock = threading.Lock()
        self.overflowed = 0
        """Hashes dropped for the bound."""

    # ---- membership --------------------------------------------------------------

    def track(self, worker: str, tier: str, block_size: int) -> None:
        """A worker whose events will be read: an empty view, syncing until its snapshot."""
        with self.lock:
            self.views[worker] = WorkerView(tier, block_size)

    def reset(self, worker: str) -> None:
        """The worker's publisher restarted (a new sequence from 0): its view starts over."""
        with self.lock:
            view = self.views.get(worker)
            if view is not None:
                self.views[worker] = WorkerView(view.tier, view.block_size)

    def drop(self, worker: str) -> None:
        """The worker left: its view and every hash in it go."""
        with self.lock:
            self.views.pop(worker, None)

    # ---- events ------------------------------------------------------------------

    def snapshot(self, worker: str, replay: Replay | None) -> ViewState:
        """Reads the worker's view from its replay endpoint (every buffered batch from 0). Without one, the view
        waits for its first live batch: live when that is sequence 0, partial otherwise."""
        if replay is None:
            return self.state(worker)
        self._fill(worker, 0, replay(0), snapshot=True)
        return self.state(worker)

    def receive(self, worker: str, seq: int, batch: EventBatch, replay: Replay | None) -> None:
        """One live batch of the worker's publisher: applied in order, a gap before it filled by `replay` first
        (or resynced), a batch seen before skipped."""
        with self.lock:
            view = self.views.get(worker)
            if view is None:
                return
            expected = view.next_seq
            if expected is not None and seq < expected:
                return  # applied already (it came in a replay too)
            if expected == seq or (expected is None and seq == 0):
                self._apply(view, seq, batch)
                if view.state == "syncing":
                    view.state = "live"
                return
        start = 0 if expected is None else expected
        got = replay(start) if replay is not None else None
        if got is None or not any(s == seq for s, _ in got):
            got = [*(got or []), (seq, batch)]  # what the replay had, then this batch
        self._fill(worker, start, got)

    def corrupt(self, worker: str, seq: int) -> None:
        """The worker's batch `seq` could not be decoded: what it changed is unknown, so the view resyncs."""
        with self.lock:
            view = self.views.get(worker)
            if view is not None:
                view.blocks.clear()
                view.state, view.next_seq = "partial", seq + 1
        log.warning("KV index: worker %s sent batch %d that does not decode; its view resyncs (partial)", worker, seq)

    def _fill(self, worker: str, start: int, got: list[tuple[int, EventBatch]] | None, snapshot: bool = False) -> None:
        """Applies replayed batches from `start` on: complete when they begin at `start` (or the publisher has
        sent nothing yet, at a snapshot); otherwise the view resyncs from what arrived (partial)."""
        with self.lock:
            view = self.views.get(worker)
            if view is None:
                return
            if got is None:  # no answer: nothing is known past this point
                if not snapshot:
                    view.blocks.clear()
                    view.state = "partial"
                log.warning("KV index: worker %s's replay endpoint did not answer (from batch %d)", worker, start)
                return
            batches = [(s, b) for s, b in sorted(got, key=lambda sb: sb[0]) if s >= start]
            complete = (batches[0][0] == start) if batches else snapshot
            if not complete:
                view.blocks.clear()
                log.warning("KV index: worker %s's batches %d..%s are gone from its replay buffer "
                            "(raise buffer_steps in its --kv-events-config); its view is partial", worker, start,
                            batches[0][0] - 1 if batches else "?")
            for s, batch in batches:
                if view.next_seq is None or s >= view.next_seq or not complete:
                    self._apply(view, s, batch)
            if view.next_seq is None:
                view.next_seq = start
            view.state = "live" if complete and view.state != "partial" else "partial"

    def _apply(self, view: WorkerView, seq: int, batch: EventBatch) -> None:
        blocks = view.blocks
        for event in batch.events:
            if isinstance(event, BlockStored):
                medium = event.medium or DEVICE_MEDIUM
                for h in event.block_hashes:
                    k = key(h)
                    media = blocks.pop(k, ())
                    blocks[k] = media if medium in media else (*media, medium)
                while len(blocks) > self.max_blocks:
                    del blocks[next(iter(blocks))]
                    self.overflowed += 1
            elif isinstance(event, BlockRemoved):
                medium = event.medium or DEVICE_MEDIUM
                for h in event.block_hashes:
                    k = key(h)
                    media = tuple(m for m in blocks.get(k, ()) if m != medium)
                    if media:
                        blocks[k] = media
                    else:
                        blocks.pop(k, None)
            elif isinstance(event, AllBlocksCleared):
                blocks.clear()
                if view.state == "partial":
                    view.state = "live"  # the worker holds nothing now, and the view knows it
        view.next_seq = seq + 1
        view.last_ts = max(view.last_ts, batch.ts)

    # ---- lookups -----------------------------------------------------------------

    def longest_prefix(self, worker: str, hashes: Sequence[bytes | int]) -> tuple[int, list[tuple[str, ...]]]:
        """How many of `hashes` (a prompt's chained block hashes, first block first) the worker holds from the
        start, and the media holding each of them."""
        media: list[tuple[str, ...]] = []
        with self.lock:
            view = self.views.get(worker)
            if view is None:
                return 0, media
            for h in hashes:
                held = view.blocks.get(key(h))
                if not held:
                    break
                media.append(held)
        return len(media), media

    def state(self, worker: str) -> ViewState | None:
        view = self.views.get(worker)
        return view.state if view is not None else None

    def num_blocks(self, worker: str | None = None) -> int:
        """Hashes held in the worker's view (all views' when None)."""
        with self.lock:
            if worker is not None:
                return len(self.views[worker].blocks) if worker in self.views else 0
            return sum(len(v.blocks) for v in self.views.values())

    def counts_by_state(self) -> dict[ViewState, int]:
        with self.lock:
            counts = dict.fromkeys(STATES, 0)
            for view in self.views.values():
                counts[view.state] += 1
            return counts
