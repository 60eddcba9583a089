"""A decode worker that stops answering (SIGSTOP) mid-stream: its streams migrate after --stall-timeout
and complete with the tokens of the no-fault run; the worker serves again once it resumes."""

from __future__ import annotations

import os
import signal
import time

from tests.e2e.procs import (Stream, blocks, counter, greedy_at_once, list_workers, request, wait_blocks_free,
                             wait_until)
from tests.security.test_attacks import PROMPTS

MAX_TOKENS = 400
ROUNDS = 3
STILL_FOR = 1.0  # seconds a stream's tokens must not move, once its worker is frozen, to count as held by it


def _held(streams: list[Stream]) -> list[Stream]:
    """The unfinished streams whose tokens stopped moving: those the frozen worker holds (the stall timeout,
    3 s, has not yet moved them)."""
    before = [len(s.tokens) for s in streams]
    time.sleep(STILL_FOR)
    return [s for s, n in zip(streams, before)
            if s.is_alive() and not s.finish_reason and len(s.tokens) == n]


def test_streams_of_a_frozen_decode_worker_migrate(secured):
    coordinator, d0, d1 = (secured.procs[n] for n in ("coordinator", "d0", "d1"))
    wait_until(lambda: [w.state for w in list_workers(coordinator)] == ["ready"] * 3, "every worker ready")
    reference = greedy_at_once(coordinator.address, PROMPTS, MAX_TOKENS)
    # A round whose streams all left the chosen worker before it froze shows nothing: it is run again.
    for _ in range(ROUNDS):
        before = counter(coordinator.metrics(), "pdserve_stalled_streams_total")
        streams = [Stream(coordinator.address, request(p, MAX_TOKENS)) for p in PROMPTS]
        # two tokens each: the second is the decode worker's own (the first comes from the prefill worker, and a
        # stream frozen before its decode worker's first event waits for the KV, where missed heartbeats, not
        # the stall timeout, end the attempt)
        wait_until(lambda: all(len(s.tokens) >= 2 for s in streams), "every stream's decoded tokens", every=0.01)
        frozen = d0 if blocks(d0)[0] < blocks(d0)[1] else d1
        os.kill(frozen.popen.pid, signal.SIGSTOP)
        try:
            held = _held(streams)
            for s in streams:
                s.join(120)
            assert [s.error for s in streams] == [None] * 4
            assert [s.tokens for s in streams] == reference
            if held:
                assert counter(coordinator.metrics(), "pdserve_stalled_streams_total") > before
        finally:
            os.kill(frozen.popen.pid, signal.SIGCONT)
        wait_until(lambda: [w.state for w in list_workers(coordinator)] == ["ready"] * 3, "the frozen worker back")
        if held:
            break
    assert held, f"in {ROUNDS} rounds every stream finished before its worker froze: no stall was tested"
    assert all(free == total for free, total in wait_blocks_free([d0, d1]))
