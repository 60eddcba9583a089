"""Whether a prefill step waited for a compile: JAX traces a program on the thread that calls it when its
jit cache misses, and reports it (`jax.monitoring`), so a step that ran only programs compiled ahead of
time reports nothing. The engine wraps each step in `watch()` and counts the steps that did
(`pdserve_prefill_compile_waits`, which stays 0 while every step packs into compiled shapes, warmup.py).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import jax.monitoring

TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
"""Reported on every jit cache miss, before XLA compiles (or the persistent cache loads) the program."""

_thread = threading.local()


def _on_event(event: str, duration: float, **kwargs) -> None:
    watched = getattr(_thread, "watched", None)
    if watched is not None and event == TRACE_EVENT:
        watched.append(event)


jax.monitoring.register_event_duration_secs_listener(_on_event)


@contextmanager
def watch() -> Iterator[list[str]]:
    """Collects the compiles on this thread while the block runs: the list is empty after it when none."""
    seen: list[str] = []
    outer = getattr(_thread, "watched", None)
    _thread.watched = seen
    try:
        yield seen
    finally:
        _thread.watched = outer
