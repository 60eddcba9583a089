"""Admission by expected wait: a scripted slow prefill worker's queued work, at its measured rate."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.v1 import generation_pb2, generation_pb2_grpc, worker_pb2
from pdserve.server import metrics
from pdserve.server.coordinator.prefill_estimate import expected_wait
from pdserve.server.coordinator.router import Worker
from tests.coordinator.fakes import start_fake_pools

BUCKETS = (16, 32, 64, 128, 256, 512)


def slow_load(queued_long_tokens: int) -> worker_pb2.WorkerLoad:
    """A prefill worker doing 128 tokens/s on short prompts and 100 on its 512-token bucket, which
    holds `queued_long_tokens` (three long prompts, say); nothing else measured."""
    rates = {16: 128.0, 512: 100.0}
    return worker_pb2.WorkerLoad(prefill_buckets=[
        worker_pb2.PrefillBucket(max_tokens=b, queued_tokens=queued_long_tokens if b == 512 else 0,
                                 queued_prompts=3 if b == 512 and queued_long_tokens else 0,
                                 tokens_per_second=rates.get(b, 0.0))
        for b in BUCKETS
    ])


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


async def test_a_request_whose_expected_wait_exceeds_its_deadline_is_refused_at_once(model_dir):
    pools = await _pools(model_dir, "fifo", slow_load(3 * 100))
    refused = metrics.expected_wait_rejections._value.get()
    try:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await _generate(pools, [5, 6, 7], timeout=2)
        # fifo: 300 queued tokens at 100/s, then its own 3 at 128/s: 3.0234375 s
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert ("retry-after-ms", "3024") in tuple(e.value.trailing_metadata())
        assert e.value.details().startswith(f"expected prefill wait 3.02 s (queued work on prefill worker "
                                            f"{pools.prefill_worker.address} at its measured rate) exceeds "
                                            f"the request's time left before its deadline, ")
        assert pools.prefill.requests == [] and pools.decode.requests == []  # refused before any worker call
        assert metrics.expected_wait_rejections._value.get() == refused + 1
        # A deadline the wait fits in is admitted.
        responses = await _generate(pools, [5, 6, 7], timeout=10)
        assert [list(r.token_ids) for r in responses] == [[5], [6], []]
    finally:
        await pools.stop()


async def test_shortest_first_admits_a_short_prompt_that_long_queued_ones_do_not_delay(model_dir):
    pools = await _pools(model_dir, "shortest-first", slow_load(3 * 500))
    try:
        responses = await _generate(pools, [5, 6, 7], timeout=10)
        assert [list(r.token_ids) for r in responses] == [[5], [6], []]
        assert len(pools.prefill.requests) == 1
        with pytest.raises(grpc.aio.AioRpcError) as e:  # a long one waits behind the long queue
            await _generate(pools, [5] * 300, timeout=10)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert ("retry-after-ms", "18000") in tuple(e.value.trailing_metadata())  # (1500 + 300) / 100 s
    finally:
        await pools.stop()


async def test_the_ttft_budget_bounds_the_wait_below_the_deadline(model_dir):
    pools = await _pools(model_dir, "fifo", slow_load(400), ttft_budget=2.0)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as e:  # 400 / 100 + 3 / 128 s > 2 s, deadline 600 s
            await _generate(pools, [5, 6, 7], timeout=600)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "TTFT budget (--ttft-budget), 2 s" in e.value.details()
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
    worker.info.prefill_order = "shortest-first"
    assert expected_wait(worker, 16) == 10 / 128 + 16 / 128
    assert expected_wait(worker, 40) == 10 / 128 + 40 / 128  # 64 bucket: the nearest measured rate (16)
    assert expected_wait(Worker("127.0.0.1:2", "prefill"), 16) is None


async def test_with_nothing_queued_ahead_a_request_is_admitted_whatever_its_own_prefill_takes(model_dir):
    pools = await _pools(model_dir, "fifo", slow_load(0), ttft_budget=2.0)
    try:  # its own 300 tokens at 100/s: 3 s > 2 s, but an idle worker serves (and measures again)
        responses = await _generate(pools, [5] * 300, timeout=600)
        assert [list(r.token_ids) for r in responses] == [[5], [6], []]
    finally:
        await pools.stop()

