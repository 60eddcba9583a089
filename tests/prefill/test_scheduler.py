"""The prefill queue's orders and steps: short prompts before long ones, ageing, packed steps,
chunks of long prompts interleaved with short ones, no starvation."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from pdserve.server.prefill.scheduler import PrefillScheduler, Segment, packed_tokens


@dataclass(eq=False)
class Job:
    name: str
    num_tokens: int
    dropped: bool = False
    computed: int = 0
    block_size: int = 16

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
              ageing: float = 256.0, max_chunk: int | None = None) -> PrefillScheduler[Job]:
    return PrefillScheduler(order, bucket=bucket, max_batch_size=max_batch_size,  # type: ignore[arg-type]
                            max_batch_tokens=max_batch_tokens, max_chunk=max_chunk, ageing_tokens_per_s=ageing,
                            clock=clock)


def run(step: list[Segment[Job]]) -> None:
    """What the engine does once a step ran: each job's KV now covers its segment."""
    for seg in step:
        seg.job.computed = seg.end


def drain(s: PrefillScheduler[Job]) -> list[list[str]]:
    """Each step's segments as name (whole prompts) or name[start:end] (chunks)."""
    steps = []
    while step := s.next_step():
        steps.append([g.job.name if g.length == g.job.num_tokens else f"{g.job.name}[{g.start}:{g.end}]"
                      for g in step])
        run(step)
        s.finish(step)
    return steps


@pytest.mark.parametrize("order, want", [
    # 2048 tokens a step, each segment from a 16-token boundary: the short one (32 slots), a 1536-token
    # prompt and the first 480 of the next; then the rest of that...
    ("shortest-first", [["short", "long1", "long2[0:480]"], ["long2[480:1536]", "long3[0:992]"],
                        ["long3[992:1536]"]]),
    ("fifo", [["long1", "long2[0:512]"], ["long2[512:1536]", "long3[0:1024]"], ["long3[1024:1536]", "short"]]),
])
def test_a_short_prompt_behind_three_long_ones(order, want):
    clock = Clock()
    s = scheduler(order, clock)
    for i in (1, 2, 3):
        s.add(Job(f"long{i}", 1536))
        clock.now += 0.1
    s.add(Job("short", 20))
    assert s.queued_tokens == 3 * 1536 + 20
    assert dict(s.queued_by_bucket) == {2048: 3 * 1536, 32: 20}
    assert drain(s) == want
    assert s.queued_tokens == 0 and not s.queued_by_bucket and not s.prompts_by_bucket


def test_prompts_pack_by_their_true_lengths():
    clock = Clock()
    s = scheduler("shortest-first", clock, max_batch_tokens=1024)
    s.add(Job("long", 1000))
    s.add(Job("a", 10))
    s.add(Job("b", 30))
    s.add(Job("c", 12))
    step = s.next_step()
    # by key: a, c, b, then what fits of long; each segment starts on a 16-token block boundary
    assert [(g.job.name, g.start, g.length) for g in step] == [("a", 0, 10), ("c", 0, 12), ("b", 0, 30),
                                                               ("long", 0, 960)]
    assert packed_tokens(step) == 16 + 16 + 32 + 960 == 1024
    run(step)
    s.finish(step)
    assert [(g.job.name, g.start, g.length) for g in s.next_step()] == [("long", 960, 40)]


def test_a_long_prompt_runs_in_chunks_interleaved_with_short_ones_arriving_meanwhile():
    """Issue 19: a short prompt arriving while a long one prefills waits for one step, not the whole prompt."""
    clock = Clock()
    s = scheduler("shortest-first", clock, max_batch_tokens=512, max_chunk=256)
    long = Job("long", 1000)
    s.add(long)
    steps = []
    for i in range(5):
        step = s.next_step()
        steps.append([(g.job.name, g.start, g.length) for g in step])
        clock.now += 0.01
        s.add(Job(f"short{i}", 40))  # arrives while the step runs
        run(step)
        s.finish(step)
    assert steps == [
        [("long", 0, 256)],
        [("short0", 0, 40), ("long", 256, 256)],
        [("short1", 0, 40), ("long", 512, 256)],
        [("short2", 0, 40), ("long", 768, 232)],
        [("short3", 0, 40)],
    ]
    assert long.computed == 1000


def test_a_chunk_other_than_the_last_is_whole_blocks_of_its_prompt():
    clock = Clock()
    s = scheduler("fifo", clock, max_batch_tokens=100, max_chunk=70)
    s.add(Job("p", 150, block_size=32))
    assert drain(s) == [["p[0:64]"], ["p[64:128]"], ["p[128:150]"]]


def test_a_cached_prefix_is_not_run_again():
    clock = Clock()
    s = scheduler("fifo", clock)
    s.add(Job("p", 100, computed=64))
    assert s.queued_tokens == 36
    assert drain(s) == [["p[64:100]"]]
    assert s.queued_tokens == 0


def test_ageing_puts_an_old_long_prompt_before_newer_short_ones():
    clock = Clock()
    s = scheduler("shortest-first", clock, max_batch_size=1, ageing=256.0)
    s.add(Job("long", 1024))  # key 0 + 1024 / 256 = 4.0
    for t in (1.0, 2.0, 3.9, 4.0, 5.0):
        clock.now = t
        s.add(Job(f"short@{t}", 16))  # key t + 0.0625
    assert drain(s) == [["short@1.0"], ["short@2.0"], ["short@3.9"], ["long"], ["short@4.0"], ["short@5.0"]]


def test_queued_work_counts_the_running_step_until_it_finishes_and_drops_cancelled_prompts():
    clock = Clock()
    s = scheduler("shortest-first", clock, max_batch_size=1)
    first, doomed, last = Job("first", 5), Job("doomed", 40), Job("last", 100)
    for job in (first, doomed, last):
        s.add(job)
    running = s.next_step()
    assert [g.job for g in running] == [first]
    assert dict(s.queued_by_bucket) == {16: 5, 64: 40, 128: 100}
    doomed.dropped = True
    run(running)
    s.finish(running)
    step = s.next_step()
    assert [g.job for g in step] == [last]
    assert dict(s.queued_by_bucket) == {128: 100} and dict(s.prompts_by_bucket) == {128: 1}
    run(step)
    s.finish(step)
    assert s.queued_tokens == 0 and len(s) == 0


def test_a_failed_step_forgets_its_prompts():
    s = scheduler("fifo", Clock(), max_batch_tokens=64)
    s.add(Job("p", 100))
    step = s.next_step()
    s.finish(step)  # the engine failed it: computed did not move
    assert s.queued_tokens == 0 and len(s) == 0 and not s.prompts_by_bucket


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
        step = s.next_step()
        for seg in step:
            started.setdefault(seg.job.name, clock.now)
        clock.now += 0.05 + sum(g.length for g in step) / rate
        run(step)
        s.finish(step)
    assert s.queued_tokens == 0 and len(s) == 0
    assert set(started) == set(arrived)
    for a, (a_at, a_key) in arrived.items():
        for b, (b_at, b_key) in arrived.items():
            if b_key > a_key and b_at >= a_at:
                assert started[a] <= started[b], (a, b)
