"""The prefill queue's orders and steps: short prompts before long ones, ageing, packed steps,
chunks of long prompts interleaved with short ones, no starvation, and admitted prompts' due times
kept against later arrivals (a scripted clock and rate)."""

from __future__ import annotations

import random

import pytest

from pdserve.server.prefill.scheduler import PrefillScheduler, Segment, packed_tokens

from .jobs import Clock, Job, bucket


def unmeasured(bucket: int, tokens: int) -> float:
    return 0.0


def at_100_tokens_per_s(bucket: int, tokens: int) -> float:
    """A scripted worker's measured rate: 100 tokens/s whatever the length."""
    return tokens / 100


def scheduler(order: str, clock: Clock, *, max_batch_size: int = 8, max_batch_tokens: int = 2048,
              ageing: float = 256.0, max_chunk: int | None = None, seconds=unmeasured) -> PrefillScheduler[Job]:
    return PrefillScheduler(order, bucket=bucket, max_batch_size=max_batch_size,  # type: ignore[arg-type]
                            max_batch_tokens=max_batch_tokens, max_chunk=max_chunk, ageing_tokens_per_s=ageing,
                            seconds=seconds, clock=clock)


def run(step: list[Segment[Job]]) -> None:
    """What the engine does once a step ran: each job's KV now covers its segment."""
    for seg in step:
        seg.job.computed = seg.end


def drain(s: PrefillScheduler[Job], clock: Clock | None = None) -> list[list[str]]:
    """Each step's segments as name (whole prompts) or name[start:end] (chunks); each step moves the
    clock, when given, at 100 tokens/s."""
    steps = []
    while step := s.next_step():
        steps.append([g.job.name if g.length == g.job.num_tokens else f"{g.job.name}[{g.start}:{g.end}]"
                      for g in step])
        if clock is not None:
            clock.now += sum(at_100_tokens_per_s(0, g.length) for g in step)
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


def serve(s: PrefillScheduler[Job], clock: Clock, watched: list[Job], arrivals: int = 400) -> dict[str, tuple[float, float]]:
    """Runs steps at 100 tokens/s until every watched prompt has its first token; before each step a
    25-token prompt arrives (0.25 s of work), due 30 s later. Returns (start, first token) per watched name."""
    times: dict[str, tuple[float, float]] = {}
    for i in range(arrivals):
        s.add(Job(f"short{i}", 25), due=clock.now + 30.0)
        step = s.next_step()
        start = clock.now
        clock.now += sum(at_100_tokens_per_s(0, g.length) for g in step)
        run(step)
        s.finish(step)
        for g in step:
            if g.job in watched and g.last:
                times[g.job.name] = (start, clock.now)
        if len(times) == len(watched):
            break
    return times


def test_an_admitted_long_prompt_starts_by_its_budget_less_its_prefill_whatever_arrives_after_it():
    """Issue 19's bound by construction: 1,000 tokens (10 s) admitted with a 30 s budget, then a short
    prompt before every step. Shortest-first runs the short ones while the long one's slack lasts
    (ageing too slow to help: 1 token/s); it starts at 30 - 10 = 20 s and its first token comes at its
    due time, 30 s. Without due times it would wait for the short ones to stop."""
    clock = Clock()
    s = scheduler("shortest-first", clock, max_batch_size=1, ageing=1.0, seconds=at_100_tokens_per_s)
    long = Job("long", 1000)
    s.add(long, due=30.0)
    assert serve(s, clock, [long]) == {"long": (20.0, 30.0)}


def test_two_admitted_long_prompts_each_make_their_due_time():
    """The second one's slack counts the first one's prefill: both must start by 10.25 s, not 20 s each
    (a prompt's own slack alone would run the first at 20 s and make the second 9.75 s late)."""
    clock = Clock()
    s = scheduler("shortest-first", clock, max_batch_size=1, ageing=1.0, seconds=at_100_tokens_per_s)
    a, b = Job("a", 1000), Job("b", 1000)
    s.add(a, due=30.0)
    s.add(b, due=30.25)
    assert serve(s, clock, [a, b]) == {"a": (10.25, 20.25), "b": (20.25, 30.25)}


def test_a_step_packs_short_prompts_beside_a_due_one_only_within_its_slack():
    """The prompts of a step finish together: with 0.5 s of slack left, two 0.25 s prompts may join the
    due one's step, the other two wait for the next."""
    clock = Clock()
    s = scheduler("shortest-first", clock, seconds=at_100_tokens_per_s)
    long = Job("long", 1000)
    s.add(long, due=10.5)
    for i in range(4):
        s.add(Job(f"s{i}", 25), due=30.0)
    assert drain(s, clock) == [["s0", "s1", "long"], ["s2", "s3"]]
    assert clock.now == 11.0


def test_a_past_due_prompt_runs_first_and_allows_others_before_nothing_but_beside_it():
    """A prompt that misses its due time even if it runs alone now goes first, earliest due first; it
    keeps nothing from packing beside it (it is late whatever they do). One without a due time (from
    an older coordinator) runs where the due prompts' slack allows it, here between the two."""
    clock = Clock()
    s = scheduler("shortest-first", clock, max_batch_size=1, seconds=at_100_tokens_per_s)
    s.add(Job("anytime", 25))  # 0.25 s, the first by key
    s.add(Job("late", 500), due=1.0)  # 5 s of work due in 1 s
    s.add(Job("next", 300), due=9.0)  # 3 s more: once "late" ends at 5 s, 1 s of slack
    assert drain(s, clock) == [["late"], ["anytime"], ["next"]]
    assert clock.now == 8.25


def test_past_due_prompts_do_not_hold_the_token_budget_hostage():
    """Two past-due prompts (the later due first by key) and four short ones due in 30 s: the step
    takes the past-due ones first, earliest due first, and packs the short ones beside them. (When a
    late prompt's slack of 0 allowed nothing due after it, the step was the late prompts alone.)"""
    clock = Clock()
    s = scheduler("shortest-first", clock, max_batch_tokens=512, seconds=at_100_tokens_per_s)
    s.add(Job("late2", 100), due=0.5)
    s.add(Job("late1", 200), due=0.25)
    clock.now = 1.0  # both past due
    for i in range(4):
        s.add(Job(f"s{i}", 25), due=31.0)
    assert drain(s, clock) == [["late1", "late2", "s0", "s1", "s2", "s3"]]


def test_the_expected_wait_counts_only_the_work_the_order_and_the_due_times_run_first():
    """A scripted slow worker: three admitted 500-token prompts (5 s each at 100 tokens/s) due in 30 s:
    a short prompt arriving now would run before them (their slack allows it), a long one after all three; under fifo the
    short one waits for all three. The running step's rest counts, and a due time that leaves no room
    for the short prompt puts that prompt first."""
    clock = Clock()
    s = scheduler("shortest-first", clock, max_batch_size=1, ageing=32.0, seconds=at_100_tokens_per_s)
    for i in (1, 2, 3):
        s.add(Job(f"long{i}", 500), due=30.0)  # keys 500 / 32 = 15.6 s after their arrival
    assert s.expected_wait(20) == 0.0
    assert s.expected_wait(500) == 15.0
    running = s.next_step()
    assert [g.job.name for g in running] == ["long1"]  # runs until 5 s
    clock.now = 2.0
    assert s.expected_wait(20) == 3.0  # the running step's rest
    assert s.expected_wait(500) == 13.0
    s.add(Job("short", 20), due=32.0)  # and so it runs: first once the running step ends
    clock.now = 5.0
    run(running)
    s.finish(running)
    assert drain(s, clock) == [["short"], ["long2"], ["long3"]]
    tight = scheduler("shortest-first", Clock(), max_batch_size=1, seconds=at_100_tokens_per_s)
    tight.add(Job("long", 500), due=5.25)  # 0.25 s of slack: a 0.3 s prompt would make it late
    assert tight.expected_wait(30) == 5.0
    assert tight.expected_wait(25) == 0.0  # 0.25 s: within the slack
    fifo = scheduler("fifo", Clock(), max_batch_size=1, seconds=at_100_tokens_per_s)
    for i in (1, 2, 3):
        fifo.add(Job(f"long{i}", 500), due=30.0)
    assert fifo.expected_wait(20) == 15.0
    assert scheduler("shortest-first", Clock()).expected_wait(20) == 0.0  # idle


def test_a_prompts_expected_wait_stretches_by_the_share_of_the_worker_shorter_arrivals_took():
    """Ten 50-token prompts (0.5 s each) arrived and ran in the last 10 s: shorter prompts take half the
    worker, so a 500-token one (5 s) that waits for nothing queued still expects (0 + 5) / 0.5 - 5 =
    5 s of them before its first token; a prompt of their own length, and any under fifo, none.
    Arrivals older than the window count no more."""
    clock = Clock()
    s = scheduler("shortest-first", clock, seconds=at_100_tokens_per_s)
    fifo = scheduler("fifo", clock, seconds=at_100_tokens_per_s)
    for q in (s, fifo):
        for i in range(10):
            q.add(Job(f"s{i}", 50), due=30.0)
    drain(s)
    drain(fifo)
    clock.now = 5.0
    assert s.expected_wait(500) == 5.0
    assert s.expected_wait(50) == 0.0 and fifo.expected_wait(500) == 0.0
    clock.now = 10.5
    assert s.expected_wait(500) == 0.0


def overload(admission: str, slow: float = 1.0, slow_until: float = 0.0,
             overhead: float = 0.0) -> tuple[dict[int, int], dict[str, float], dict[str, float], int]:
    """Seeded Poisson arrivals, 1.2x what the worker serves: 32-token prompts at 55/s (1,760 tokens/s)
    and 1,500-token ones at 0.4/s (600) for 30 s, each admitted on arrival (mid-step too) as the
    coordinator does, within a 2 s budget: `admission` "worst-case" (all the queued work, the running
    step's included, then its own prefill) or "expected" (the scheduler's `expected_wait`, then its own
    prefill). The worker serves at the rate the scheduler assumes (2,000 tokens/s), `slow` times
    slower until `slow_until`, plus `overhead` seconds a step that the assumed rate leaves out. Returns (refused prompts by length, due time and first token of each
    admitted prompt, steps)."""
    rng = random.Random(11)
    clock = Clock()
    rate, budget = 2000.0, 2.0

    def seconds(bucket: int, tokens: int) -> float:
        return tokens / rate

    s = scheduler("shortest-first", clock, max_batch_tokens=512, ageing=32.0, seconds=seconds)
    arrivals: list[tuple[float, int]] = []
    t = 0.0
    while t < 30.0:
        t += rng.expovariate(55.4)
        arrivals.append((t, 32 if rng.random() < 55 / 55.4 else 1500))
    due: dict[str, float] = {}
    first: dict[str, float] = {}
    refused: dict[int, int] = {32: 0, 1500: 0}
    steps = 0
    while arrivals or len(s):
        step = s.next_step()
        steps += bool(step)
        took = sum(g.length for g in step) / rate * (slow if clock.now < slow_until else 1.0) + overhead
        end = clock.now + took if step else arrivals[0][0]
        while arrivals and arrivals[0][0] <= end:  # arriving while the step runs
            clock.now, n = arrivals.pop(0)
            ahead = s.queued_tokens / rate if admission == "worst-case" else s.expected_wait(n)
            if ahead + n / rate > budget:
                refused[n] += 1
                continue
            job = Job(f"j{len(due)}", n)
            due[job.name] = clock.now + budget
            s.add(job, due=due[job.name])
        clock.now = end
        run(step)
        s.finish(step)
        first.update((g.job.name, clock.now) for g in step if g.last)
    assert s.queued_tokens == 0 and set(first) == set(due)  # nothing starves
    return refused, due, first, steps


def test_admitted_by_worst_case_wait_every_prompt_makes_its_due_time_under_an_overload():
    """The worst case (all the queued work) keeps every admitted prompt within its due time, but short
    prompts wait for long ones' slack and some are refused. (Without due times, short prompts
    overtaking admitted long ones made 6 of them late, one by 15 s.)"""
    refused, due, first, _ = overload("worst-case")
    assert (refused, len(due)) == ({32: 5, 1500: 7}, 1663)  # overloaded, and still serving nearly all
    late = {name: first[name] - due[name] for name in due if first[name] > due[name] + 1e-9}
    assert late == {}
    waits = sorted(first[name] - (due[name] - 2.0) for name in due)
    assert 1.4 < waits[len(waits) // 2] < 1.5  # the median prompt (a short one) waits 1.4-1.5 s


def test_admitted_by_expected_wait_short_prompts_run_first_and_none_is_late():
    """The expected wait (what the order and the due times run first, stretched by the shorter
    prompts' share of the worker) admits every short prompt and refuses the long ones that shorter
    arrivals would keep waiting past their budget (they take 88% of the worker here); no admitted
    prompt's first token comes after its due time, and the median one waits 0.12 s, not 1.45 s."""
    refused, due, first, _ = overload("expected")
    assert (refused, len(due)) == ({32: 0, 1500: 11}, 1664)
    assert max(first[name] - due[name] for name in due) <= 0.0
    waits = sorted(first[name] - (due[name] - 2.0) for name in due)
    assert waits[len(waits) // 2] < 0.125


def test_nothing_starves_when_the_worker_runs_slower_than_measured():
    """The worker takes 1.5x the measured time for 10 s, and 5 ms a step that its measured rate leaves
    out: admitted prompts go past due (the rates were wrong); they run first, earliest due first, and
    let others pack beside them. Every admitted prompt is served (`overload` checks it), the lateness
    ends a few seconds after the slowdown, and the steps stay packed: 252 of them. (When a past-due prompt's
    slack of 0 kept everything due after it out of its steps: 1,291 steps, 1,276 late prompts, up to
    1.59 s, and 267 short ones refused.)"""
    refused, due, first, steps = overload("expected", slow=1.5, slow_until=10.0, overhead=0.005)
    late = {name: first[name] - due[name] for name in due if first[name] > due[name] + 1e-9}
    assert (refused, len(due), len(late), steps) == ({32: 57, 1500: 12}, 1606, 570, 252)
    assert max(due[name] for name in late) < 17.0  # arrived by 15 s: the backlog is gone 5 s after the slowdown
    assert max(late.values()) < 1.15
