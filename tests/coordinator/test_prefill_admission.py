"""Admission by expected wait: a scripted slow prefill worker's report (the seconds of other work its
scheduler runs before a new prompt of each length; from an older worker, all its queued work), the
prompts sent since, at its measured rates, then the prompt's own."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.v1 import generation_pb2, generation_pb2_grpc, worker_pb2
from pdserve.server import metrics
from pdserve.server.coordinator.prefill_estimate import expected_wait
from pdserve.server.coordinator.worker_pool import Worker
from pdserve.server.prefill.rates import PrefillRates
from pdserve.server.prefill.scheduler import PrefillScheduler
from tests.coordinator.fakes import start_fake_pools
from tests.prefill.jobs import Clock, Job, bucket

BUCKETS = (16, 32, 64, 128, 256, 512)


def slow_load(queued_long_tokens: int, waits: dict[int, float] | None = None) -> worker_pb2.WorkerLoad:
    """A prefill worker doing 128 tokens/s on short prompts and 100 on its 512-token bucket, which
    holds `queued_long_tokens` (three long prompts, say); nothing else measured. waits: the expected
    wait it reports per bucket (None: none, as an older worker)."""
    rates = {16: 128.0, 512: 100.0}
    return worker_pb2.WorkerLoad(prefill_buckets=[
        worker_pb2.PrefillBucket(max_tokens=b, queued_tokens=queued_long_tokens if b == 512 else 0,
                                 queued_prompts=3 if b == 512 and queued_long_tokens else 0,
                                 tokens_per_second=rates.get(b, 0.0),
                                 **({} if waits is None else {"expected_wait_seconds": waits[b]}))
        for b in BUCKETS
    ])


SHORT_FIRST = {16: 0.5, 32: 0.5, 64: 0.5, 128: 0.5, 256: 0.5, 512: 15.0}
"""What a shortest-first worker holding three 500-token prompts reports: a short prompt waits for the
running step's rest (0.5 s), a long one for all 15 s of them."""


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("llama")


async def _pools(model_dir, order: str, load: worker_pb2.WorkerLoad, **config):
    pools = await start_fake_pools(model_dir, **config)
    pools.prefill_worker.control.prefill_order = order
    pools.prefill_worker.control.load = load
    pools.prefill.first_token_id = 5
    pools.decode.events = [[6]]
    worker = pools.coordinator.pool.workers[pools.prefill_worker.address]
    for _ in range(100):  # the next GetInfo round brings the scripted load
        if worker.info is not None and worker.info.load.prefill_buckets:
            break
        await asyncio.sleep(0.02)
    return pools


async def _generate(pools, ids: list[int], timeout: float) -> list[generation_pb2.GenerateResponse]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{pools.coordinator.port}") as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        req = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=ids),
                                             sampling=generation_pb2.SamplingParams(max_tokens=2))
        return [r async for r in stub.Generate(req, timeout=timeout)]


def _expected_waits() -> float:
    """How many estimates pdserve_prefill_expected_wait_seconds holds, over every identity."""
    family = metrics.prefill_expected_wait.families[0]
    return sum(s.value for m in family.collect() for s in m.samples
               if s.name == "pdserve_prefill_expected_wait_seconds_count")


def _expected_wait_rejections() -> float:
    """pdserve_expected_wait_rejections over every identity (the fakes share this process)."""
    family = metrics.expected_wait_rejections.families[0]
    return sum(s.value for m in family.collect() for s in m.samples
               if s.name == "pdserve_expected_wait_rejections_total")


async def test_a_request_whose_expected_wait_exceeds_its_deadline_is_refused_at_once(model_dir):
    pools = await _pools(model_dir, "fifo", slow_load(3 * 100))
    refused = _expected_wait_rejections()
    try:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await _generate(pools, [5, 6, 7], timeout=2)
        # fifo: 300 queued tokens at 100/s, then its own 3 at 128/s: 3.0234375 s
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert ("retry-after-ms", "3024") in tuple(e.value.trailing_metadata())
        assert e.value.details().startswith(f"expected prefill wait 3.02 s (the work prefill worker "
                                            f"{pools.prefill_worker.address} runs first, at its measured rates) "
                                            f"exceeds the ")
        assert e.value.details().endswith(" s left before the request's deadline; you may retry after 3024 ms")
        assert pools.prefill.requests == [] and pools.decode.requests == []  # refused before any worker call
        assert _expected_wait_rejections() == refused + 1
        # A deadline the wait fits in is admitted.
        responses = await _generate(pools, [5, 6, 7], timeout=10)
        assert [list(r.token_ids) for r in responses] == [[5], [6], []]
    finally:
        await pools.stop()


async def test_a_worker_that_reports_no_expected_wait_gets_the_worst_case_and_the_budget_is_sent(model_dir):
    """An older worker reports only its queued work: a short prompt may wait for all of it, whatever
    the order, so it all counts, not only the shorter buckets'."""
    pools = await _pools(model_dir, "shortest-first", slow_load(3 * 500), ttft_budget=17.0)
    refused = _expected_wait_rejections()
    try:
        with pytest.raises(grpc.aio.AioRpcError) as e:  # 1500 / 100 + 3 / 128 s = 15.02 s > 10 s left
            await _generate(pools, [5, 6, 7], timeout=10)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert ("retry-after-ms", "15024") in tuple(e.value.trailing_metadata())
        assert e.value.details().endswith(" s left before the request's deadline; you may retry after 15024 ms")
        assert pools.prefill.requests == [] and _expected_wait_rejections() == refused + 1
        responses = await _generate(pools, [5, 6, 7], timeout=600)  # 15.02 s <= the 17 s budget
        assert [list(r.token_ids) for r in responses] == [[5], [6], []]
        (sent,) = pools.prefill.requests
        assert sent.ttft_budget_seconds == 17.0  # the worker's scheduler keeps the first token within it
        assert 0.0 < sent.arrived_seconds_ago < 17.0  # from the request's arrival at the coordinator
        with pytest.raises(grpc.aio.AioRpcError) as e:  # a long one: (1500 + 300) / 100 s > 17 s
            await _generate(pools, [5] * 300, timeout=600)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert ("retry-after-ms", "18000") in tuple(e.value.trailing_metadata())
        assert " s left of the request's TTFT budget (--ttft-budget 17 s from its arrival); " in e.value.details()
    finally:
        await pools.stop()


async def test_a_short_prompt_is_admitted_by_what_the_worker_runs_first_and_a_long_one_refused(model_dir):
    """Three 500-token prompts queued (15 s at 100 tokens/s) under a 10 s deadline: the worst case
    refused every request; with the worker's expected waits a short prompt waits 0.5 s and is
    admitted, a long one would wait for all of them and is refused at once, the estimate in its retry
    hint. Only admitted requests' estimates go to the expected-wait histogram."""
    pools = await _pools(model_dir, "shortest-first", slow_load(3 * 500, SHORT_FIRST))
    refused, estimates = _expected_wait_rejections(), _expected_waits()
    try:
        responses = await _generate(pools, [5, 6, 7], timeout=10)  # 0.5 + 3 / 128 s
        assert [list(r.token_ids) for r in responses] == [[5], [6], []]
        assert _expected_waits() == estimates + 1
        with pytest.raises(grpc.aio.AioRpcError) as e:  # 15 + 300 / 100 s > 10 s
            await _generate(pools, [5] * 300, timeout=10)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert ("retry-after-ms", "18000") in tuple(e.value.trailing_metadata())
        assert e.value.details().startswith("expected prefill wait 18 s (the work prefill worker ")
        assert len(pools.prefill.requests) == 1 and _expected_wait_rejections() == refused + 1
        assert _expected_waits() == estimates + 1
    finally:
        await pools.stop()


def test_prompts_sent_since_the_report_count_where_the_order_runs_them_first():
    worker = Worker("127.0.0.1:1", "prefill",
                    info=worker_pb2.WorkerInfo(load=slow_load(1500, SHORT_FIRST), prefill_order="shortest-first"))
    assert expected_wait(worker, 16) == 0.5 + 16 / 128
    worker.unreported_lengths = [10, 300]
    assert expected_wait(worker, 16) == 0.5 + 10 / 128 + 16 / 128  # the 300-token one runs after it
    assert expected_wait(worker, 300) == 15.0 + (10 / 128 + 300 / 100) + 300 / 100
    worker.info.prefill_order = "fifo"
    assert expected_wait(worker, 16) == 0.5 + (10 / 128 + 300 / 100) + 16 / 128
    worker.reported(worker.info, now=1.0)  # the next report counts them
    assert worker.unreported_lengths == [] and worker.last_seen == 1.0


def test_the_running_step_counts_as_queued_work_ahead_of_a_short_prompt():
    """What a real scheduler reports while a long prompt's step runs: its tokens count until the step
    ends, so a short prompt's worst case waits for it (the short one cannot join a running step)."""
    clock = Clock()
    rates = PrefillRates([16, 32, 64, 128, 256, 512, 1024, 2048])
    rates.record(16, 128, 1.0)
    rates.record(2048, 100, 1.0)
    s = PrefillScheduler("shortest-first", bucket=bucket, max_batch_size=1, max_batch_tokens=2048,
                         seconds=rates.seconds, clock=clock)
    s.add(Job("long", 1500), due=30.0)
    running = s.next_step()
    assert [g.job.name for g in running] == ["long"]
    s.add(Job("mid", 400), due=30.0)
    load = worker_pb2.WorkerLoad(prefill_buckets=rates.report(s.queued_by_bucket, s.prompts_by_bucket))
    worker = Worker("127.0.0.1:1", "prefill", info=worker_pb2.WorkerInfo(load=load, prefill_order="shortest-first"))
    # 1500 running and 400 queued at the 2048 bucket's 100 tokens/s (the nearest measured), own 16 at 128/s
    assert expected_wait(worker, 16) == 15.0 + 4.0 + 0.125


async def test_the_ttft_budget_bounds_the_wait_below_the_deadline(model_dir):
    pools = await _pools(model_dir, "fifo", slow_load(400), ttft_budget=2.0)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as e:  # 400 / 100 + 3 / 128 s > 2 s, deadline 600 s
            await _generate(pools, [5, 6, 7], timeout=600)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert " s left of the request's TTFT budget (--ttft-budget 2 s from its arrival); " in e.value.details()
        assert ("retry-after-ms", "4024") in tuple(e.value.trailing_metadata())
    finally:
        await pools.stop()


async def test_no_measured_rate_means_no_estimate_and_the_request_is_admitted(model_dir):
    load = worker_pb2.WorkerLoad(queued_prefill_tokens=100_000, prefill_buckets=[
        worker_pb2.PrefillBucket(max_tokens=b, queued_tokens=100_000 if b == 512 else 0) for b in BUCKETS])
    pools = await _pools(model_dir, "fifo", load)
    try:
        responses = await _generate(pools, [5, 6, 7], timeout=5)
        assert [list(r.token_ids) for r in responses] == [[5], [6], []]
    finally:
        await pools.stop()


def test_prompts_sent_since_the_last_report_count_as_queued_work():
    worker = Worker("127.0.0.1:1", "prefill", info=worker_pb2.WorkerInfo(load=slow_load(500), prefill_order="fifo"))
    assert expected_wait(worker, 16) == 500 / 100 + 16 / 128
    worker.pending_lengths = [300, 300, 10]  # 600 > the reported 500 in the 512 bucket; 10 in the 16 bucket
    assert expected_wait(worker, 16) == 600 / 100 + 10 / 128 + 16 / 128
    worker.info.prefill_order = "shortest-first"  # the worst case is the same: all of it may run first
    assert expected_wait(worker, 16) == 600 / 100 + 10 / 128 + 16 / 128
    assert expected_wait(worker, 40) == 600 / 100 + 10 / 128 + 40 / 128  # 64 bucket: the nearest measured rate (16)
    assert expected_wait(Worker("127.0.0.1:2", "prefill"), 16) is None


async def test_with_nothing_queued_ahead_a_request_is_admitted_whatever_its_own_prefill_takes(model_dir):
    pools = await _pools(model_dir, "fifo", slow_load(0), ttft_budget=2.0)
    try:  # its own 300 tokens at 100/s: 3 s > 2 s, but an idle worker serves (and measures again)
        responses = await _generate(pools, [5] * 300, timeout=600)
        assert [list(r.token_ids) for r in responses] == [[5], [6], []]
    finally:
        await pools.stop()

