"""CPU contention: the share of a core each simulated worker's steps get when the cluster's processes
share one host's cores (this machine: the prefill worker, the decode worker, the coordinator and the load
client on 2 cores, beside whatever else runs there).

The profile's step seconds are a worker's CPU work on cores of its own (`measure.py` divides out the
share it got while measured). On a shared host a step lasts work / share, the share taken when the step
starts from what every process then asks for, split by max-min fairness over `cores` (a work-conserving
fair scheduler, the kernel's CFS to first order: nobody gets more than it asks, what is left splits
evenly among the rest):
- a worker stepping asks for its `threads` (the decode worker: its --threads, 1; the prefill worker: the
  cores XLA's threads keep busy during a step, measured by `plan profile`); a worker between steps asks 0;
- the coordinator and the load client ask for their CPU seconds per request and per output token times
  the cluster's current request and token rates (decaying averages over `window_s`), at most one core
  each (one event loop);
- everything else on the host (other users) holds `external_cores` (measured per run: the host's busy
  CPU less the cluster's own, /proc/stat): what they got, so it comes off the top.
With a `placement` (each process pinned to one core, `plan validate --pin`: the prefill worker, the
coordinator and the client on core 0, the decode worker on core 1) the sharing is per core: what runs on
a core splits that core (less its part of the external load) by the same rule, and no process spills onto
another core.
`HostCpu()` (no `cores`) is a host where each worker owns its device: every share is 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ProcessCpu:
    """CPU seconds a process of the cluster's front spends per request and per output token."""

    per_request_s: float = 0.0
    per_token_s: float = 0.0
    max_cores: float = 1.0

    def __post_init__(self) -> None:
        for name in ("per_request_s", "per_token_s", "max_cores"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")


@dataclass(frozen=True)
class HostCpu:
    cores: float | None = None
    """The host's cores the cluster's processes share; None: each worker owns its device (no contention)."""
    external_cores: float = 0.0
    """Cores other processes on the host keep busy (taken off the top)."""
    prefill_threads: float = 1.0
    decode_threads: float = 1.0
    coordinator: ProcessCpu = field(default_factory=ProcessCpu)
    client: ProcessCpu = field(default_factory=ProcessCpu)
    window_s: float = 1.0
    placement: dict[str, int] | None = None
    """The core each process is pinned to, by role (prefill, decode, coordinator, client); None: they float
    over all `cores`."""

    def __post_init__(self) -> None:
        if self.cores is not None and not (math.isfinite(self.cores) and self.cores > 0):
            raise ValueError(f"host cores must be > 0, got {self.cores!r}")
        if self.placement is not None:
            if set(self.placement) != set(ROLES):
                raise ValueError(f"host placement must name a core for each of {', '.join(ROLES)}, got "
                                 f"{sorted(self.placement)}")
            for role, core in self.placement.items():
                if not isinstance(core, int) or core < 0 or (self.cores is not None and core >= self.cores):
                    raise ValueError(f"host placement: {role}'s core must be an integer in [0, cores), got {core!r}")
        for name in ("external_cores", "prefill_threads", "decode_threads", "window_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"host {name} must be a finite number >= 0, got {v!r}")
        if self.window_s <= 0 or self.prefill_threads <= 0 or self.decode_threads <= 0:
            raise ValueError("host window_s, prefill_threads and decode_threads must be > 0")

    def to_json(self) -> dict:
        from dataclasses import asdict

        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict) -> HostCpu:
        try:
            return cls(**{**doc, "coordinator": ProcessCpu(**doc.get("coordinator", {})),
                          "placement": dict(doc["placement"]) if doc.get("placement") else None,
                          "client": ProcessCpu(**doc.get("client", {}))})
        except (TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"host_cpu: {e}") from None


ROLES = ("prefill", "decode", "coordinator", "client")


def parse_placement(text: str) -> dict[str, int]:
    """`prefill=0,decode=1,coordinator=0,client=0` -> {role: core}."""
    out = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        role, sep, core = item.partition("=")
        if not sep or role not in ROLES or not core.isdigit():
            raise ValueError(f"placement {item!r}: give ROLE=CORE with ROLE one of {', '.join(ROLES)}")
        out[role] = int(core)
    if set(out) != set(ROLES):
        raise ValueError(f"placement {text!r} must name a core for each of {', '.join(ROLES)}")
    return out


def fair_shares(capacity: float, demands: list[float]) -> list[float]:
    """Max-min fair allocation of `capacity` over `demands` (each gets at most its demand)."""
    out = [0.0] * len(demands)
    left = capacity
    order = sorted(range(len(demands)), key=lambda i: demands[i])
    for k, i in enumerate(order):
        give = min(demands[i], left / (len(order) - k))
        out[i] = give
        left -= give
    return out


class Rate:
    """Events per second, a decaying average over `window_s`."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.value = 0.0
        self.at = 0.0

    def _decay(self, now: float) -> None:
        self.value *= math.exp(-(now - self.at) / self.window_s)
        self.at = now

    def add(self, now: float, n: float = 1.0) -> None:
        self._decay(now)
        self.value += n / self.window_s

    def read(self, now: float) -> float:
        self._decay(now)
        return self.value


class Contention:
    """The shares of one simulated host, as processor sharing: the cluster tells it each request and token;
    a worker `begin`s and `end`s each step, and every change shares the cores out again among the workers
    stepping then (each one's rest of the step runs at its new share: `Stepping.reshare`)."""

    def __init__(self, host: HostCpu) -> None:
        self.host = host
        self.requests = Rate(host.window_s)
        self.tokens = Rate(host.window_s)
        self.stepping: dict[str, Stepping] = {}

    @property
    def shared(self) -> bool:
        return self.host.cores is not None

    def request(self, now: float) -> None:
        self.requests.add(now)

    def token(self, now: float, n: int = 1) -> None:
        self.tokens.add(now, n)

    def threads(self, role: str) -> float:
        return self.host.prefill_threads if role == "prefill" else self.host.decode_threads

    def front_cores(self, now: float) -> list[float]:
        """What the coordinator and the load client ask for now."""
        req, tok = self.requests.read(now), self.tokens.read(now)
        return [min(p.max_cores, p.per_request_s * req + p.per_token_s * tok)
                for p in (self.host.coordinator, self.host.client)]

    def begin(self, step: Stepping, now: float) -> None:
        self.stepping[step.name] = step
        self._reshare(now)

    def end(self, step: Stepping, now: float) -> None:
        self.stepping.pop(step.name, None)
        self._reshare(now)

    def _reshare(self, now: float) -> None:
        steps = list(self.stepping.values())
        if not self.shared:
            for st in steps:
                st.reshare(now, 1.0)
            return
        h = self.host
        if h.placement is not None:
            self._reshare_pinned(now, steps)
            return
        capacity = max(h.cores - h.external_cores, 0.05 * h.cores)
        got = fair_shares(capacity, [st.threads for st in steps] + self.front_cores(now))
        for st, cores in zip(steps, got):
            st.reshare(now, min(1.0, cores / st.threads))

    def _reshare_pinned(self, now: float, steps: list[Stepping]) -> None:
        """Per core: its steps (one core's worth at most: a pinned process cannot spill) and the front
        processes pinned there split it, less its part of the external load."""
        h = self.host
        capacity = max(1.0 - h.external_cores / h.cores, 0.05)
        front = dict(zip(("coordinator", "client"), self.front_cores(now)))
        for core in set(h.placement.values()):
            here = [st for st in steps if h.placement.get(st.name.split("-")[0], h.placement["decode"]) == core]
            demands = [min(st.threads, 1.0) for st in here] + [c for role, c in front.items() if h.placement[role] == core]
            got = fair_shares(capacity, demands)
            for st, cores in zip(here, got):
                st.reshare(now, min(1.0, cores / min(st.threads, 1.0)))


class Stepping:
    """One worker's step in progress: its work left (seconds on cores of its own) at its current share,
    and the end event (`schedule(at, generation)`; an event of an older generation is stale)."""

    def __init__(self, name: str, threads: float, work_s: float, now: float, schedule) -> None:
        self.name = name
        self.threads = threads
        self.left = work_s
        self.since = now
        self.share = 0.0
        self.generation = 0
        self.schedule = schedule

    def reshare(self, now: float, share: float) -> None:
        if share == self.share:
            return
        self.left = max(self.left - (now - self.since) * self.share, 0.0)
        self.since = now
        self.share = share
        self.generation += 1
        self.schedule(now + self.left / share, self.generation)
