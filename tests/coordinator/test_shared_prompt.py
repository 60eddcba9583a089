"""n > 1 through the OpenAI front, against scripted workers (two of each tier): choice 0 goes first, the
other choices follow its prompt KV to its decode and prefill workers (reserving only their own blocks),
fall back to another decode worker when that one is full, and all end when the client goes."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import grpc
import httpx
import prometheus_client
import pytest

from pdserve.server.coordinator.config import CoordinatorConfig
from pdserve.server.coordinator.main import Coordinator, start
from tests.coordinator.fakes import FakeDecode, FakePrefill, FakeWorker

MODEL = "llama-float32"
PROMPT = list(range(3, 43))
"""40 tokens: 2 full blocks of 16 and a partial one."""


class LoggedDecode(FakeDecode):
    """Logs ("decode", seed) when a Decode call comes and ("kv", seed) when its KV does."""

    def __init__(self, log: list[tuple[str, int, int]], index: int):
        super().__init__()
        self.log = log
        self.index = index
        self.refuse_after_kv = False
        """Once it received a KV, refuse every further call for room (it is full)."""

    def push_kv(self, request) -> None:
        self.log.append(("kv", request.sampling.seed, self.index))
        super().push_kv(request)
        if self.refuse_after_kv:
            self.refuse = grpc.StatusCode.RESOURCE_EXHAUSTED

    async def Decode(self, request, context):
        self.log.append(("decode", request.sampling.seed, self.index))
        async for response in super().Decode(request, context):
            yield response


@dataclass
class Pools:
    coordinator: Coordinator
    decodes: list[LoggedDecode]
    prefills: list[FakePrefill]
    log: list[tuple[str, int, int]]
    base: str

    def script(self, ids: list[int], finish: int | None = 2) -> None:
        for p in self.prefills:
            p.first_token_id = ids[0]
        for d in self.decodes:
            d.events = [[i] for i in ids[1:]]
            d.finish = finish


@pytest.fixture
async def pools(tiny_model):
    log: list[tuple[str, int, int]] = []
    decodes = [LoggedDecode(log, i) for i in range(2)]
    prefills = [FakePrefill() for _ in range(2)]
    workers = [await FakeWorker.start("decode", d) for d in decodes] + [await FakeWorker.start("prefill", p)
                                                                         for p in prefills]
    for p in prefills:
        p.decoders = {w.address: d for w, d in zip(workers, decodes)}
    coordinator = await start(CoordinatorConfig(
        tiny_model("llama"), port=0, http_port=0, refresh_seconds=0.1, lease_seconds=5,
        decode_addresses=[w.address for w in workers[:2]], prefill_addresses=[w.address for w in workers[2:]]))
    for _ in range(100):
        if len(coordinator.pool.ready("prefill")) == 2 and len(coordinator.pool.ready("decode")) == 2:
            break
        await asyncio.sleep(0.05)
    assert coordinator.http is not None
    yield Pools(coordinator, decodes, prefills, log, f"http://127.0.0.1:{coordinator.http.port}")
    await coordinator.stop(0)
    for w in workers:
        await w.stop()


def _shared(route: str) -> float:
    return prometheus_client.REGISTRY.get_sample_value(
        "pdserve_shared_prompt_choices_total", {"model_name": MODEL, "role": "coordinator", "route": route}) or 0.0


@pytest.mark.parametrize("stream", [False, True])
async def test_choices_follow_choice_0s_kv_to_its_decode_and_prefill_workers(pools, stream):
    pools.script([5, 6, 7])
    shared = _shared("shared")
    async with httpx.AsyncClient(base_url=pools.base, timeout=10) as client:
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "n": 3, "seed": 7,
                                                       "max_tokens": 3, "stream": stream})
    assert r.status_code == 200
    leader = pools.log[0][2]
    # choice 0's KV reached its decode worker before any other choice was routed; they all went there
    assert pools.log[:2] == [("decode", 7, leader), ("kv", 7, leader)]
    assert sorted(pools.log[2:]) == [("decode", 8, leader), ("decode", 9, leader), ("kv", 8, leader),
                                     ("kv", 9, leader)]
    prefill = [p for p in pools.prefills if p.requests]
    assert len(prefill) == 1 and [q.sampling.seed for q in prefill[0].requests][0] == 7
    assert sorted(q.sampling.seed for q in prefill[0].requests) == [7, 8, 9]
    assert _shared("shared") - shared == 2


async def test_a_full_decode_worker_sends_the_other_choices_elsewhere(pools):
    pools.script([5, 6])
    for d in pools.decodes:
        d.refuse_after_kv = True  # the first to receive a KV (choice 0's) is full afterwards
    own = _shared("own")
    async with httpx.AsyncClient(base_url=pools.base, timeout=10) as client:
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "n": 3, "max_tokens": 2})
    assert r.status_code == 200
    assert [c["finish_reason"] for c in r.json()["choices"]] == ["length"] * 3
    leader = pools.log[0][2]
    served = [(kind, i) for kind, _, i in pools.log if kind == "kv"]
    assert served[0] == ("kv", leader) and sorted(served[1:]) == [("kv", 1 - leader)] * 2
    assert _shared("own") - own == 2


async def test_choices_reserve_only_their_own_blocks_and_all_end_when_the_client_goes(pools):
    pools.script([5, 6], finish=None)  # decode hangs after its events, until cancelled
    async with httpx.AsyncClient(base_url=pools.base, timeout=10) as client:
        request = asyncio.create_task(client.post(
            "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "n": 3, "max_tokens": 8}))
        workers = pools.coordinator.pool.workers.values()
        for _ in range(200):
            if sum(w.inflight for w in workers if w.role == "decode") == 3:
                break
            await asyncio.sleep(0.02)
        leader = next(w for w in workers if w.role == "decode" and w.inflight)
        assert leader.inflight == 3
        # 40 tokens: 3 blocks for choice 0, 1 each for the others (the 2 full blocks are shared)
        assert leader.reserved_blocks == 3 + 1 + 1
        request.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await request
    for _ in range(500):  # 10 s: under the whole suite's load the cancels take seconds to go round
        if all(w.inflight == 0 for w in workers):
            break
        await asyncio.sleep(0.02)
    assert [(w.inflight, w.reserved_blocks) for w in workers] == [(0, 0)] * 4
    assert all(d.cancelled.is_set() for d in pools.decodes if any(i == d.index for _, _, i in pools.log))
