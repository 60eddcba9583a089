"""How fast this worker prefills, per padding bucket, and how many seconds of work a queue holds.

The engine records each batch (true tokens over wall seconds) under its padded length; the worker
reports, per bucket, its queued tokens, that rate and the expected wait of a new prompt of that length
(its scheduler's replay, `PrefillScheduler.expected_wait`) (`WorkerLoad.prefill_buckets`). `seconds_of`
turns such a report into seconds of work: the coordinator's expected wait (prefill_estimate.py) and
the worker's `pdserve_prefill_queued_seconds` gauge (what the prefill HPA scales on) both use it; the
worker's scheduler reads `PrefillRates.seconds` for each prompt's slack before its TTFT budget.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence

from pdserve.v1 import worker_pb2 as pb

SMOOTHING = 0.3
"""Weight of the newest batch in a bucket's rate (exponential moving average)."""


class PrefillRates:
    def __init__(self, buckets: Sequence[int], smoothing: float = SMOOTHING):
        """buckets: every padded length the engine runs, shortest first."""
        self.buckets = list(buckets)
        self.smoothing = smoothing
        self.tokens_per_second: dict[int, float] = {}
        self._rates: dict[int, float | None] = {}
        """`seconds`' rate per bucket asked for, until the next `record` (the replays ask thousands of times)."""

    def record(self, bucket: int, tokens: int, seconds: float) -> None:
        if seconds <= 0 or tokens <= 0:
            return
        rate = tokens / seconds
        old = self.tokens_per_second.get(bucket)
        self.tokens_per_second[bucket] = rate if old is None else old + self.smoothing * (rate - old)
        self._rates.clear()

    def seconds(self, bucket: int, tokens: int) -> float:
        """Expected seconds to prefill `tokens` of a prompt in `bucket` (a padded length) at the measured
        rate (the nearest measured bucket's); 0 while nothing is measured. The scheduler's slack
        (scheduler.py) uses it."""
        if bucket not in self._rates:
            index = min(bisect.bisect_left(self.buckets, bucket), len(self.buckets) - 1)
            self._rates[bucket] = nearest_rate([self.tokens_per_second.get(b, 0.0) for b in self.buckets], index)
        rate = self._rates[bucket]
        return tokens / rate if rate and tokens > 0 else 0.0

    def report(self, queued_tokens: Mapping[int, int], queued_prompts: Mapping[int, int],
               waits: Mapping[int, float] | None = None) -> list[pb.PrefillBucket]:
        """waits: per bucket, the seconds of other work before a new prompt of its length (the
        scheduler's `expected_wait`); None: not reported."""
        return [
            pb.PrefillBucket(max_tokens=b, queued_tokens=queued_tokens.get(b, 0),
                             queued_prompts=queued_prompts.get(b, 0),
                             tokens_per_second=self.tokens_per_second.get(b, 0.0),
                             **({} if waits is None else {"expected_wait_seconds": waits[b]}))
            for b in self.buckets
        ]


def bucket_of(buckets: Sequence[pb.PrefillBucket], num_tokens: int) -> int:
    """The index of the bucket holding an n-token prompt (the last one for longer prompts)."""
    for i, b in enumerate(buckets):
        if num_tokens <= b.max_tokens:
            return i
    return len(buckets) - 1


def nearest_rate(rates: Sequence[float], index: int) -> float | None:
    """rates[index] when measured (> 0), else the nearest measured one's (on a tie the longer bucket's,
    the slower usually); None: nothing measured."""
    measured = [i for i, r in enumerate(rates) if r > 0]
    if not measured:
        return None
    return rates[min(measured, key=lambda i: (abs(i - index), -i))]


def rate_of(buckets: Sequence[pb.PrefillBucket], index: int) -> float | None:
    """The bucket's measured tokens/s, else the nearest measured bucket's; None: nothing measured."""
    return nearest_rate([b.tokens_per_second for b in buckets], index)


def seconds_of(buckets: Sequence[pb.PrefillBucket], tokens: Iterable[tuple[int, int]]) -> float | None:
    """Seconds to prefill `tokens`, (bucket index, true tokens) pairs, at the buckets' rates."""
    total = 0.0
    for index, n in tokens:
        if n:
            rate = rate_of(buckets, index)
            if rate is None:
                return None
            total += n / rate
    return total


def queued_seconds(buckets: Sequence[pb.PrefillBucket]) -> float:
    """Seconds of work queued on the worker (0 until it has measured a rate)."""
    return seconds_of(buckets, ((i, b.queued_tokens) for i, b in enumerate(buckets))) or 0.0
