"""Admission by expected wait: how long a new prompt may wait for its first token on a prefill worker.

The estimate is the worst case the worker's scheduler (server/prefill/scheduler.py) allows: every
prompt queued there now may run first (those due before the new one do, and those due after it may
until its slack runs out), and prompts that arrive later never delay it past its due time. So it is
all the queued work, the running step's included (a step's tokens count as queued until it ends),
then the prompt's own prefill, at the worker's measured rates. It reads the worker's last report
(`WorkerLoad.prefill_buckets`: queued tokens and measured tokens/s per length bucket) and the prompts
this coordinator sent it and has not yet seen answered (`Worker.pending_lengths`; per bucket the
larger of the two counts). While the worker has measured no rate there is nothing to go on: no
estimate, the request is admitted.

A request whose estimate exceeds what is left of its TTFT budget (`--ttft-budget`, or its deadline
when shorter, both counted from its arrival at the coordinator) is refused at once with
RESOURCE_EXHAUSTED and `retry-after-ms` = the estimate, instead of queueing for minutes. An admitted
one carries that budget and how long ago it arrived to the worker (PrefillRequest.ttft_budget_seconds,
arrived_seconds_ago), which runs it ahead of later work once its slack runs out: its first token
comes within the budget while the measured rates hold. With nothing queued ahead of it a request is
always admitted, whatever its own prefill takes: an idle worker serves, so a rate measured too low is
measured again.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import grpc

from pdserve.server import metrics
from pdserve.server.coordinator.admission import Deadline, RequestFailed
from pdserve.server.prefill.rates import bucket_of, seconds_of

if TYPE_CHECKING:
    from pdserve.server.coordinator.router import Worker


def expected_wait(worker: Worker, num_tokens: int) -> float | None:
    """Seconds until an n-token prompt sent to `worker` now would have its first token, in the worst
    case; None: unknown."""
    work = _work(worker, num_tokens)
    return None if work is None else sum(work)


def _work(worker: Worker, num_tokens: int) -> tuple[float, float] | None:
    """(seconds of queued work that may run before the prompt, seconds of its own prefill); None: unknown."""
    if worker.info is None or not worker.info.load.prefill_buckets:
        return None
    buckets = worker.info.load.prefill_buckets
    pending = [0] * len(buckets)
    for n in worker.pending_lengths:
        pending[bucket_of(buckets, n)] += n
    ahead_s = seconds_of(buckets, [(i, max(b.queued_tokens, p)) for i, (b, p) in enumerate(zip(buckets, pending))])
    own_s = seconds_of(buckets, [(bucket_of(buckets, num_tokens), num_tokens)])
    return None if ahead_s is None or own_s is None else (ahead_s, own_s)


def ttft_budget_of(deadline: Deadline, ttft_budget: float) -> float:
    """The TTFT budget a request is admitted under, counted from its arrival at the coordinator (so time
    it queued there counts): --ttft-budget (0: none), or its deadline's when that is shorter."""
    return ttft_budget if ttft_budget and ttft_budget < deadline.seconds else deadline.seconds


def admit(worker: Worker, num_tokens: int, deadline: Deadline, ttft_budget: float) -> float | None:
    """The expected wait (None: unknown); raises RequestFailed when it exceeds what is left of the
    request's TTFT budget (ttft_budget_of; the decode lease only runs once the prefill begins, so
    queueing never expires it)."""
    work = _work(worker, num_tokens)
    if work is None:
        return None
    wait = sum(work)
    metrics.prefill_expected_wait.observe(wait)
    budget = ttft_budget_of(deadline, ttft_budget)
    left = budget - (deadline.seconds - deadline.remaining())
    if wait <= left or not work[0]:
        return wait
    metrics.expected_wait_rejections.inc()
    retry_ms = math.ceil(wait * 1000)
    what = (f"of the request's TTFT budget (--ttft-budget {budget:g} s from its arrival)" if budget < deadline.seconds
            else "before the request's deadline")
    raise RequestFailed(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"expected prefill wait {wait:.3g} s (queued work on prefill worker {worker.address} at its measured "
        f"rate) exceeds the {left:.3g} s left {what}; you may retry after {retry_ms} ms",
        (("retry-after-ms", str(retry_ms)),),
    )
