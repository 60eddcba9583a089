"""`--registry-port`: the worker registry on an internal port only; the public port then serves the
public services alone (the registry there answers UNIMPLEMENTED)."""

from __future__ import annotations

import grpc

from pdserve.v1 import worker_pb2 as pb
from pdserve.v1 import worker_pb2_grpc
from tests.coordinator.fakes import start_fake_pools


async def test_the_registry_leaves_the_public_port(tiny_model):
    pools = await start_fake_pools(tiny_model("llama"), registry_port=0)
    coordinator = pools.coordinator
    try:
        assert coordinator.registry_port not in (0, coordinator.port)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{coordinator.port}") as ch:
            try:
                await worker_pb2_grpc.RegistryStub(ch).ListWorkers(pb.ListWorkersRequest(), timeout=5)
                raise AssertionError("the public port served the registry")
            except grpc.aio.AioRpcError as e:
                assert e.code() == grpc.StatusCode.UNIMPLEMENTED
        async with grpc.aio.insecure_channel(f"127.0.0.1:{coordinator.registry_port}") as ch:
            reply = await worker_pb2_grpc.RegistryStub(ch).ListWorkers(pb.ListWorkersRequest(), timeout=5)
        assert sorted(w.role for w in reply.workers) == ["decode", "prefill"]
    finally:
        await pools.stop()
