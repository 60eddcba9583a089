"""Admission by expected wait: how long a new prompt would wait for its first token on a prefill worker.

The worker reports, per length bucket, the seconds of other work its scheduler (server/prefill/
scheduler.py) would run before the first token of a new prompt of that length (`PrefillBucket.
expected_wait_seconds`): it replays its queue as its policy runs it, the running step's rest first,
then what its order puts before the prompt (shortest-first: the shorter and older prompts; fifo: all)
and what the queued prompts' due times force ahead of it, at its measured rates. The estimate is
that, plus the prompts this coordinator sent since that report (`Worker.unreported_lengths`) that
the order puts first, plus the prompt's own prefill. A worker that reports no such wait (an older
one) gets the worst case: all its queued work (the larger of its report and `Worker.pending_lengths`,
per bucket), then the prompt's own. While the worker has measured no rate there is nothing to go on:
no estimate, the request is admitted.

A request whose estimate exceeds what is left of its TTFT budget (`--ttft-budget`, or its deadline
when shorter, both counted from its arrival at the coordinator) is refused at once with
RESOURCE_EXHAUSTED and `retry-after-ms` = the estimate, instead of queueing for minutes. An admitted
one carries that budget and how long ago it arrived to the worker (PrefillRequest.ttft_budget_seconds,
arrived_seconds_ago): its first token is due then, and the worker's scheduler runs it ahead of later
work once its slack runs out, so later arrivals cannot push it past the estimate's bound; with the
measured rates right it comes within the budget, give or take the step it lands in. With nothing
queued ahead of it a request is always admitted, whatever its own prefill takes: an idle worker
serves, so a rate measured too low is measured again. Each admitted request's estimate goes to
`pdserve_prefill_expected_wait_seconds`, its actual wait (Prefill call to first token) to
`pdserve_prefill_wait_seconds`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import grpc

from pdserve.server import metrics
from pdserve.server.coordinator.admission import Deadline, RequestFailed
from pdserve.server.prefill.rates import bucket_of, seconds_of
from pdserve.server.serving import retry_hint

if TYPE_CHECKING:
    from pdserve.server.coordinator.worker_pool import Worker


def expected_wait(worker: Worker, num_tokens: int) -> float | None:
    """Seconds until an n-token prompt sent to `worker` now would have its first token; None: unknown."""
    work = _work(worker, num_tokens)
    return None if work is None else sum(work)


def _work(worker: Worker, num_tokens: int) -> tuple[float, float] | None:
    """(seconds of other work before the prompt's first token, seconds of its own prefill); None: unknown."""
    if worker.info is None or not worker.info.load.prefill_buckets:
        return None
    buckets = worker.info.load.prefill_buckets
    own = bucket_of(buckets, num_tokens)
    own_s = seconds_of(buckets, [(own, num_tokens)])
    if own_s is None:
        return None
    if buckets[own].HasField("expected_wait_seconds"):
        unreported = _tokens_by_bucket(buckets, worker.unreported_lengths)
        first = range(own + 1) if worker.info.prefill_order == "shortest-first" else range(len(buckets))
        ahead_s = buckets[own].expected_wait_seconds + (seconds_of(buckets, [(i, unreported[i]) for i in first]) or 0.0)
    else:
        pending = _tokens_by_bucket(buckets, worker.pending_lengths)
        ahead_s = seconds_of(buckets, [(i, max(b.queued_tokens, p)) for i, (b, p) in enumerate(zip(buckets, pending))])
        if ahead_s is None:
            return None
    return ahead_s, own_s


def _tokens_by_bucket(buckets, lengths: list[int]) -> list[int]:
    """The prompt tokens of `lengths`, summed per length bucket of the worker's report."""
    tokens = [0] * len(buckets)
    for n in lengths:
        tokens[bucket_of(buckets, n)] += n
    return tokens


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
    budget = ttft_budget_of(deadline, ttft_budget)
    left = budget - (deadline.seconds - deadline.remaining())
    if wait <= left or not work[0]:
        metrics.prefill_expected_wait.observe(wait)
        return wait
    metrics.expected_wait_rejections.inc()
    retry_ms = math.ceil(wait * 1000)
    what = (f"of the request's TTFT budget (--ttft-budget {budget:g} s from its arrival)" if budget < deadline.seconds
            else "before the request's deadline")
    raise RequestFailed(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"expected prefill wait {wait:.3g} s (the work prefill worker {worker.address} runs first, at its "
        f"measured rates) exceeds the {left:.3g} s left {what}; you may retry after {retry_ms} ms",
        retry_hint(retry_ms),
    )
