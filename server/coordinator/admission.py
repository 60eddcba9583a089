"""Admission: one deadline per request, and a bounded queue per tier in front of the workers.

A request that finds no worker of a tier with room (decode: under its running cap with the KV blocks
free; prefill: under `max_inflight` calls from this coordinator) waits in that tier's queue until
one has room or its deadline passes. At most `max_size` requests wait per tier; one more is refused
with RESOURCE_EXHAUSTED and a `retry-after-ms` hint (trailing metadata). Waiters are served in
arrival order: only the head of the line tries to pick, so a big request is not starved by small ones
that would fit sooner; a newcomer picks at once only when nobody waits.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from pdserve.server import metrics
from pdserve.server.serving import RETRY_AFTER_MS, retry_hint

if TYPE_CHECKING:
    from pdserve.server.coordinator.worker_pool import Worker, WorkerPool



class RequestFailed(Exception):
    """Ends the client's call with this status (and metadata)."""

    def __init__(self, code: grpc.StatusCode, details: str, metadata: tuple[tuple[str, str], ...] = ()):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.metadata = metadata


@dataclass
class Deadline:
    """The one deadline of a request: routing, prefill, transfer and decode all fit inside it."""

    at: float  # time.monotonic()
    seconds: float

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        return cls(time.monotonic() + seconds, seconds)

    def remaining(self) -> float:
        return self.at - time.monotonic()

    @property
    def expired(self) -> bool:
        return self.remaining() <= 0

    def check(self) -> float:
        """The seconds left; raises DEADLINE_EXCEEDED when none are."""
        left = self.remaining()
        if left <= 0:
            raise RequestFailed(grpc.StatusCode.DEADLINE_EXCEEDED, f"deadline of {self.seconds:.3g} s exceeded")
        return left


class TierQueue:
    def __init__(self, tier: str, max_size: int):
        self.tier = tier
        self.max_size = max_size
        self._line: deque[object] = deque()

    @property
    def waiting(self) -> int:
        return len(self._line)

    async def acquire(self, pool: WorkerPool, pick: Callable[[], Worker | None], deadline: Deadline) -> Worker:
        """A worker with room now, or after waiting in the queue; raises RequestFailed."""
        if not self._line:
            worker = pick()
            if worker is not None:
                return worker
        if self.waiting >= self.max_size:
            metrics.admission_rejections.labels(self.tier).inc()
            raise RequestFailed(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the {self.tier} queue is full ({self.max_size} waiting); you may retry after {RETRY_AFTER_MS} ms",
                retry_hint(),
            )
        ticket = object()
        self._line.append(ticket)
        metrics.num_requests_waiting.inc()
        try:
            while True:
                left = deadline.check()
                await pool.changed(min(left, 0.2))
                if self._line[0] is not ticket:
                    continue
                worker = pick()
                if worker is not None:
                    return worker
                if not (pool.ready(self.tier) or pool.awaiting_recheck(self.tier)):  # type: ignore[arg-type]
                    raise RequestFailed(grpc.StatusCode.UNAVAILABLE, f"no ready {self.tier} worker")
        finally:
            head = self._line[0] is ticket
            self._line.remove(ticket)
            metrics.num_requests_waiting.dec()
            if head and self._line:
                pool.poke()  # the next in line tries at once
