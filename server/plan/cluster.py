"""A simulated cluster: the coordinator's routing and admission over simulated workers, on a virtual clock.

What runs is the project's own code: the coordinator's `Router` (server/coordinator/router.py: the
decode and prefill pickers of policies.py, what it holds on each worker between load reports) over a
real `WorkerPool` of real `Worker`s whose load reports (`WorkerInfo`, every `refresh_seconds`) are built
from the simulated schedulers as the workers build them; the expected-wait admission of
prefill_estimate.py (`admit`, on a `Deadline` read from the virtual clock); and the workers of
workers.py around the tiers' schedulers. One request's life, as coordinator/attempt.py runs it:
1. Reserve: the decode tier's line (admission.py `TierQueue`'s rule: bounded, arrival order, only its
   head picks, a newcomer picks at once only when nobody waits), `Router.pick_decode`, `hold_decode`.
2. Prefill pick (`pick_prefill`, its own line) and `admit` (RESOURCE_EXHAUSTED when the expected wait
   exceeds the TTFT budget); then D's `add` (its scheduler admits by blocks, or queues it).
3. Once D holds the prompt's blocks: the prompt joins P's scheduler, due at arrival + its TTFT budget.
4. P's last segment ends: the first token (client time + the profile's `ttft_overhead_s`); the KV is
   on D after the handoff's seconds; D's scheduler starts the sequence; each decode step gives a token.
5. The last token: D retires it, the coordinator releases D, the lines' heads pick again.
Colocated: no prefill tier; each worker prefills the prompts it holds blocks for (workers.py).
On a shared host (`ClusterSpec.host`, contention.py) every arrival and token is the front's CPU, and each
worker's steps take the share of the cores left to it.

Not simulated (named in README.md): retries and migrations, deadlines of requests already admitted, RPC time other than `ttft_overhead_s`.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.server.plan.run_summary import RequestOutput
from pdserve.server.plan.run_summary import summarize
from pdserve.server.plan.clock import VirtualClock
from pdserve.server.plan.contention import Contention, HostCpu
from pdserve.server.plan.profile import HandoffCost, Profile
from pdserve.server.plan.workers import (
    ColocatedWorker,
    DecodeSpec,
    DecodeWorker,
    PrefillSpec,
    PrefillWorker,
    SimPrefillJob,
    new_sequence,
)
from pdserve.server.plan.workload import SimRequest
from pdserve.server.choices import DecodePolicy, PrefillPolicy
from pdserve.server.coordinator.admission import Deadline, RequestFailed
from pdserve.server.coordinator.prefill_estimate import admit, ttft_budget_of
from pdserve.server.coordinator.router import Router
from pdserve.server.coordinator.worker_pool import Worker, WorkerPool
from pdserve.server.decode.scheduler import QueueFull
from pdserve.server.decode.sequence import Sequence
from pdserve.v1 import worker_pb2 as pb


@dataclass(frozen=True)
class CoordinatorSpec:
    """The coordinator's flags that shape routing (server/coordinator/config.py's defaults)."""

    prefill_policy: PrefillPolicy = "least-queued"
    decode_policy: DecodePolicy = "prefix-aware"
    max_queue: int = 256
    ttft_budget: float = 0.0
    """--ttft-budget (0: none; the deadline's seconds count)."""
    timeout: float = 600.0
    refresh_seconds: float = 0.5
    prefill_inflight_per_worker: int = 64

    def __post_init__(self) -> None:
        if not self.timeout > 0:
            raise ValueError(f"timeout must be > 0 s, got {self.timeout}")
        if not self.refresh_seconds > 0:
            raise ValueError(f"refresh_seconds must be > 0, got {self.refresh_seconds}")
        if self.ttft_budget < 0:
            raise ValueError(f"ttft_budget must be >= 0 s, got {self.ttft_budget}")


@dataclass(frozen=True)
class ClusterSpec:
    prefill_workers: int = 1
    decode_workers: int = 1
    """Colocated: the number of colocated workers."""
    colocated: bool = False
    prefill: PrefillSpec = field(default_factory=PrefillSpec)
    decode: DecodeSpec = field(default_factory=DecodeSpec)
    coordinator: CoordinatorSpec = field(default_factory=CoordinatorSpec)
    host: HostCpu = field(default_factory=HostCpu)
    """The cores the processes share (contention.py); the default: each worker owns its device."""

    def __post_init__(self) -> None:
        if self.decode_workers < 1:
            raise ValueError(f"--decode-workers must be >= 1, got {self.decode_workers}")
        if self.prefill_workers < 0 or (self.colocated and self.prefill_workers):
            raise ValueError(f"--prefill-workers must be >= 0 (0 when colocated), got {self.prefill_workers}")
        if not self.colocated and self.prefill_workers < 1:
            raise ValueError("a disaggregated cluster needs --prefill-workers >= 1 (or --colocated)")


@dataclass(eq=False)
class VirtualDeadline(Deadline):
    clock: Callable[[], float] = field(default=lambda: 0.0)

    def remaining(self) -> float:
        return self.at - self.clock()


@dataclass(eq=False)
class Flight:
    """One request in the simulated cluster."""

    req: SimRequest
    out: RequestOutput
    rid: str
    deadline: VirtualDeadline
    seq: Sequence
    decode: Worker | None = None
    blocks: int = 0
    prefill: Worker | None = None
    prefilling: object = None
    """Router.prefilling's hold while the Prefill call runs."""


@dataclass
class SimResult:
    outputs: list[RequestOutput]
    duration: float
    kv_wire_bytes: int
    busy_seconds: dict[str, float]
    preemptions: int
    prefill_tokens: int
    kv_usage: float = 0.0
    """Mean KV-cache usage of the decode workers over the load reports."""

    def summary(self, slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None) -> dict:
        """`pdserve bench`'s summary keys (metrics.summarize), plus the simulator's own under "sim"."""
        s = summarize(self.outputs, slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms, duration=self.duration)
        d = self.duration or 1.0
        s["sim"] = {
            "kv_wire_bytes": self.kv_wire_bytes,
            "kv_wire_bytes_per_s": self.kv_wire_bytes / d,
            "utilisation": {name: busy / d for name, busy in self.busy_seconds.items()},
            "preemptions": self.preemptions,
            "prefill_computed_tokens": self.prefill_tokens,
            "kv_usage_mean": self.kv_usage,
        }
        return s


class SimCluster:
    def __init__(self, spec: ClusterSpec, prefill_profile: Profile, decode_profile: Profile,
                 handoff: HandoffCost | None = None) -> None:
        logging.getLogger("pdserve.coordinator").setLevel(logging.ERROR)
        self.spec = spec
        self.clock = VirtualClock()
        self.contention = Contention(spec.host)
        self.handoff = handoff or decode_profile.handoff
        self.decode_profile = decode_profile
        self.pool = WorkerPool(refresh_seconds=spec.coordinator.refresh_seconds)
        c = spec.coordinator
        self.router = Router(self.pool, prefill_policy=c.prefill_policy, decode_policy=c.decode_policy,
                             max_queue=c.max_queue, prefill_inflight_per_worker=c.prefill_inflight_per_worker)
        self.flights: dict[str, Flight] = {}
        self.sims: dict[str, PrefillWorker | DecodeWorker | ColocatedWorker] = {}
        """By pool address."""
        self.decode_line: deque[Flight] = deque()
        self.prefill_line: deque[Flight] = deque()
        self.kv_wire_bytes = 0
        self.kv_usage: list[float] = []
        """Each load report's KV usage of each decode worker (what the decode HPA reads)."""
        self.open = 0
        self.arrivals_left = 0
        for i in range(spec.prefill_workers):
            self._join(f"prefill-{i}", "prefill", PrefillWorker(
                f"prefill-{i}", self.clock, prefill_profile, spec.prefill, self._first_token, self.contention))
        for i in range(spec.decode_workers):
            name = f"{'colocated' if spec.colocated else 'decode'}-{i}"
            sim = (ColocatedWorker(name, self.clock, decode_profile, spec.prefill, spec.decode, self._first_token,
                                   self._admitted, self._token, self._finished, self.contention) if spec.colocated
                   else DecodeWorker(name, self.clock, decode_profile, spec.decode, self._admitted, self._token,
                                     self._finished, self.contention))
            self._join(name, "decode", sim)

    def _join(self, name: str, role: str, sim) -> None:
        worker = Worker(name, role, channel=object())  # type: ignore[arg-type]
        self.pool.add(worker)
        self.sims[name] = sim
        worker.reported(self._info(worker), 0.0)
        worker.set_ready(True)

    # ---- load reports ------------------------------------------------------------

    def _info(self, worker: Worker) -> pb.WorkerInfo:
        sim = self.sims[worker.address]
        if worker.role == "prefill":
            p = sim.prefill
            waits = {b: p.scheduler.expected_wait(b) for b in p.rates.buckets}
            load = pb.WorkerLoad(queued_prefill_tokens=p.scheduler.queued_tokens,
                                 prefill_buckets=p.rates.report(p.scheduler.queued_by_bucket,
                                                                p.scheduler.prompts_by_bucket, waits))
            return pb.WorkerInfo(role="prefill", address=worker.address, load=load,
                                 prefill_order=p.spec.order, prefill_deadlines=True)
        s = sim.decode.scheduler  # as DecodeEngine.load() reports it
        load = pb.WorkerLoad(running_requests=len(s.running), waiting_requests=len(s.loading) + len(s.waiting),
                             free_kv_blocks=s.num_free_blocks, total_kv_blocks=s.pool.num_total,
                             max_running_requests=s.max_running, max_waiting_requests=s.max_queue,
                             cached_kv_blocks=s.cache.num_cached)
        return pb.WorkerInfo(role="decode", address=worker.address, load=load,
                             kv_layout=pb.KvLayout(block_size=s.block_size))

    def _report(self) -> None:
        for worker in self.pool.workers.values():
            info = self._info(worker)
            worker.reported(info, self.clock.now)
            if worker.role == "decode":
                load = info.load
                self.kv_usage.append(1 - load.free_kv_blocks / load.total_kv_blocks)
        self._pump()
        if self.open or self.arrivals_left:
            self.clock.after(self.spec.coordinator.refresh_seconds, self._report)

    # ---- a request's life ----------------------------------------------------------

    def run(self, requests: list[SimRequest]) -> SimResult:
        outputs = []
        for i, req in enumerate(requests):
            out = RequestOutput(group="default", prompt_len=req.prompt_len, sent=req.arrival)
            outputs.append(out)
            self.clock.at(req.arrival, lambda req=req, out=out, i=i: self._arrive(req, out, f"sim-{i}"))
        self.arrivals_left = len(requests)
        self.clock.after(self.spec.coordinator.refresh_seconds, self._report)
        self.clock.run()
        stuck = [f.rid for f in self.flights.values()]
        if stuck:
            raise RuntimeError(f"the simulation ended with {len(stuck)} requests unfinished ({stuck[:3]}...): "
                               f"a scheduler stopped making progress; report this with the workload")
        end = max((o.done for o in outputs), default=0.0)
        start = min((o.sent for o in outputs), default=0.0)
        preemptions = sum(s.decode.scheduler.num_preemptions for s in self.sims.values() if hasattr(s, "decode"))
        prefilled = sum(s.prefill.computed_tokens for s in self.sims.values() if hasattr(s, "prefill"))
        return SimResult(outputs, end - start, self.kv_wire_bytes,
                         {name: s.busy.seconds for name, s in self.sims.items()}, preemptions, prefilled,
                         sum(self.kv_usage) / len(self.kv_usage) if self.kv_usage else 0.0)

    def _arrive(self, req: SimRequest, out: RequestOutput, rid: str) -> None:
        self.arrivals_left -= 1
        self.contention.request(self.clock.now)
        c = self.spec.coordinator
        deadline = VirtualDeadline(self.clock.now + c.timeout, c.timeout, clock=self.clock)
        seq = new_sequence(rid, req.prompt_ids, req.output_len, self.spec.decode.max_model_len)
        flight = Flight(req, out, rid, deadline, seq)
        self.flights[rid] = flight
        self.open += 1
        if not self.decode_line and self._try_decode(flight):
            return
        if len(self.decode_line) >= c.max_queue:
            self._fail(flight, "RESOURCE_EXHAUSTED: the decode queue is full")
            return
        self.decode_line.append(flight)

    def _pump(self) -> None:
        """The heads of the lines pick again (a release, a refusal or a load report changed the pool)."""
        while self.decode_line and self._try_decode(self.decode_line[0], head=True):
            pass
        while self.prefill_line and self._try_prefill(self.prefill_line[0], head=True):
            pass

    def _try_decode(self, f: Flight, head: bool = False) -> bool:
        if f.deadline.expired:
            if head:
                self.decode_line.popleft()
            self._fail(f, "DEADLINE_EXCEEDED: waited in the decode queue")
            return True
        worker = self.router.pick_decode(f.req.prompt_len, list(f.req.prompt_ids))
        if worker is None:
            return False
        if head:
            self.decode_line.popleft()
        f.decode, f.blocks = worker, worker.blocks_for(f.req.prompt_len)
        self.router.hold_decode(worker, f.blocks)
        if self.spec.colocated:
            self._open_decode(f)
        elif not self.prefill_line and self._try_prefill(f):
            pass
        elif len(self.prefill_line) >= self.spec.coordinator.max_queue:
            self._fail(f, "RESOURCE_EXHAUSTED: the prefill queue is full")
        else:
            self.prefill_line.append(f)
        return True

    def _try_prefill(self, f: Flight, head: bool = False) -> bool:
        worker = self.router.pick_prefill()
        if worker is None:
            return False
        if head:
            self.prefill_line.popleft()
        f.prefill = worker
        try:
            admit(worker, f.req.prompt_len, f.deadline, self.spec.coordinator.ttft_budget)
        except RequestFailed as e:
            self._fail(f, str(e))
            return True
        self._open_decode(f)
        return True

    def _open_decode(self, f: Flight) -> None:
        sim = self.sims[f.decode.address]
        try:
            sim.decode.add(f.seq)
        except QueueFull:  # attempt.py: D counts as full until its next report; pick again
            self.router.refused(f.decode)
            self.router.release_decode(f.decode, f.blocks)
            f.decode, f.prefill = None, None
            self.decode_line.appendleft(f)
            return
        sim.kick()

    def _admitted(self, seq: Sequence) -> None:
        """D holds the prompt's blocks: the prefill runs (on P, or on the colocated worker itself)."""
        f = self.flights[seq.request_id]
        n = f.req.prompt_len
        c = self.spec.coordinator
        due = f.out.sent + ttft_budget_of(f.deadline, c.ttft_budget)
        if self.spec.colocated:
            sim = self.sims[f.decode.address]
            job = SimPrefillJob(n, self.spec.decode.block_size, f, computed=min(seq.num_cached_tokens, n - 1))
        else:
            sim = self.sims[f.prefill.address]
            f.prefilling = self.router.prefilling(f.prefill, n)
            f.prefilling.__enter__()
            job = SimPrefillJob(n, self.spec.decode.block_size, f, token_ids=f.req.prompt_ids)
            sim.prefill.lookup(job)
        sim.prefill.scheduler.add(job, due)
        sim.kick()

    def _first_token(self, job: SimPrefillJob) -> None:
        f: Flight = job.owner  # type: ignore[assignment]
        f.out.chunk_times.append(self.clock.now + self.decode_profile.ttft_overhead_s)
        f.out.chunk_tokens.append(1)
        self.contention.token(self.clock.now)
        sim = self.sims[f.decode.address]
        if self.spec.colocated:
            sim.decode.start(f.seq)
            return
        f.prefilling.__exit__(None, None, None)
        f.prefilling = None
        wire = f.req.prompt_len - f.seq.num_hit_blocks * self.spec.decode.block_size
        self.kv_wire_bytes += max(wire, 0) * self.handoff.kv_bytes_per_token

        def arrived() -> None:
            sim.decode.start(f.seq)
            sim.kick()

        self.clock.after(self.handoff.seconds(max(wire, 0)), arrived)
        self._pump()

    def _token(self, seq: Sequence) -> None:
        f = self.flights[seq.request_id]
        f.out.chunk_times.append(self.clock.now + self.decode_profile.ttft_overhead_s)
        f.out.chunk_tokens.append(1)
        self.contention.token(self.clock.now)

    def _finished(self, seq: Sequence) -> None:
        f = self.flights.pop(seq.request_id)
        self.open -= 1
        f.out.done = f.out.chunk_times[-1]
        f.out.output_len = len(seq.output_ids)
        f.out.success = True
        f.out.finish_reason = "length"
        self.router.release_decode(f.decode, f.blocks)
        self._pump()

    def _fail(self, f: Flight, error: str) -> None:
        self.flights.pop(f.rid, None)
        self.open -= 1
        f.out.done = self.clock.now
        f.out.error = error
        if f.decode is not None:
            self.router.release_decode(f.decode, f.blocks)
            f.decode = None


def simulate(requests: list[SimRequest], spec: ClusterSpec, prefill_profile: Profile,
             decode_profile: Profile | None = None, handoff: HandoffCost | None = None) -> SimResult:
    return SimCluster(spec, prefill_profile, decode_profile or prefill_profile, handoff).run(requests)
