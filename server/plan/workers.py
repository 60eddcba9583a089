"""Simulated workers: the real schedulers on the virtual clock, each step's time from a tier profile.

- `PrefillWorker`: server/prefill/scheduler.py `PrefillScheduler` (packing, chunking, fifo or
  shortest-first, TTFT-budget due times) with server/prefill/rates.py `PrefillRates` measured from the
  simulated steps, as `PrefillEngine._loop` does: next_step, run (the profile's step time), finish; and
  the host prefix KV of server/prefill/prefix_kv.py `PrefixKv` (a prompt starts after its cached prefix).
- `DecodeWorker`: server/decode/scheduler.py `Scheduler` (FIFO admission by blocks, blocks on demand,
  preemption, prefix caching over kvcache/block_pool.py and prefix_cache.py) over real
  server/decode/sequence.py `Sequence`s, as `DecodeEngine._loop` does: admit, schedule, step, postprocess
  (the real stop rule: `Sequence.append`).
- `ColocatedWorker`: both schedulers on one device; each step runs the prefill scheduler's next step and
  the decode batch together (chunked prefill beside decode, vLLM's colocated mode), costing the sum.

Every worker runs one step at a time; the next starts when the last ends and there is work. A step's
seconds are the profile's divided by the share of its cores the worker gets then (contention.py: 1 where
each worker owns its device). In a disaggregated cluster each request's own CPU on a worker (its KV sent
or received, its RPCs: the profile's `request_seconds`) is spent between steps, so it lengthens the
worker's next step. A prefill step after the worker sat idle the profile's `cold_after_s` is cold (profile.py:
longer by its `cold_factors` factor, as many times fewer cores, the same CPU).
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Literal

import numpy as np
from pdserve.server.plan.clock import VirtualClock
from pdserve.server.plan.contention import Contention, HostCpu, Stepping
from pdserve.server.plan.profile import Profile
from pdserve.server.decode.config import DecodeConfig
from pdserve.server.decode.scheduler import Scheduler
from pdserve.server.decode.sequence import SeqState, Sequence
from pdserve.server.prefill.config import PrefillConfig
from pdserve.server.prefill.prefix_kv import BLOCK_SIZE, PrefixKv
from pdserve.server.prefill.rates import PrefillRates
from pdserve.server.prefill.scheduler import (
    PREFILL_ORDERS,
    PrefillOrder,
    PrefillScheduler,
    Segment,
    packed_tokens,
)
from pdserve.server.prefill.shapes import bucket_length, padded, pow2, token_buckets
from pdserve.v1 import generation_pb2 as gen_pb

WorkerKind = Literal["prefill", "decode", "colocated"]


def _default(config: type, name: str):
    """A config dataclass field's default: the simulated workers take the served tiers' own."""
    return next(f.default for f in fields(config) if f.name == name)


@dataclass(frozen=True)
class PrefillSpec:
    """A prefill worker's scheduling flags (server/prefill/config.py's defaults)."""

    max_batch_size: int = _default(PrefillConfig, "max_batch_size")
    max_batch_tokens: int = _default(PrefillConfig, "max_batch_tokens")
    max_chunk: int | None = _default(PrefillConfig, "max_prefill_chunk")
    order: PrefillOrder = _default(PrefillConfig, "prefill_order")
    ageing_tokens_per_s: float = _default(PrefillConfig, "prefill_ageing")
    min_bucket: int = _default(PrefillConfig, "min_bucket")
    max_model_len: int = 2048
    """The served worker's is the model's; the simulated model's is given here."""
    prefix_cache_bytes: int = _default(PrefillConfig, "prefix_cache_bytes")
    """--prefix-cache-bytes: the host prefix KV (prefix_kv.py) the worker keeps; 0: none."""

    def __post_init__(self) -> None:
        if self.prefix_cache_bytes < 0:
            raise ValueError(f"prefix_cache_bytes must be >= 0, got {self.prefix_cache_bytes}")
        if self.order not in PREFILL_ORDERS:
            raise ValueError(f"prefill order must be one of {', '.join(PREFILL_ORDERS)}, not {self.order!r}")
        for name in ("max_batch_size", "max_batch_tokens", "min_bucket", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class DecodeSpec:
    """A decode worker's scheduling flags (server/decode/config.py's defaults); the cache size is the
    profile's `kv_cache_tokens` unless given here."""

    block_size: int = _default(DecodeConfig, "block_size")
    max_running: int = _default(DecodeConfig, "max_running")
    max_queue: int = _default(DecodeConfig, "max_queue")
    enable_prefix_caching: bool = _default(DecodeConfig, "enable_prefix_caching")
    kv_cache_tokens: int | None = None
    max_model_len: int = 2048

    def __post_init__(self) -> None:
        for name in ("block_size", "max_running", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")


@dataclass(eq=False)
class SimPrefillJob:
    """A prompt on a prefill worker (the scheduler's `Schedulable`)."""

    num_tokens: int
    block_size: int
    owner: object
    computed: int = 0
    token_ids: tuple[int, ...] = ()

    def cancelled(self) -> bool:
        return False


class _Sink:
    def put_nowait(self, ids: list[int] | None, /) -> None:
        pass


def new_sequence(request_id: str, prompt: tuple[int, ...], output_len: int, max_model_len: int) -> Sequence:
    sampling = gen_pb.SamplingParams(max_tokens=output_len, ignore_eos=True)
    return Sequence(request_id, list(prompt), sampling, frozenset(), max_model_len, admitted=None, events=_Sink())


MAX_PREFIX_BLOCKS = 1 << 20
"""The simulated host prefix KV holds at most this many blocks (16M tokens; a profile without KV bytes:
none)."""

OUTPUT_TOKEN = 1
"""The id every simulated output token gets (only its count and its blocks matter)."""


@dataclass
class Busy:
    seconds: float = 0.0
    steps: int = 0


class _Stepper(abc.ABC):
    """One step at a time on the clock: `_take` picks the next step's work and its seconds (None: idle),
    `_complete` applies it when it ends; the step lasts its seconds over the worker's share of the host."""

    role: WorkerKind

    def __init__(self, name: str, clock: VirtualClock, profile: Profile, host: Contention | None = None) -> None:
        self.name = name
        self.clock = clock
        self.profile = profile
        self.host = host or Contention(HostCpu())
        self.running = False
        self.busy = Busy()

    def kick(self) -> None:
        if self.running:
            return
        taken = self._take()
        if taken is None:
            return
        work, seconds = taken
        self.running = True
        self.busy.steps += 1
        start = self.clock.now
        step = None

        def schedule(at: float, generation: int) -> None:
            self.clock.at(at, lambda: step.generation == generation and self._end(work, step, start))

        step = Stepping(self.name, self.host.threads(self.role) / self._slower, seconds, start, schedule)
        self.host.begin(step, start)

    _slower = 1.0
    """How much longer this step lasts than the profile's, its CPU the same: the cores it keeps busy divide by it
    (a cold prefill step: `PrefillCost.cold_factor`)."""

    def _end(self, work, step: Stepping, start: float) -> None:
        self.busy.seconds += self.clock.now - start
        self.host.end(step, self.clock.now)
        self._complete(work)  # still running: a kick from a callback inside waits for the kick below
        self.running = False
        self.kick()

    @abc.abstractmethod
    def _take(self):
        """(work, seconds) of the next step, or None when idle."""

    @abc.abstractmethod
    def _complete(self, work) -> None:
        """Applies a step's work once it ends."""


class PrefillPart:
    """The prefill side of a worker: its scheduler and measured rates."""

    def __init__(self, spec: PrefillSpec, clock: VirtualClock, profile: Profile,
                 on_first_token: Callable[[SimPrefillJob], None], handoff: bool = True) -> None:
        self.spec = spec
        self.profile = profile
        self.handoff = handoff
        """Its prompts' KV goes to another worker: each costs the profile's per-request CPU."""
        self.pending_s = 0.0
        """Per-request CPU spent since the last step began: the next step carries it."""
        self.on_first_token = on_first_token
        self.max_len = pow2(spec.max_model_len)
        self.token_buckets = token_buckets(spec.max_batch_tokens, spec.max_batch_size, self.max_len, spec.min_bucket)
        self.rates = PrefillRates(sorted({self.bucket(1 << i) for i in range(self.max_len.bit_length())}))
        self.scheduler: PrefillScheduler[SimPrefillJob] = PrefillScheduler(
            spec.order, bucket=self.bucket, max_batch_size=spec.max_batch_size,
            max_batch_tokens=spec.max_batch_tokens, max_chunk=spec.max_chunk, max_context=self.max_len,
            ageing_tokens_per_s=spec.ageing_tokens_per_s, seconds=self.rates.seconds, clock=clock)
        self.computed_tokens = 0
        # The real PrefixKv (its lookup and store, over the real PrefixCache), on one-byte stand-in blocks:
        # as many blocks as the byte budget holds of this model's KV, none of its bytes.
        kv = profile.handoff.kv_bytes_per_token
        blocks = min(spec.prefix_cache_bytes // (BLOCK_SIZE * kv), MAX_PREFIX_BLOCKS) if kv else 0
        self.prefix = PrefixKv(num_layers=1, num_kv_heads=1, head_dim=1, dtype=np.int8,
                               budget_bytes=blocks * 2 * BLOCK_SIZE)

    def lookup(self, job: SimPrefillJob) -> None:
        """A new prompt's cached prefix: its first segment starts after it (PrefillEngine.enqueue)."""
        hit = self.prefix.lookup(list(job.token_ids), multiple_of=job.block_size)
        if hit is not None:
            job.computed = hit[0].shape[1]

    def store(self, job: SimPrefillJob) -> None:
        if self.prefix.enabled:
            n = len(job.token_ids)
            self.prefix.store(list(job.token_ids), np.zeros((1, n, 1, 1), np.int8), np.zeros((1, n, 1, 1), np.int8))

    def bucket(self, n: int) -> int:
        return bucket_length(min(n, self.max_len), self.max_len, self.spec.min_bucket)

    def take(self, idle_s: float = 0.0) -> tuple[list[Segment[SimPrefillJob]], float, float] | None:
        """The next step, its seconds on cores of its own (the per-request CPU it carries included) and how many
        times longer than the profile's step that is for the same CPU (a cold step after `idle_s` of idle:
        `PrefillCost.cold_factor`; the carried CPU is not slower)."""
        step = self.scheduler.next_step()
        if not step:
            return None
        packed = packed_tokens(step)
        padded_tokens = padded(self.token_buckets, packed)
        compute = self.profile.prefill.step_seconds(padded_tokens, sum(s.length * (s.start + s.length) for s in step))
        extra, self.pending_s = self.pending_s, 0.0
        seconds = compute * self.profile.prefill.cold_factor(padded_tokens, idle_s) + extra
        return step, seconds, seconds / (compute + extra) if compute + extra > 0 else 1.0

    def complete(self, step: list[Segment[SimPrefillJob]], seconds: float) -> None:
        for s in step:
            s.job.computed = s.end
        tokens = sum(s.length for s in step)
        self.computed_tokens += tokens
        self.rates.record(self.bucket(max(s.job.num_tokens for s in step)), tokens, seconds)
        self.scheduler.finish(step)
        for s in step:
            if s.last:
                self.store(s.job)
                if self.handoff:
                    self.pending_s += self.profile.prefill.request_seconds(s.job.num_tokens)
                self.on_first_token(s.job)


class DecodePart:
    """The decode side of a worker: its scheduler over real Sequences."""

    def __init__(self, spec: DecodeSpec, profile: Profile, on_admitted: Callable[[Sequence], None],
                 on_token: Callable[[Sequence], None], on_finished: Callable[[Sequence], None],
                 handoff: bool = True) -> None:
        self.spec = spec
        self.profile = profile
        self.handoff = handoff
        """Its sequences' KV comes from a prefill worker: each costs the profile's per-request CPU."""
        self.pending_s = 0.0
        """Per-request CPU spent since the last step began: the next step carries it."""
        tokens = spec.kv_cache_tokens or profile.kv_cache_tokens
        self.scheduler = Scheduler(max(tokens // spec.block_size, 1), spec.block_size, spec.max_running,
                                   spec.max_queue, spec.enable_prefix_caching)
        self.on_admitted = on_admitted
        self.on_token = on_token
        self.on_finished = on_finished

    def add(self, seq: Sequence) -> None:
        """Raises QueueFull as the engine's `add` does."""
        self._admitted(self.scheduler.add(seq))

    def admit(self) -> None:
        self._admitted(self.scheduler.admit())

    def _admitted(self, seqs: list[Sequence]) -> None:
        """First admissions wait for their KV; a preempted sequence readmitted just runs on."""
        for seq in seqs:
            self.scheduler.tail_copied(seq)  # the engine copies a kept tail's KV here; nothing to copy in a model
            if seq.state is SeqState.WAITING_KV:
                self.on_admitted(seq)

    def start(self, seq: Sequence) -> None:
        """The KV is in place: the first token joins (DecodeEngine.start)."""
        if seq.state is not SeqState.WAITING_KV:
            return
        if self.handoff:
            self.pending_s += self.profile.decode.request_seconds(len(seq.prompt_ids))
        self.scheduler.start(seq)
        seq.append(OUTPUT_TOKEN)
        if seq.state is SeqState.FINISHED:
            self.retire(seq)

    def retire(self, seq: Sequence) -> None:
        self.scheduler.retire(seq)
        self.on_finished(seq)
        self.admit()

    def take(self) -> tuple[list[Sequence], float] | None:
        self.admit()
        batch = self.scheduler.schedule()
        if not batch:
            return None
        resumed = sum(s.num_tokens - 1 - s.resume_from for s in batch
                      if s.resume_from is not None and s.resume_from < s.num_tokens - 1)
        context = sum(s.num_tokens for s in batch)
        extra, self.pending_s = self.pending_s, 0.0
        return batch, self.profile.decode.step_seconds(len(batch), context, resumed) + extra

    def complete(self, batch: list[Sequence]) -> None:
        for seq in batch:
            if seq.state is not SeqState.RUNNING:
                continue  # preempted by a later sequence's block in the same schedule
            self.scheduler.finished_step(seq)
            seq.append(OUTPUT_TOKEN)
            self.on_token(seq)
            if seq.state is SeqState.FINISHED:
                self.retire(seq)


class PrefillWorker(_Stepper):
    role: WorkerKind = "prefill"

    def __init__(self, name: str, clock: VirtualClock, profile: Profile, spec: PrefillSpec,
                 on_first_token: Callable[[SimPrefillJob], None], host: Contention | None = None) -> None:
        super().__init__(name, clock, profile, host)
        self.prefill = PrefillPart(spec, clock, profile, on_first_token)

    last_end = -math.inf

    def _take(self):
        taken = self.prefill.take(self.clock.now - self.last_end)
        if taken is None:
            return None
        step, seconds, self._slower = taken
        return (step, seconds), seconds

    def _complete(self, work) -> None:
        self.last_end = self.clock.now
        self.prefill.complete(*work)


class DecodeWorker(_Stepper):
    role: WorkerKind = "decode"

    def __init__(self, name: str, clock: VirtualClock, profile: Profile, spec: DecodeSpec,
                 on_admitted, on_token, on_finished, host: Contention | None = None) -> None:
        super().__init__(name, clock, profile, host)
        self.decode = DecodePart(spec, profile, on_admitted, on_token, on_finished)

    def _take(self):
        return self.decode.take()

    def _complete(self, work) -> None:
        self.decode.complete(work)


class ColocatedWorker(_Stepper):
    role: WorkerKind = "colocated"

    def __init__(self, name: str, clock: VirtualClock, profile: Profile, prefill_spec: PrefillSpec,
                 decode_spec: DecodeSpec, on_first_token, on_admitted, on_token, on_finished,
                 host: Contention | None = None) -> None:
        super().__init__(name, clock, profile, host)
        self.prefill = PrefillPart(prefill_spec, clock, profile, on_first_token, handoff=False)
        self.decode = DecodePart(decode_spec, profile, on_admitted, on_token, on_finished, handoff=False)

    def _take(self):
        decoding = self.decode.take()  # the batch first: a sequence whose prefill ends now joins the next step
        prefilling = self.prefill.take()
        if decoding is None and prefilling is None:
            return None
        seconds = (decoding[1] if decoding else 0.0) + (prefilling[1] if prefilling else 0.0)
        return (decoding, prefilling), seconds

    def _complete(self, work) -> None:
        decoding, prefilling = work
        if decoding is not None:
            self.decode.complete(decoding[0])
        if prefilling is not None:
            self.prefill.complete(*prefilling[:2])

