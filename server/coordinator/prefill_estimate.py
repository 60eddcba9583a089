"""Admission by expected wait: how long a new prompt would wait for its first token on a prefill worker.

The estimate reads the worker's last report (`WorkerLoad.prefill_buckets`: queued tokens and measured
tokens/s per length bucket; `WorkerInfo.prefill_order`) and the prompts this coordinator sent it and
has not yet seen answered (`Worker.pending_lengths`; per bucket the larger of the two counts):
- fifo: the prompt waits for all the queued work, then for its own prefill;
- shortest-first: for the queued work in its own bucket and the shorter ones (ageing left out), then
  its own. A longer batch already running may add up to one prefill's time, which is not counted.
While the worker has measured no rate there is nothing to go on: no estimate, the request is admitted.

A request whose estimate exceeds its remaining deadline (or `--ttft-budget`) is refused at once with
RESOURCE_EXHAUSTED and `retry-after-ms` = the estimate, instead of queueing for minutes. With nothing
queued ahead of it a request is always admitted, whatever its own prefill takes: an idle worker serves,
so a rate measured too low is measured again.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import grpc

from pdserve.server import metrics
from pdserve.server.coordinator.admission import RequestFailed
from pdserve.server.prefill.rates import bucket_of, seconds_of

if TYPE_CHECKING:
    from pdserve.server.coordinator.router import Worker


def expected_wait(worker: Worker, num_tokens: int) -> float | None:
    """Seconds until an n-token prompt sent to `worker` now would have its first token; None: unknown."""
    work = _work(worker, num_tokens)
    return None if work is None else sum(work)


def _work(worker: Worker, num_tokens: int) -> tuple[float, float] | None:
    """(seconds of queued work ahead of the prompt, seconds of its own prefill); None: unknown."""
    if worker.info is None or not worker.info.load.prefill_buckets:
        return None
    buckets = worker.info.load.prefill_buckets
    pending = [0] * len(buckets)
    for n in worker.pending_lengths:
        pending[bucket_of(buckets, n)] += n
    work = [max(b.queued_tokens, p) for b, p in zip(buckets, pending)]
    own = bucket_of(buckets, num_tokens)
    ahead = range(own + 1) if worker.info.prefill_order == "shortest-first" else range(len(buckets))
    ahead_s = seconds_of(buckets, [(i, work[i]) for i in ahead])
    own_s = seconds_of(buckets, [(own, num_tokens)])
    return None if ahead_s is None or own_s is None else (ahead_s, own_s)


def admit(worker: Worker, num_tokens: int, deadline_left: float, ttft_budget: float) -> float | None:
    """The expected wait (None: unknown); raises RequestFailed when it exceeds what the request allows.

    ttft_budget: 0 for none (the deadline alone bounds the wait; the decode lease only runs once the
    prefill begins, so queueing never expires it).
    """
    work = _work(worker, num_tokens)
    if work is None:
        return None
    wait = sum(work)
    metrics.prefill_expected_wait.observe(wait)
    limit, what = deadline_left, "time left before its deadline"
    if ttft_budget and ttft_budget < limit:
        limit, what = ttft_budget, "TTFT budget (--ttft-budget)"
    if wait <= limit or not work[0]:
        return wait
    metrics.expected_wait_rejections.inc()
    retry_ms = math.ceil(wait * 1000)
    raise RequestFailed(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"expected prefill wait {wait:.3g} s (queued work on prefill worker {worker.address} at its measured "
        f"rate) exceeds the request's {what}, {limit:.3g} s; you may retry after {retry_ms} ms",
        (("retry-after-ms", str(retry_ms)),),
    )
