"""The simulator's virtual clock: a time and a queue of callbacks due at later times.

Events at the same time run in the order they were scheduled (a sequence number breaks ties), so a
run is a function of its inputs alone.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable


class VirtualClock:
    def __init__(self) -> None:
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()

    def __call__(self) -> float:
        """The time, as the schedulers' `clock` reads it."""
        return self.now

    def at(self, when: float, callback: Callable[[], None]) -> None:
        if when < self.now:
            raise ValueError(f"cannot schedule an event at {when} s: the clock is at {self.now} s already")
        heapq.heappush(self._events, (when, next(self._seq), callback))

    def after(self, seconds: float, callback: Callable[[], None]) -> None:
        self.at(self.now + seconds, callback)

    @property
    def pending(self) -> int:
        return len(self._events)

    def run(self, max_events: int = 50_000_000, on_event: Callable[[], None] | None = None) -> None:
        """Runs events in time order until none is left (bounded: a stuck model raises, naming the bound)."""
        for _ in range(max_events):
            if not self._events:
                return
            self.now, _, callback = heapq.heappop(self._events)
            callback()
            if on_event is not None:
                on_event()
        raise RuntimeError(f"the simulation ran {max_events} events without ending: shorten --duration or "
                           f"lower --request-rate")
