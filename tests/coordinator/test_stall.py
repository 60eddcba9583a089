"""Whose silence a stall is: --stall-timeout charges a decode worker only for silence of its own.

Before its first event a decode worker waits on the prefill worker's KV, or prefills the prompt itself
when no prefill worker is up (a fresh cluster whose prefill worker still compiles): neither wait marks it
dead, however long; its health checks and the deadline end them. After its first event, a silent decode
worker is lost (tests/coordinator/test_service.py). A worker marked dead by a call (a stall) is back at
its next health check if it answers; a request finding no other meanwhile waits for that check."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import pytest

from pdserve.v1 import generation_pb2, generation_pb2_grpc
from tests.coordinator.fakes import FakePools, start_fake_pools

STALL = 0.2
"""--stall-timeout in these tests; each silence below lasts three times as long."""


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("llama")


async def _until(predicate) -> None:
    for _ in range(250):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("not reached within 5 s")


@contextlib.asynccontextmanager
async def _pools(model_dir, steps: bool, prefill_up: bool, **config) -> AsyncIterator[FakePools]:
    """A coordinator before one fake prefill and one fake decode worker (steps: D serves `Steps`); the
    prefill worker not answering its health checks unless prefill_up (as while it compiles)."""
    pools = await start_fake_pools(model_dir, stall_timeout=STALL, **config)
    try:
        pools.decode.steps = steps
        pools.decode.events, pools.decode.finish = [[6], [7]], generation_pb2.FINISH_REASON_LENGTH
        pools.prefill.first_token_id = pools.decode.local_first_token = 5
        if not prefill_up:
            pools.prefill_worker.control.healthy = False
            await _until(lambda: not pools.coordinator.pool.ready("prefill"))  # the next GetInfo round
        yield pools
    finally:
        await pools.stop()


def _generate(channel: grpc.aio.Channel):
    stub = generation_pb2_grpc.GenerationStub(channel)
    request = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[1, 2, 3]),
                                             sampling=generation_pb2.SamplingParams(max_tokens=3))
    return stub.Generate(request, timeout=10)


async def _tokens(call) -> list[int]:
    """The ids of the call's (remaining) responses."""
    ids = []
    while (response := await call.read()) is not grpc.aio.EOF:
        ids.extend(response.token_ids)
    return ids


@pytest.mark.parametrize("steps", [False, True])
async def test_a_decode_worker_prefilling_locally_past_the_stall_timeout_is_not_marked_dead(model_dir, steps):
    """No prefill worker is up: D prefills the prompt itself, silent for three stall timeouts (its health
    answering meanwhile); the request completes on its one Decode call and D is never marked dead."""
    async with _pools(model_dir, steps, prefill_up=False) as pools:
        pools.decode.local_prefill = prefilled = asyncio.Event()
        worker = pools.coordinator.pool.workers[pools.decode_worker.address]
        lost = worker.lost
        async with grpc.aio.insecure_channel(f"127.0.0.1:{pools.coordinator.port}") as channel:
            call = asyncio.ensure_future(_tokens(_generate(channel)))
            await _until(lambda: pools.decode.requests)
            await asyncio.sleep(3 * STALL)
            prefilled.set()
            tokens = await call
        assert tokens == [5, 6, 7]
        assert [r.local_prefill for r in pools.decode.requests] == [True]  # one call: no retry
        assert pools.prefill.requests == []
        assert not lost.is_set() and worker.state == "ready"
        assert bool(pools.decode.requests[0].steps_stream_id) == steps


@pytest.mark.parametrize("steps", [False, True])
async def test_a_decode_worker_waiting_for_kv_past_the_stall_timeout_and_lease_is_not_marked_dead(
        model_dir, steps):
    """P answers the first token at once but its KV reaches D three stall timeouts later (longer than
    the stall timeout plus the lease: a transfer whose chunks keep D's lease alive): D is not charged."""
    async with _pools(model_dir, steps, prefill_up=True, lease_seconds=STALL / 2) as pools:
        pools.decode.kv_wait_limit = 5.0
        pools.prefill.push_after = pushed = asyncio.Event()
        worker = pools.coordinator.pool.workers[pools.decode_worker.address]
        lost = worker.lost
        async with grpc.aio.insecure_channel(f"127.0.0.1:{pools.coordinator.port}") as channel:
            call = _generate(channel)
            assert list((await call.read()).token_ids) == [5]  # P's first token, before the KV arrives
            await asyncio.sleep(3 * STALL)
            pushed.set()
            tokens = [5, *await _tokens(call)]
        assert tokens == [5, 6, 7]
        assert len(pools.decode.requests) == len(pools.prefill.requests) == 1  # no retry
        assert not lost.is_set() and worker.state == "ready"


@pytest.mark.parametrize("steps", [False, True])
async def test_a_decode_worker_going_down_while_it_prefills_locally_loses_the_attempt_at_its_health_check(
        model_dir, steps):
    """No stall limit runs before the first event, but D's health still does: D stops answering GetInfo
    mid-prefill, the next round marks it dead and the request fails over (here: no decode worker left)
    at once, long before its deadline."""
    async with _pools(model_dir, steps, prefill_up=False) as pools:
        pools.decode.local_prefill = asyncio.Event()  # never set: it prefills until cancelled
        async with grpc.aio.insecure_channel(f"127.0.0.1:{pools.coordinator.port}") as channel:
            call = asyncio.ensure_future(_tokens(_generate(channel)))
            await _until(lambda: pools.decode.requests)
            pools.decode_worker.control.healthy = False
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await call
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert e.value.details() == (f"decode worker {pools.decode_worker.address} went down before its first "
                                     f"token (prefilling the prompt); no ready decode worker to continue on")
        assert await asyncio.wait_for(pools.decode.cancelled.wait(), 5) is True  # the call cancelled: blocks freed


async def test_a_request_finding_its_only_decode_worker_marked_dead_by_a_call_waits_for_its_health_check(
        model_dir):
    """The only decode worker was just marked dead by a call (a stall): a request arriving then waits for the
    worker's next health check, which finds it answering, and is served there. Marked dead again with its
    health check failing too, the next request is refused after that check."""
    async with _pools(model_dir, steps=False, prefill_up=True, refresh_seconds=60) as pools:  # rounds by hand
        pool = pools.coordinator.pool
        worker = pool.workers[pools.decode_worker.address]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{pools.coordinator.port}") as channel:
            await pool.mark_failed(worker, "decode worker sent nothing for 10 s (--stall-timeout)")
            call = asyncio.ensure_future(_tokens(_generate(channel)))
            await asyncio.sleep(3 * STALL)
            assert not call.done() and pool.ready("decode") == []  # waiting, not refused
            await pool.refresh()  # the health check: GetInfo answers
            assert await call == [5, 6, 7]
            pools.decode_worker.control.healthy = False
            await pool.mark_failed(worker, "decode worker sent nothing for 10 s (--stall-timeout)")
            call = asyncio.ensure_future(_tokens(_generate(channel)))
            await asyncio.sleep(3 * STALL)
            assert not call.done()
            await pool.refresh()  # GetInfo fails: dead
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await call
        assert (e.value.code(), e.value.details()) == (grpc.StatusCode.UNAVAILABLE, "no ready decode worker")
        assert [r.local_prefill for r in pools.decode.requests] == [False]  # served once, on the KV path
