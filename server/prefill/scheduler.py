"""The prefill queue: which waiting prompts run in the next batch.

Life cycle of a prompt here:
1. `add` queues it with a priority key fixed at arrival.
2. `next_batch` takes prompts in key order into one batch (up to `max_batch_size` prompts and
   `max_batch_tokens` padded tokens), dropping those cancelled while queued.
3. `finish` forgets the batch once it ran; until then its tokens still count as queued work.

Orders (`PrefillOrder`):
- fifo: by arrival.
- shortest-first: shortest remaining work first, with ageing, so nothing starves. The key is
  `arrival + tokens / ageing_tokens_per_s`: a prompt runs no later than every prompt that arrives
  more than `tokens / ageing_tokens_per_s` seconds after it, so a long one waits at most that long
  for later short ones. A batch takes no prompt of a longer padding bucket than its first one: a
  long prompt padded into a batch of short ones would hold all their first tokens back.
Either way prompts start in key order: a batch is the longest prefix of the queue that fits.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, Literal, Protocol, TypeVar

PrefillOrder = Literal["fifo", "shortest-first"]
PREFILL_ORDERS: tuple[PrefillOrder, ...] = ("fifo", "shortest-first")


class Schedulable(Protocol):
    @property
    def num_tokens(self) -> int: ...

    def cancelled(self) -> bool: ...


J = TypeVar("J", bound=Schedulable)


@dataclass(order=True)
class _Entry(Generic[J]):
    key: float
    seq: int
    job: J = field(compare=False)
    bucket: int = field(compare=False)


class PrefillScheduler(Generic[J]):
    def __init__(
        self,
        order: PrefillOrder,
        *,
        bucket: Callable[[int], int],
        max_batch_size: int,
        max_batch_tokens: int,
        ageing_tokens_per_s: float = 32.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        """bucket(n): the padded length of an n-token prompt (the engine's power-of-two bucket)."""
        if order not in PREFILL_ORDERS:
            raise ValueError(f"--prefill-order must be one of {', '.join(PREFILL_ORDERS)}, not {order!r}")
        if not ageing_tokens_per_s > 0:
            raise ValueError(f"--prefill-ageing must be > 0 tokens/s, got {ageing_tokens_per_s}")
        self.order = order
        self.bucket = bucket
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.ageing_tokens_per_s = ageing_tokens_per_s
        self.clock = clock
        self._heap: list[_Entry[J]] = []
        self._seq = itertools.count()
        self._running: list[_Entry[J]] = []
        self.queued_by_bucket: Counter[int] = Counter()
        """Tokens of the prompts waiting or running, by padding bucket."""
        self.prompts_by_bucket: Counter[int] = Counter()

    @property
    def queued_tokens(self) -> int:
        return sum(self.queued_by_bucket.values())

    def __len__(self) -> int:
        return len(self._heap)

    def add(self, job: J) -> None:
        now = self.clock()
        key = now if self.order == "fifo" else now + job.num_tokens / self.ageing_tokens_per_s
        entry = _Entry(key, next(self._seq), job, self.bucket(job.num_tokens))
        heapq.heappush(self._heap, entry)
        self._count(entry, +1)

    def next_batch(self) -> list[J]:
        batch: list[_Entry[J]] = []
        while self._heap and len(batch) < self.max_batch_size:
            entry = self._heap[0]
            if entry.job.cancelled():
                heapq.heappop(self._heap)
                self._count(entry, -1)
                continue
            if batch and not self._fits(batch, entry):
                break
            batch.append(heapq.heappop(self._heap))
        self._running.extend(batch)
        return [e.job for e in batch]

    def finish(self, batch: list[J]) -> None:
        """The batch ran (or failed): its prompts no longer count as queued work."""
        done = {id(j) for j in batch}
        for entry in [e for e in self._running if id(e.job) in done]:
            self._running.remove(entry)
            self._count(entry, -1)

    def _fits(self, batch: list[_Entry[J]], entry: _Entry[J]) -> bool:
        if self.order == "shortest-first" and entry.bucket > batch[0].bucket:
            return False
        longest = max(entry.bucket, *(e.bucket for e in batch))
        rows = 1 << len(batch).bit_length()  # the batch is padded to a power of two rows
        return rows * longest <= self.max_batch_tokens

    def _count(self, entry: _Entry[J], sign: int) -> None:
        self.queued_by_bucket[entry.bucket] += sign * entry.job.num_tokens
        self.prompts_by_bucket[entry.bucket] += sign
        if not self.prompts_by_bucket[entry.bucket]:
            del self.queued_by_bucket[entry.bucket], self.prompts_by_bucket[entry.bucket]
