"""The prefill queue: which pieces of which waiting prompts run in the next step.

A step is one packed token buffer: several prompts' segments laid end to end (ragged, no padding to
the longest), at most `max_batch_tokens` tokens (vLLM's --max-num-batched-tokens) and
`max_batch_size` segments. A prompt longer than `max_chunk` tokens, or longer than what is left of
the budget, runs as several segments (chunked prefill) over consecutive steps; each later segment
reads the KV of the ones before it as context.

Life cycle of a prompt here:
1. `add` queues it with a priority key fixed at arrival and, when the coordinator admitted it under a
   TTFT budget, the time its first token is due. Its `computed` tokens (a cached prefix) are not run
   again: its first segment starts there.
2. `next_step` takes the past-due prompts first (below), then walks the queue in key order, and gives
   each prompt one segment: the rest of the prompt, or as much of it as `max_chunk` and the budget
   allow (a whole number of its blocks, so the KV it ships and caches starts on a block boundary); the
   budget is the largest compiled shape's that holds the step's context (`token_room`), so a worker
   still compiling runs only what it has compiled (shapes.py `CompiledShapes`). It
   stops at the first prompt that gets nothing. It skips a prompt whose segment would make a prompt
   due earlier miss its due time (below), and (`max_adapters`, --max-loras) a prompt of a LoRA adapter once
   the step holds that many others: it waits a step, as on the decode tier.
3. `finish` takes the step back once it ran: each unfinished prompt returns to the queue with its
   key; until it ends, its remaining tokens count as queued work.

Orders (`PrefillOrder`):
- fifo: by arrival.
- shortest-first: shortest work first, with ageing, so nothing starves. The key is
  `arrival + tokens / ageing_tokens_per_s`: a prompt runs no later than every prompt that arrives
  more than `tokens / ageing_tokens_per_s` seconds after it, so a long one waits at most that long
  for later short ones. A long prompt under way keeps its key: short prompts that arrive meanwhile
  take the front of the next step, and the long prompt's next chunk fills what they leave, so a short
  prompt waits for at most one step, never for a whole long prompt.

Due times (issue 19's bound: no admitted prompt waits longer than its TTFT budget). Take the prompts
that have a due time, earliest first; the slack of the k-th is its due time less now less the expected
prefill time (`seconds`, the worker's measured rates) of it and of every prompt due before it: the
time the worker may spend on anything else and still give each of them its first token in time. A
segment of a prompt due later than the k-th (or of one with no due time) spends the k-th's slack; the
step takes it only while every such slack stays >= 0 (one at 0 allows nothing). So the order above
runs as long as the due times allow it; once a prompt's slack is used up, only it and the prompts due
before it get into steps (one due later than another only while the earlier one's slack allows it),
and later short arrivals cannot push it past its due time. The prompts of one step all finish when it
ends: the slack counts that (a segment spends the slack of every prompt due before it, in the same
step or not).

Past due: a prompt that misses its due time even if it runs alone from now on (the rates were
measured wrong: the machine slowed) can be helped by nothing but running it. Such prompts go first
in every step, earliest due first, and their work counts before every other prompt's slack; they
spend no slack and protect none, so the rest of the budget packs as usual beside them instead of
staying empty. They are served in due order, and every prompt that is not past due is served in key
order within the slack: nothing starves.

Admission: `expected_wait` replays this queue (a copy of it, the running step's rest first) with one
more prompt of a given length, due after every queued one (as one admitted now under the same
budget), until its last segment: the seconds of other work the policy runs before its first token,
at the measured rates, with no later arrivals; under shortest-first stretched by the share of the
worker that shorter prompts took lately (they will run before it too, while its slack lasts), so a
long prompt is admitted only with room left for them. The worker reports it per length bucket; the
coordinator (coordinator/prefill_estimate.py) admits a prompt only when that plus its own prefill
fits in what is left of its budget. Later arrivals cannot push it past its due time (the slack
above), so with the measured rates right its first token comes in time, give or take the step it
lands in. What can still push one past: a rate measured wrong, and a later arrival due earlier (a
client deadline shorter than the budget).
"""

from __future__ import annotations

import itertools
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Literal, Protocol, TypeVar

PrefillOrder = Literal["fifo", "shortest-first"]
PREFILL_ORDERS: tuple[PrefillOrder, ...] = ("fifo", "shortest-first")

ARRIVALS_WINDOW = 10.0
"""Seconds of arrivals `expected_wait` measures the shorter prompts' share of the worker's time over."""
MAX_OVERTAKING_SHARE = 0.9
"""The share above which `expected_wait` stops growing (10x): shorter prompts arriving that fast leave a
longer one nothing but its slack, and the estimate refuses it anyway."""


class Schedulable(Protocol):
    @property
    def num_tokens(self) -> int: ...

    computed: int
    """Leading tokens whose KV exists already (a cached prefix, finished segments)."""
    block_size: int
    """Segments other than a prompt's last cover whole blocks of this size."""

    def cancelled(self) -> bool: ...


J = TypeVar("J", bound=Schedulable)


@dataclass(frozen=True)
class Segment(Generic[J]):
    """Tokens [start, start + length) of job's prompt, run in one step; [0, start) are its context."""

    job: J
    start: int
    length: int

    @property
    def end(self) -> int:
        return self.start + self.length

    @property
    def last(self) -> bool:
        """The prompt's last segment: its first token is sampled from this step."""
        return self.end == self.job.num_tokens


def aligned(n: int, align: int) -> int:
    return -(-n // align) * align


def packed_tokens(segments: list[Segment]) -> int:
    """The token buffer a step needs: each segment starts on a block boundary (the largest block size
    among them), so the wire format's per-block scales can be computed over the whole buffer."""
    align = max((s.job.block_size for s in segments), default=1)
    return sum(aligned(s.length, align) for s in segments)


@dataclass(eq=False)
class _Entry(Generic[J]):
    """A queued prompt; the queue runs in (key, seq) order (`_queue_order`)."""
    key: float
    seq: int
    job: J
    bucket: int
    due: float | None = None
    """When its first token is due (the scheduler's clock); None: never."""

    @property
    def remaining(self) -> int:
        return self.job.num_tokens - self.job.computed


def _queue_order(entry: _Entry) -> tuple[float, int]:
    return entry.key, entry.seq


def _no_rate(bucket: int, tokens: int) -> float:
    return 0.0


@dataclass(eq=False)
class _Shadow:
    """A queued prompt's copy in `expected_wait`'s replay."""

    num_tokens: int
    computed: int
    block_size: int

    def cancelled(self) -> bool:
        return False


class _Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class PrefillScheduler(Generic[J]):
    def __init__(
        self,
        order: PrefillOrder,
        *,
        bucket: Callable[[int], int],
        max_batch_size: int,
        max_batch_tokens: int,
        max_chunk: int | None = None,
        max_context: int | None = None,
        ageing_tokens_per_s: float = 32.0,
        seconds: Callable[[int, int], float] = _no_rate,
        clock: Callable[[], float] = time.monotonic,
        token_room: Callable[[int], int] | None = None,
        max_adapters: int | None = None,
    ):
        """bucket(n): the length bucket an n-token prompt's queued work is reported under.
        max_chunk: most tokens of one prompt in a step (default the budget). max_context: most context
        tokens (earlier segments' KV) one step reads, all its prompts together (default unbounded).
        seconds(bucket, n): expected seconds to prefill n tokens of a prompt in that bucket (the
        worker's measured rates, rates.py); by default (and while nothing is measured) 0: due times
        change nothing. token_room(context): the most token slots a step reading `context` tokens of
        earlier KV may pack (the shapes compiled so far, shapes.py `CompiledShapes.room`; default: the
        budget): a prompt is cut into chunks that fit, one whose context fits no compiled shape waits.
        max_adapters: most distinct LoRA adapters (a job's `adapter_key`, None for the base model) in one step
        (--max-loras; None: jobs name none)."""
        if order not in PREFILL_ORDERS:
            raise ValueError(f"--prefill-order must be one of {', '.join(PREFILL_ORDERS)}, not {order!r}")
        if not ageing_tokens_per_s > 0:
            raise ValueError(f"--prefill-ageing must be > 0 tokens/s, got {ageing_tokens_per_s}")
        self.order = order
        self.bucket = bucket
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.max_chunk = min(max_chunk or max_batch_tokens, max_batch_tokens)
        self.max_context = max_context
        self.ageing_tokens_per_s = ageing_tokens_per_s
        self.seconds = seconds
        self.clock = clock
        self.token_room = token_room
        self.max_adapters = max_adapters
        self._waiting: list[_Entry[J]] = []
        self._seq = itertools.count()
        self._running: list[_Entry[J]] = []
        self._step: list[Segment[J]] = []
        """The running step (the last `next_step`, until `finish`)."""
        self._step_ends = 0.0
        """When the running step is expected to end (the scheduler's clock, at the measured rates)."""
        self.queued_by_bucket: Counter[int] = Counter()
        """Tokens still to compute of the prompts waiting or running, by length bucket."""
        self.prompts_by_bucket: Counter[int] = Counter()
        self._arrivals: deque[tuple[float, int, float]] = deque()
        """(when, bucket, seconds of prefill) of the prompts added in the last ARRIVALS_WINDOW seconds."""

    @property
    def queued_tokens(self) -> int:
        return sum(self.queued_by_bucket.values())

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, job: J, due: float | None = None) -> None:
        """due: when the prompt's first token is due, on the scheduler's clock (its arrival at the
        coordinator plus the TTFT budget it was admitted under); None: never."""
        now = self.clock()
        key = now if self.order == "fifo" else now + job.num_tokens / self.ageing_tokens_per_s
        entry = _Entry(key, next(self._seq), job, self.bucket(job.num_tokens), due)
        self._queue(entry)
        self._forget_arrivals(now)
        self._arrivals.append((now, entry.bucket, self.seconds(entry.bucket, entry.remaining)))

    def _queue(self, entry: _Entry[J]) -> None:
        self._waiting.append(entry)
        self.queued_by_bucket[entry.bucket] += entry.remaining
        self.prompts_by_bucket[entry.bucket] += 1

    def next_step(self) -> list[Segment[J]]:
        """The segments of the next step: the past-due prompts' first, earliest due first, then the
        others in queue order within the due prompts' slack (empty: nothing waits)."""
        for entry in [e for e in self._waiting if e.job.cancelled()]:
            self._waiting.remove(entry)
            self._forget(entry, entry.remaining)
        now = self.clock()
        late = sorted((e for e in self._waiting if self._past_due(e, now)), key=lambda e: (e.due, e.seq))
        late_ids = {id(e) for e in late}
        due = sorted((e for e in self._waiting if e.due is not None and id(e) not in late_ids),
                     key=lambda e: (e.due, e.seq))
        rank = {id(e): k for k, e in enumerate(due)}
        slack = self._slack(due, now, ahead=sum(self.seconds(e.bucket, e.remaining) for e in late))
        step: list[Segment[J]] = []
        taken: list[_Entry[J]] = []
        context = 0
        adapters: set = set()
        for entry in [*late, *sorted((e for e in self._waiting if id(e) not in late_ids), key=_queue_order)]:
            if len(step) == self.max_batch_size:
                break
            job = entry.job
            adapter = getattr(job, "adapter_key", None)
            if adapter is not None and adapter not in adapters and len(adapters) == self.max_adapters:
                continue  # the step's adapter slots are taken: it waits a step
            segment = self._segment(step, job, context + job.computed)
            if segment is None or (step and self.max_context is not None
                                   and context + job.computed > self.max_context):
                break
            # The slack it spends: of the prompts due before it (a past-due one's work counts in all already).
            before = 0 if id(entry) in late_ids else rank.get(id(entry), len(due))
            cost = self.seconds(entry.bucket, segment.length)
            if before and cost > min(slack[:before]):
                continue  # a prompt due earlier would miss its due time
            for k in range(before):
                slack[k] -= cost
            step.append(segment)
            taken.append(entry)
            context += job.computed
            if adapter is not None:
                adapters.add(adapter)
        taken_ids = {id(e) for e in taken}
        self._waiting = [e for e in self._waiting if id(e) not in taken_ids]
        self._running.extend(taken)
        self._step = step
        self._step_ends = now + sum(self.seconds(self.bucket(s.job.num_tokens), s.length) for s in step)
        return step

    def _past_due(self, entry: _Entry[J], now: float) -> bool:
        """It misses its due time even if it runs alone from now on."""
        return entry.due is not None and entry.due - now - self.seconds(entry.bucket, entry.remaining) < 0

    def _slack(self, due: list[_Entry[J]], now: float, ahead: float) -> list[float]:
        """Per prompt, earliest due first: its due time less now less the expected prefill time of the
        past-due prompts (`ahead`: they run first), of it and of every prompt due before it (0 when that
        is negative: a prompt due before it, or it, cannot make its due time; nothing may delay them)."""
        work, slack = ahead, []
        for entry in due:
            work += self.seconds(entry.bucket, entry.remaining)
            slack.append(max(entry.due - now - work, 0.0))
        return slack

    def expected_wait(self, num_tokens: int, block_size: int = 16) -> float:
        """Seconds of other work before the first token of an n-token prompt that arrives now due after
        every queued prompt (as one the coordinator admits now under the same TTFT budget), at the
        measured rates (`seconds`): the running step's rest, then the steps `next_step` would take
        until the prompt's last segment ends, replayed on a copy of this queue, so the estimate follows
        the order and the due times exactly. Its own prefill is not counted. Under shortest-first,
        shorter prompts arriving later run before it too (while its slack lasts): the wait W and its
        own prefill P stretch by the share s of the worker's time such prompts took over the last
        ARRIVALS_WINDOW seconds, to (W + P) / (1 - s) - P (at most MAX_OVERTAKING_SHARE), so a long
        prompt is admitted only with room left for them."""
        now = self.clock()
        bucket = self.bucket(num_tokens)
        waited = self._replay(num_tokens, block_size, now)
        if self.order == "fifo":
            return waited
        share = min(self._overtaking_share(bucket, now), MAX_OVERTAKING_SHARE)
        own = self.seconds(bucket, num_tokens)
        return (waited + own) / (1 - share) - own if share else waited

    def _overtaking_share(self, bucket: int, now: float) -> float:
        """The share of the worker's time the prompts shorter than `bucket` that arrived in the last
        ARRIVALS_WINDOW seconds take (their prefill at the measured rates)."""
        self._forget_arrivals(now)
        return sum(seconds for _, b, seconds in self._arrivals if b < bucket) / ARRIVALS_WINDOW

    def _forget_arrivals(self, now: float) -> None:
        while self._arrivals and self._arrivals[0][0] < now - ARRIVALS_WINDOW:
            self._arrivals.popleft()

    def _replay(self, num_tokens: int, block_size: int, now: float) -> float:
        """Seconds of other work `next_step` runs, on a copy of this queue, before the last segment of
        an n-token prompt added now with no due time ends (no later arrivals)."""
        clock = _Clock(now)
        shadow: PrefillScheduler[_Shadow] = PrefillScheduler(
            self.order, bucket=self.bucket, max_batch_size=self.max_batch_size,
            max_batch_tokens=self.max_batch_tokens, max_chunk=self.max_chunk, max_context=self.max_context,
            ageing_tokens_per_s=self.ageing_tokens_per_s, seconds=self.seconds, clock=clock,
            token_room=self.token_room)
        running = {id(s.job): s.end for s in self._step}  # where the running step leaves its prompts
        queued = [*self._running, *self._waiting]
        for entry in queued:
            computed = running.get(id(entry.job), entry.job.computed)
            if computed < entry.job.num_tokens:
                copy = _Shadow(entry.job.num_tokens, computed, entry.job.block_size)
                shadow._queue(_Entry(entry.key, entry.seq, copy, entry.bucket, entry.due))
        probe = _Shadow(num_tokens, 0, block_size)
        shadow._seq = itertools.count(max((e.seq for e in queued), default=-1) + 1)  # after them, as an arrival now
        shadow.add(probe)
        waited = max(self._step_ends - now, 0.0) if self._running else 0.0  # the running step's rest
        clock.now = now + waited
        while True:
            step = shadow.next_step()
            for s in step:
                cost = self.seconds(self.bucket(s.job.num_tokens), s.length)
                clock.now += cost
                waited += 0.0 if s.job is probe else cost
                s.job.computed = s.end
            shadow.finish(step)
            if probe.computed == num_tokens or not step:
                return waited

    def _segment(self, step: list[Segment[J]], job: J, context: int) -> Segment[J] | None:
        """job's segment if it joins `step`, which then reads `context` tokens of earlier KV: as much of its
        rest as the chunk and the budget (of a compiled shape that holds that context) allow."""
        remaining = job.num_tokens - job.computed
        align = max([job.block_size, *(s.job.block_size for s in step)])  # block sizes are powers of two
        budget = self.max_batch_tokens
        if self.token_room is not None:
            budget = min(budget, self.token_room(context))
        room = budget - sum(aligned(s.length, align) for s in step)
        n = min(remaining, max(self.max_chunk // job.block_size, 1) * job.block_size)
        if aligned(n, align) > room:
            n = room // align * align  # whole blocks: this is not the prompt's last segment
        return Segment(job, job.computed, n) if n > 0 else None

    def finish(self, step: list[Segment[J]]) -> None:
        """The step ran (the engine advanced each job's `computed`), or failed (it did not, and the
        engine fails the jobs): unfinished, uncancelled prompts queue again under their key."""
        self._step = []
        for segment in step:
            entry = next(e for e in self._running if e.job is segment.job)
            self._running.remove(entry)
            job = segment.job
            done = job.computed >= segment.end
            if done:
                self.queued_by_bucket[entry.bucket] -= segment.length
            if done and not segment.last and not job.cancelled():
                self._waiting.append(entry)
            else:
                self._forget(entry, job.num_tokens - job.computed)

    def _forget(self, entry: _Entry[J], remaining: int) -> None:
        self.queued_by_bucket[entry.bucket] -= remaining
        self.prompts_by_bucket[entry.bucket] -= 1
        if not self.prompts_by_bucket[entry.bucket]:
            del self.queued_by_bucket[entry.bucket], self.prompts_by_bucket[entry.bucket]
