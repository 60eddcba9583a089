"""Picking: the policies, and the tier queue requests wait in for a worker with room."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest
from pdserve.server.choices import DECODE_POLICIES, PREFILL_POLICIES
from pdserve.server.coordinator.admission import Deadline, RequestFailed, TierQueue
from pdserve.server.coordinator.policies import (
    DECODE_PICKERS,
    LARGE_POOL,
    PREFILL_PICKERS,
    most_free_blocks,
    power_of_two,
    prefix_aware,
    route_key,
)
from pdserve.server.coordinator.router import Router
from pdserve.server.coordinator.worker_pool import Worker, WorkerPool

from tests.coordinator.fakes import worker_info as info


def _worker(address: str, free: int, cap: int = 0, running: int = 0) -> Worker:
    return Worker(address, "decode", info("decode", address, free=free, max_running_requests=cap,
                                          running_requests=running), ready=True)


def test_decode_policies_skip_workers_at_their_cap_or_without_room():
    full = _worker("a", free=90, cap=2, running=2)
    small = _worker("b", free=2)
    roomy = _worker("c", free=50)
    assert most_free_blocks([full, small, roomy], tokens=16) is roomy
    assert most_free_blocks([full, small, roomy], tokens=50 * 16 + 1) is None  # 51 blocks fit nowhere
    assert most_free_blocks([full, small], tokens=16) is small
    workers = [_worker(f"w{i}", free=10 + i) for i in range(8)]
    picks = {power_of_two(workers, 16, random.Random(seed)).address for seed in range(40)}
    assert "w0" not in picks  # the emptier of two never loses to w0, the fullest
    assert len(picks) > 2  # and the load spreads
    assert most_free_blocks(workers, 16) is workers[-1]  # a small pool: always the emptiest
    large = [_worker(f"w{i}", free=10 + i) for i in range(LARGE_POOL)]
    picks = {most_free_blocks(large, 16, random.Random(seed)).address for seed in range(40)}
    assert "w0" not in picks and len(picks) > 2  # a large pool: power of two choices, no herd


def test_every_policy_the_config_takes_has_its_picker():
    assert tuple(PREFILL_PICKERS) == PREFILL_POLICIES and tuple(DECODE_PICKERS) == DECODE_POLICIES


async def test_tier_queue_waits_for_room_then_refuses_past_its_size():
    pool = WorkerPool()
    router = Router(pool)
    worker = pool.add(_worker("d:1", free=0))
    queue = TierQueue("decode", max_size=1)
    pick = lambda: router.pick_decode(16)  # noqa: E731
    waiting = asyncio.create_task(queue.acquire(pool, pick, Deadline.after(5)))
    await asyncio.sleep(0.05)
    assert queue.waiting == 1
    with pytest.raises(RequestFailed) as e:
        await queue.acquire(pool, pick, Deadline.after(5))
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert e.value.metadata == (("retry-after-ms", "500"),)
    worker.info.load.free_kv_blocks = 10  # room: the waiter gets the worker
    pool.poke()
    assert await asyncio.wait_for(waiting, 2) is worker
    worker.info.load.free_kv_blocks = 0
    with pytest.raises(RequestFailed) as e:
        await queue.acquire(pool, pick, Deadline.after(0.1))
    assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and queue.waiting == 0
    await pool.close()


def test_a_worker_with_queue_room_takes_what_fits_nowhere_now():
    busy = Worker("q", "decode", info("decode", "q", free=1, max_running_requests=4, running_requests=4,
                                      waiting_requests=1, max_waiting_requests=2), ready=True)
    longer = Worker("r", "decode", info("decode", "r", free=1, max_running_requests=4, running_requests=4,
                                        waiting_requests=2, max_waiting_requests=3), ready=True)
    assert most_free_blocks([busy, longer], tokens=64) is busy  # the shorter worker queue
    busy.inflight = 7  # this coordinator's own picks fill it: 4 running + 2 waiting + one more
    assert most_free_blocks([busy, longer], tokens=64) is longer
    longer.inflight = 7
    assert most_free_blocks([busy, longer], tokens=64) is None  # the coordinator's queue holds it


def test_prefix_aware_routes_a_shared_prefix_to_one_worker_until_it_carries_too_much():
    workers = [_worker(f"w{i}", free=100) for i in range(4)]
    system = list(range(1000, 1064))  # LAYOUT's block size 16: 4 full blocks
    home = prefix_aware(workers, 80, prompt=system + [1])
    assert all(prefix_aware(workers, 80, prompt=system + [i, i + 1]) is home for i in range(20))
    other = [prefix_aware(workers, 80, prompt=[i] * 64) for i in range(40)]
    assert len({w.address for w in other}) == 4  # other prefixes spread over the pool
    home.inflight = 3  # mean load (3 + 1) / 4 = 1, bound ceil(1.25) = 2: home is over it
    spill = prefix_aware(workers, 80, prompt=system + [1])
    assert spill is not home and spill.inflight == 0
    assert route_key(system[:15], 16) is None  # no full block: most-free-blocks decides
    for w in workers[:3]:
        w.info.load.free_kv_blocks = 50
    assert prefix_aware(workers, 15, prompt=system[:15]) is workers[3]


async def test_tier_queue_serves_waiters_in_arrival_order():
    pool = WorkerPool()
    router = Router(pool)
    worker = pool.add(_worker("d:1", free=0))
    queue = TierQueue("decode", max_size=4)
    order = []

    async def wait(name: str, tokens: int) -> None:
        await queue.acquire(pool, lambda: router.pick_decode(tokens), Deadline.after(5))
        order.append(name)

    big = asyncio.create_task(wait("big", 16 * 8))
    await asyncio.sleep(0.02)
    small = asyncio.create_task(wait("small", 16))
    await asyncio.sleep(0.02)
    worker.info.load.free_kv_blocks = 2  # the small one would fit, the big one is first
    pool.poke()
    await asyncio.sleep(0.3)
    assert order == [] and queue.waiting == 2
    worker.info.load.free_kv_blocks = 8
    pool.poke()
    await asyncio.wait_for(asyncio.gather(big, small), 2)
    assert order == ["big", "small"] and queue.waiting == 0
    await pool.close()
