"""The handoff's lease and failures with the real tiers in one process: coordinator, a JAX prefill
worker and a torch decode worker on 127.0.0.1, KV over gRPC."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from pdserve.v1 import generation_pb2_grpc
from pdserve.server import metrics
from pdserve.server.client import build_request
from pdserve.server.coordinator.config import CoordinatorConfig
from pdserve.server.decode.config import DecodeConfig
from pdserve.server.prefill.config import PrefillConfig


class Cluster:
    def __init__(self, prefill, decode, coordinator) -> None:
        self.prefill, self.decode, self.coordinator = prefill, decode, coordinator
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{coordinator.port}")
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)

    async def generate(self, ids: list[int], max_tokens: int = 4) -> list[int]:
        out: list[int] = []
        request = build_request(token_ids=ids, max_tokens=max_tokens, temperature=0, ignore_eos=True)
        async for response in self.stub.Generate(request, timeout=120):
            out.extend(response.token_ids)
        return out

    def free_blocks(self) -> tuple[int, int]:
        """(blocks free or evictable: cached blocks no sequence holds and ended sequences' tails, all blocks)."""
        engine = self.decode.engine
        return engine.num_free_blocks, engine.pool.num_total

    async def stop(self) -> None:
        await self.channel.close()
        await self.coordinator.stop(0)
        await self.prefill.stop(0)
        await self.decode.stop(0)


@pytest.fixture
async def cluster(tiny_model):
    from pdserve.server.coordinator.main import start as start_coordinator
    from pdserve.server.decode.main import start as start_decode
    from pdserve.server.prefill.main import start as start_prefill

    path = tiny_model("llama")
    prefill = await start_prefill(PrefillConfig(model_dir=path, max_batch_size=1, kv_streams=2))
    decode = await start_decode(DecodeConfig(model_dir=path, kv_cache_tokens=4096))
    coordinator = await start_coordinator(CoordinatorConfig(
        path, port=0, prefill_addresses=[f"127.0.0.1:{prefill.port}"], decode_addresses=[f"127.0.0.1:{decode.port}"],
        refresh_seconds=0.1, lease_seconds=0.5,
    ))
    for _ in range(100):
        if coordinator.pool.ready("prefill") and coordinator.pool.ready("decode"):
            break
        await asyncio.sleep(0.05)
    c = Cluster(prefill, decode, coordinator)
    yield c
    await c.stop()


def _prefill_retries() -> float:
    """pdserve_prefill_retries over every identity (this one process serves all three roles)."""
    family = metrics.prefill_retries.families[0]
    return sum(s.value for m in family.collect() for s in m.samples if s.name == "pdserve_prefill_retries_total")


async def test_a_long_prefill_queue_does_not_expire_leases(cluster):
    run = cluster.prefill.service.engine._run

    def slow(*step):  # one prompt at a time, 0.2 s each: the 10th waits ~2 s, 4 leases
        time.sleep(0.2)
        return run(*step)

    cluster.prefill.service.engine._run = slow
    retries = _prefill_retries()
    prompts = [[5 + i, 6, 7, 8, 9] for i in range(10)]
    outputs = await asyncio.gather(*(cluster.generate(p) for p in prompts))
    assert [len(o) for o in outputs] == [4] * 10
    assert _prefill_retries() == retries  # no re-prefill
    assert outputs[0] == await cluster.generate(prompts[0])  # the same tokens when alone
    assert cluster.free_blocks()[0] == cluster.free_blocks()[1]


async def test_a_push_that_fails_before_its_header_frees_the_decode_blocks_within_a_second(cluster):
    service = cluster.prefill.service
    opened = service.transport.open

    async def unreachable(address, header, layout):
        raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                   "failed to connect to all addresses")

    service.transport.open = unreachable
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await cluster.generate([5, 6, 7])
    failed_at = time.monotonic()
    assert err.value.code() == grpc.StatusCode.ABORTED
    assert "could not start: UNAVAILABLE: failed to connect to all addresses" in err.value.details()
    while cluster.free_blocks()[0] != cluster.free_blocks()[1] and time.monotonic() < failed_at + 1.0:
        await asyncio.sleep(0.01)
    assert cluster.free_blocks()[0] == cluster.free_blocks()[1]
    assert cluster.decode.service.receiver.pending() == 0
    service.transport.open = opened
    assert len(await cluster.generate([5, 6, 7])) == 4  # the worker serves the next request
