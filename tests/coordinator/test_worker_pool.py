"""The live pool on its own: registration and its refusals, heartbeats, draining, health rounds."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.v1 import worker_pb2 as pb
from pdserve.server.coordinator.router import Router
from pdserve.server.coordinator.worker_pool import RegistrationRefused, Worker, WorkerPool
from tests.coordinator.fakes import FakeDecode, FakeWorker
from tests.coordinator.fakes import worker_info as info


async def test_register_refuses_another_model_or_kv_layout_naming_both():
    pool = WorkerPool(heartbeat_timeout=5)
    await pool.register(info("decode", "d:1"))
    await pool.register(info("prefill", "p:1"))
    with pytest.raises(RegistrationRefused) as e:
        await pool.register(info("decode", "d:2", digest="zzz"))
    assert str(e.value) == (
        "decode worker d:2 serves model zzz (tiny llama) but the pool serves abc (tiny llama) (decode worker d:1): "
        "every worker must serve the same checkpoint"
    )
    other = pb.KvLayout(num_layers=2, num_kv_heads=2, head_dim=32, block_size=32, dtype="float32")
    with pytest.raises(RegistrationRefused) as e:
        await pool.register(info("decode", "d:3", layout=other))
    assert "block_size=32" in str(e.value) and "block_size=16" in str(e.value) and "d:1" in str(e.value)
    assert sorted(pool.workers) == ["d:1", "p:1"]
    assert [w.state for w in pool.workers.values()] == ["ready", "ready"]
    await pool.close()


async def test_draining_is_sticky_and_missed_heartbeats_mean_dead():
    decode = await FakeWorker.start("decode", FakeDecode())
    pool = WorkerPool(refresh_seconds=0.05, heartbeat_timeout=0.3)
    router = Router(pool)
    worker = await pool.register(info("decode", decode.address))
    assert router.pick_decode() is worker and pool.serving
    draining = info("decode", decode.address)
    draining.draining = True
    assert await pool.heartbeat(draining) is True
    assert worker.state == "draining" and router.pick_decode() is None and not pool.serving
    await pool.refresh()  # GetInfo still answers (not draining): the worker stays draining
    assert worker.state == "draining"
    lost = worker.lost
    await asyncio.sleep(0.35)
    await pool.refresh()  # no heartbeat for longer than the timeout
    assert worker.state == "dead" and lost.is_set()
    assert await pool.heartbeat(info("decode", "unknown:1")) is False  # unknown: register again
    await pool.close()
    await decode.stop()


async def test_a_worker_marked_failed_by_a_call_is_back_after_one_health_round_a_dead_one_stays_out():
    """A call found the worker silent (--stall-timeout) or unreachable: `mark_failed` routes around it.
    The next GetInfo round readmits the one that answers (from flags, or registered: its heartbeat does
    too); the one that does not answer stays out, round after round."""
    alive, gone, joined = [await FakeWorker.start("decode", FakeDecode()) for _ in range(3)]
    pool = WorkerPool(refresh_seconds=60, heartbeat_timeout=60)  # the rounds are run by hand
    a, g = pool.add(Worker(alive.address, "decode")), pool.add(Worker(gone.address, "decode"))
    r = await pool.register(info("decode", joined.address))
    await pool.refresh()
    assert pool.ready("decode") == [a, g, r]
    await gone.stop()
    for worker in (a, g, r):
        await pool.mark_failed(worker, "decode worker sent nothing for 10 s (--stall-timeout)")
    assert pool.ready("decode") == [] and not pool.serving and pool.awaiting_recheck("decode")
    await pool.refresh()  # one round
    assert pool.ready("decode") == [a, r] and pool.serving and not pool.awaiting_recheck("decode")
    for _ in range(3):
        await pool.refresh()
    assert pool.ready("decode") == [a, r] and g.state == "dead"
    await pool.mark_failed(r, "decode worker sent nothing for 10 s (--stall-timeout)")
    assert await pool.heartbeat(info("decode", joined.address)) is True  # a registered worker's heartbeat
    assert pool.ready("decode") == [a, r]
    await pool.close()
    await alive.stop()
    await joined.stop()


async def test_a_worker_slow_to_answer_getinfo_stays_ready_until_silent_for_the_heartbeat_timeout():
    """Under load a live worker may miss one GetInfo deadline: its streams must not be cut for it. Silent
    for longer than heartbeat_timeout, it is dead (a hung process); a refused connection is dead at once."""
    slow, gone = [await FakeWorker.start("decode", FakeDecode()) for _ in range(2)]
    # GetInfo's deadline is 1 s: silent >= 2 s after round 2, >= 3 s after round 3 (whatever the load adds)
    pool = WorkerPool(refresh_seconds=0.1, heartbeat_timeout=2.8)
    s, g = pool.add(Worker(slow.address, "decode")), pool.add(Worker(gone.address, "decode"))
    await pool.refresh()
    assert pool.ready("decode") == [s, g]
    slow.control.delay = 1.5
    await gone.stop()
    await pool.refresh()  # s misses the deadline 1 s after its last answer; g refuses
    assert s.state == "ready" and not s.lost.is_set() and g.state == "dead"
    await pool.refresh()  # about 2 s without an answer: still within heartbeat_timeout
    assert s.state == "ready"
    await pool.refresh()  # 3 s or more
    assert s.state == "dead" and s.lost.is_set()
    slow.control.delay = 0.0
    await pool.refresh()
    assert s.state == "ready"
    await pool.close()
    await slow.stop()


def test_a_windowed_decode_worker_needs_no_blocks_behind_every_layers_window():
    """blocks_for counts what the decode scheduler admits: a 100-token prompt in blocks of 16 takes 7 blocks with
    a global layer; with every layer windowed (W 32) the first query (position 100) reads keys 69.., so the 4
    blocks before 64 are not taken. Blocks a shared prompt's leader holds count once, whichever covers more."""
    full = pb.KvLayout(num_layers=2, num_kv_heads=2, head_dim=32, block_size=16, dtype="float32",
                       layer_windows=[32, 0])
    windowed = pb.KvLayout(num_layers=2, num_kv_heads=2, head_dim=32, block_size=16, dtype="float32",
                           layer_windows=[32, 32])
    mixed, local = (Worker("d:1", "decode", info("decode", "d:1", layout=layout)) for layout in (full, windowed))
    assert (mixed.blocks_for(100), local.blocks_for(100)) == (7, 3)
    assert (mixed.blocks_for(100, shared=6), local.blocks_for(100, shared=2), local.blocks_for(100, shared=6)) == \
        (1, 3, 1)
    assert local.blocks_for(20) == 2  # shorter than the window: every block
