"""Arrival processes: when each request is sent, as offsets in seconds from the start of a run.

Open loop: `constant` (every 1/rate s) or `poisson` (exponential gaps, mean 1/rate, seeded).
Closed loop: rate = inf sends as fast as the concurrency limit allows (fixed concurrency).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import numpy as np

Arrival = Literal["poisson", "constant"]


@dataclass(frozen=True)
class LoadSpec:
    """How one group of requests is sent."""

    rate: float = math.inf  # requests/s; inf = closed loop
    arrival: Arrival = "poisson"
    concurrency: int | None = None  # at most this many in flight; None = no limit
    seed: int = 0
    start_after: float = 0.0  # seconds before this group's first request


def arrival_offsets(spec: LoadSpec) -> Iterator[float]:
    """An endless, non-decreasing sequence of send offsets (seconds from the run's start)."""
    rng = np.random.default_rng(spec.seed)
    t = spec.start_after
    while True:
        yield t
        if math.isinf(spec.rate):
            continue
        if spec.arrival == "constant":
            t += 1.0 / spec.rate
        elif spec.arrival == "poisson":
            t += float(rng.exponential(1.0 / spec.rate))
        else:
            raise ValueError(f"unknown arrival process {spec.arrival!r}; choose poisson or constant")
