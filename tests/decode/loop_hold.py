"""Holding a DecodeEngine's loop while a test admits several sequences, so they step together from the first
step whatever else loads the machine (a test whose point needs contention, e.g. preemption, gets it)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from pdserve.server.decode.engine import DecodeEngine


@contextlib.contextmanager
def held(engine: DecodeEngine) -> Iterator[None]:
    """The engine's loop does not start inside the block; it starts (if anything runs) on leaving it."""
    engine._wake = lambda: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        del engine._wake
    if engine.scheduler.running or engine.scheduler.waiting:
        engine._wake()
