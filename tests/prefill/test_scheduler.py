"""The prefill queue's orders: short prompts before long ones, ageing, exact batches, no starvation."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from pdserve.server.prefill.scheduler import PrefillScheduler


@dataclass(eq=False)
class Job:
    name: str
    num_tokens: int
    dropped: bool = False

    def cancelled(self) -> bool:
        return self.dropped


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def bucket(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def scheduler(order: str, clock: Clock, *, max_batch_size: int = 8, max_batch_tokens: int = 2048,
              ageing: float = 256.0) -> PrefillScheduler[Job]:
    return PrefillScheduler(order, bucket=bucket, max_batch_size=max_batch_size,  # type: ignore[arg-type]
                            max_batch_tokens=max_batch_tokens, ageing_tokens_per_s=ageing, clock=clock)


def drain(s: PrefillScheduler[Job]) -> list[list[str]]:
    batches = []
    while batch := s.next_batch():
        batches.append([j.name for j in batch])
        s.finish(batch)
    return batches


@pytest.mark.parametrize("order, want", [
    ("shortest-first", [["short"], ["long1"], ["long2"], ["long3"]]),
    ("fifo", [["long1"], ["long2"], ["long3"], ["short"]]),
])
def test_a_short_prompt_behind_three_long_ones(order, want):
    clock = Clock()
    s = scheduler(order, clock)  # 2048 padded tokens a batch: one 1536-token prompt each
    for i in (1, 2, 3):
        s.add(Job(f"long{i}", 1536))
        clock.now += 0.1
    s.add(Job("short", 20))
    assert s.queued_tokens == 3 * 1536 + 20
    assert dict(s.queued_by_bucket) == {2048: 3 * 1536, 32: 20}
    assert drain(s) == want
    assert s.queued_tokens == 0 and not s.queued_by_bucket and not s.prompts_by_bucket


def test_short_prompts_batch_together_and_never_pad_up_to_a_long_one():
    clock = Clock()
    s = scheduler("shortest-first", clock, max_batch_tokens=8192)
    s.add(Job("long", 1000))
    s.add(Job("a", 10))
    s.add(Job("b", 30))
    s.add(Job("c", 12))
    # by key: a (10), c (12), b (30), long; b's bucket (32) is longer than a's (16): a new batch.
    assert drain(s) == [["a", "c"], ["b"], ["long"]]
    fifo = scheduler("fifo", clock, max_batch_tokens=8192)
    for name, n in (("long", 1000), ("a", 10), ("b", 30), ("c", 12)):
        fifo.add(Job(name, n))
    assert drain(fifo) == [["long", "a", "b", "c"]]  # 4 rows x 1024 fit in 8192


def test_ageing_puts_an_old_long_prompt_before_newer_short_ones():
    clock = Clock()
    s = scheduler("shortest-first", clock, max_batch_size=1, ageing=256.0)
    s.add(Job("long", 1024))  # key 0 + 1024 / 256 = 4.0
    for t in (1.0, 2.0, 3.9, 4.0, 5.0):
        clock.now = t
        s.add(Job(f"short@{t}", 16))  # key t + 0.0625
    assert drain(s) == [["short@1.0"], ["short@2.0"], ["short@3.9"], ["long"], ["short@4.0"], ["short@5.0"]]


def test_queued_work_counts_the_running_batch_until_it_finishes_and_drops_cancelled_prompts():
    clock = Clock()
    s = scheduler("shortest-first", clock, max_batch_size=1)
    first, doomed, last = Job("first", 5), Job("doomed", 40), Job("last", 100)
    for job in (first, doomed, last):
        s.add(job)
    running = s.next_batch()
    assert running == [first]
    assert dict(s.queued_by_bucket) == {16: 5, 64: 40, 128: 100}
    doomed.dropped = True
    s.finish(running)
    assert s.next_batch() == [last]
    assert dict(s.queued_by_bucket) == {128: 100} and dict(s.prompts_by_bucket) == {128: 1}
    s.finish([last])
    assert s.queued_tokens == 0 and len(s) == 0


def test_unknown_order_is_refused():
    with pytest.raises(ValueError, match="--prefill-order must be one of fifo, shortest-first"):
        scheduler("lifo", Clock())


@pytest.mark.parametrize("order", ["shortest-first", "fifo"])
def test_nothing_starves_under_a_mixed_load(order):
    """Seeded arrivals faster than the simulated worker serves; then the queue drains. Every prompt
    runs, and none starts after a prompt whose key is later than its own and that arrived after it."""
    rng = random.Random(7)
    clock = Clock()
    s = scheduler(order, clock, max_batch_tokens=4096)
    rate = 2000.0  # tokens/s the simulated worker prefills
    arrived: dict[str, tuple[float, float]] = {}  # name -> (arrival, key)
    started: dict[str, float] = {}
    for step in range(3000):  # bounded: arrivals stop at step 300, then the queue drains
        if step >= 300 and not len(s):
            break
        if step < 300:
            for _ in range(rng.choice((0, 1, 1, 2))):
                n = rng.choice((8, 20, 60, 300, 1500))
                job = Job(f"j{len(arrived)}", n)
                key = clock.now if order == "fifo" else clock.now + n / 256.0
                arrived[job.name] = (clock.now, key)
                s.add(job)
        batch = s.next_batch()
        for job in batch:
            started[job.name] = clock.now
        clock.now += 0.05 + sum(j.num_tokens for j in batch) / rate
        s.finish(batch)
    assert s.queued_tokens == 0 and len(s) == 0
    assert set(started) == set(arrived)
    for a, (a_at, a_key) in arrived.items():
        for b, (b_at, b_key) in arrived.items():
            if b_key > a_key and b_at >= a_at:
                assert started[a] <= started[b], (a, b)
