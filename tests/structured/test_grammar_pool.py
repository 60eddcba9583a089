"""The grammar child processes: a crash or a timeout fails only its own job (refused, replaced, nothing cached)
while this process and the other jobs go on; a worker's compiled grammars are an LRU bounded by bytes; and a
slow check leaves the event loop free."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import pytest
from pdserve.server.structured.bitmask import allowed_ids, unconstrained
from pdserve.server.structured.checker import SpecChecker
from pdserve.server.structured.grammars import matcher_bytes
from pdserve.server.structured.limits import SpecLimits
from pdserve.server.structured.output_spec import SpecError, grammar_of
from pdserve.server.structured.pool import ChildFailed, GrammarPool
from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.v1 import worker_pb2 as pb

from tests.structured.test_limits import chained_defs, chained_rules
from tests.structured.vocab import WIDTH, grammars

SO = gen_pb.StructuredOutput
UNLIMITED = SpecLimits(max_spec_bytes=2**22, max_schema_defs=100_000, max_grammar_rules=100_000)
"""Limits that let the specs which crash llguidance reach a child."""


@pytest.fixture
def pool():
    pools: list[GrammarPool] = []

    def make(processes: int = 1, timeout: float = 60.0) -> GrammarPool:
        pools.append(GrammarPool(processes, timeout))
        return pools[-1]

    yield make
    for p in pools:
        p.close()


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_crash_fails_its_job_only_and_the_next_job_runs_on_a_fresh_child(pool):
    p = pool(processes=2)
    slow = p.submit(time.sleep, 1.0)
    crash = p.submit(os.abort)
    e = crash.exception(60)
    assert isinstance(e, ChildFailed) and str(e) == "crashed (signal SIGABRT)" and not e.timed_out
    assert slow.result(60) is None  # the job in flight on the other child went on
    assert p.crashes == 1
    single = pool(processes=1)
    first = single.submit(os.getpid).result(60)
    with pytest.raises(ChildFailed, match=r"crashed \(signal SIGABRT\)"):
        single.submit(os.abort).result(60)
    second = single.submit(os.getpid).result(60)
    assert second != first and gone(first) and single.pids() == [second]


def test_a_killed_child_fails_its_job_and_is_replaced(pool):
    p = pool()
    pid = p.submit(os.getpid).result(60)
    job = p.submit(time.sleep, 60)
    time.sleep(0.3)  # the job reaches the child
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(ChildFailed, match=r"crashed \(signal SIGKILL\)"):
        job.result(60)
    assert p.submit(os.getpid).result(60) != pid


def test_a_timeout_kills_and_replaces_the_child(pool):
    p = pool(timeout=0.5)
    pid = p.submit(os.getpid).result(60)
    t0 = time.monotonic()
    with pytest.raises(ChildFailed, match=r"^did not finish within 0.5 s$") as e:
        p.submit(time.sleep, 60).result(60)
    assert e.value.timed_out and time.monotonic() - t0 < 10
    assert gone(pid) and p.timeouts == 1
    assert p.submit(os.getpid).result(60) not in (pid, None)


async def test_a_full_queue_refuses_at_once_and_the_client_may_retry(pool):
    import grpc
    from pdserve.server.coordinator.admission import RequestFailed
    from pdserve.server.coordinator.validate import check_spec
    from pdserve.server.structured.pool import PoolBusy

    p = pool()
    p.max_queued = 1
    running = p.submit(time.sleep, 2)
    for _ in range(100):  # the slot thread takes it off the queue
        if p._jobs.qsize() == 0:
            break
        time.sleep(0.02)
    waiting = p.submit(os.getpid)
    with pytest.raises(PoolBusy, match="1 grammar checks wait for the 1 grammar processes"):
        p.submit(os.getpid)
    with pytest.raises(RequestFailed) as e:
        await check_spec(SO(regex="[ab]+"), SpecChecker(SpecLimits(), p), "structured_outputs.regex")
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "you may retry" in e.value.details
    assert e.value.details.startswith("structured_outputs.regex: ") and dict(e.value.metadata)
    assert running.result(60) is None and waiting.result(60) > 0  # the queued jobs are served


async def test_specs_that_crash_llguidance_are_refused_and_the_next_spec_passes(pool):
    checker = SpecChecker(UNLIMITED, pool(), field="structured")
    for spec in (SO(grammar=chained_rules(3000)), SO(json_schema=json.dumps(chained_defs(1500)))):
        kind = spec.WhichOneof("kind")
        with pytest.raises(SpecError, match=rf"^structured\.{kind}: grammar too complex: the grammar compiler "
                                            r"crashed \(signal SIGSEGV\)"):
            await checker.check(spec)
        assert not checker.passed(spec)  # nothing kept of a crash: it is checked (and refused) again
    assert checker.pool.crashes == 2
    ok = SO(json_schema=json.dumps(chained_defs(50)))
    await checker.check(ok)
    assert checker.passed(ok)


async def test_the_event_loop_ticks_while_a_slow_spec_is_checked(pool):
    checker = SpecChecker(UNLIMITED, pool(), field="structured")
    await checker.check(SO(regex="a"))  # the child has started and imported llguidance
    schema = {"type": "object", "properties": {f"p{j}": {"type": "object", "properties": {
        "a": {"type": "string", "pattern": "[a-z]{3,9}"}, "b": {"type": "integer"}}} for j in range(4000)}}
    gaps: list[float] = []

    async def tick() -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = asyncio.create_task(tick())
    t0 = time.perf_counter()
    await checker.check(SO(json_schema=json.dumps(schema)), "response_format.json_schema.schema")
    took = time.perf_counter() - t0
    ticker.cancel()
    assert took > 0.3 and len(gaps) > 10, (took, len(gaps))  # slow enough that blocking would show
    assert max(gaps) < 0.1, (max(gaps), took)


async def test_a_worker_refuses_a_crashing_spec_caches_nothing_and_serves_the_next():
    g = grammars(limits=UNLIMITED)
    crash = SO(grammar=chained_rules(3000))
    with pytest.raises(SpecError, match=r"^sampling\.structured\.grammar: grammar too complex: the grammar "
                                        r"compiler crashed \(signal SIGSEGV\)"):
        await g.prepare(crash)
    bad = SO(regex="(ab")
    with pytest.raises(SpecError, match=r"^sampling\.structured\.regex: "):
        await g.prepare(bad)
    with pytest.raises(SpecError):
        g.constraint(bad)  # without prepare: checked in a child too
    for spec in (crash, bad):
        assert not g.is_cached(spec) and not g.checker.passed(spec)
    assert g.cached_bytes == 0 and g.misses == 2
    spec = SO(regex="(ab)+x")
    await g.prepare(spec)
    assert g.is_cached(spec)
    sampling = gen_pb.SamplingParams(structured=spec)
    for request in (pb.DecodeRequest(prompt_token_ids=[9, 3, 1], num_output_tokens=2, sampling=sampling),
                    pb.PrefillRequest(token_ids=[9, 3, 1], sample_index=2, sampling=sampling)):
        row = unconstrained(1, WIDTH)[0]
        g.for_request(request).fill(row)  # after the outputs "ab", "a": only "b"
        assert allowed_ids(row, WIDTH) == [2]


async def test_the_compiled_grammars_are_an_lru_bounded_by_bytes():
    specs = [SO(regex=f"a{{{n}}}x") for n in (1, 2, 3)]
    sizes = {matcher_bytes(grammar_of(s)) for s in specs}
    assert len(sizes) == 1
    size = sizes.pop()
    g = grammars(cache_bytes=2 * size + size // 2)  # room for two
    a, b, c = specs
    await g.prepare(a)
    await g.prepare(b)
    await g.prepare(a)  # a hit: a is now the most recently used
    assert (g.hits, g.misses, g.evictions, g.cached_bytes) == (1, 2, 0, 2 * size)
    await g.prepare(c)  # evicts b, the least recently used
    assert (g.hits, g.misses, g.evictions, g.cached_bytes) == (1, 3, 1, 2 * size)
    assert [g.is_cached(s) for s in specs] == [True, False, True]
    await g.prepare(b)  # compiled again (its check is remembered), evicting a
    assert [g.is_cached(s) for s in specs] == [False, True, True] and g.evictions == 2
    tiny = grammars(cache_bytes=size - 1)  # a matcher larger than the budget is used, never cached
    await tiny.prepare(a)
    assert not tiny.is_cached(a) and tiny.cached_bytes == 0 and tiny.constraint(a) is not None
