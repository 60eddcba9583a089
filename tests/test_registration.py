"""A worker's membership in several coordinator replicas: `--coordinator` lists and DNS names."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.v1 import worker_pb2 as pb
from pdserve.v1 import worker_pb2_grpc
from pdserve.server.coordinator.registry import RegistryService
from pdserve.server.coordinator.worker_pool import WorkerPool
from pdserve.server.registration import Memberships, coordinator_names, resolve
from pdserve.server.serving import new_server


def test_coordinator_names_take_a_comma_separated_list_and_name_a_bad_entry():
    assert coordinator_names("10.0.0.1:50051, coord.ns.svc:7000") == [("10.0.0.1", 50051), ("coord.ns.svc", 7000)]
    with pytest.raises(SystemExit, match=r"--coordinator: 'nohost' is not HOST:PORT"):
        coordinator_names("10.0.0.1:50051,nohost")


def test_resolve_keeps_ips_expands_names_and_drops_duplicates():
    assert resolve([("127.0.0.1", 1), ("127.0.0.1", 1), ("::1", 2)]) == ["127.0.0.1:1", "[::1]:2"]
    assert resolve([("localhost", 5)]) == ["127.0.0.1:5"]  # IPv4 first: what a headless Service lists
    assert resolve([("name.that.does.not.resolve.invalid", 5)]) == []


async def _registry() -> tuple[WorkerPool, object, str]:
    pool = WorkerPool(refresh_seconds=60)
    server, _, port = new_server([], 0)
    worker_pb2_grpc.add_RegistryServicer_to_server(RegistryService(pool, heartbeat_seconds=0.05), server)
    await server.start()
    return pool, server, f"127.0.0.1:{port}"


def _info() -> pb.WorkerInfo:
    return pb.WorkerInfo(role="prefill", address="127.0.0.1:9", fingerprint=pb.ModelFingerprint(digest="d"))


async def test_a_worker_joins_every_replica_and_one_replica_down_stops_no_heartbeat_to_the_others():
    (pool_a, server_a, a), (pool_b, server_b, b) = await _registry(), await _registry()
    memberships = Memberships(f"{a},{b}", _info, resolve_seconds=0.05)
    await memberships.start()
    try:
        assert [list(pool.workers) for pool in (pool_a, pool_b)] == [["127.0.0.1:9"], ["127.0.0.1:9"]]
        await server_a.stop(0)  # replica a dies
        seen = pool_b.workers["127.0.0.1:9"].last_heartbeat
        await memberships.beat()  # logs a's failure, reaches b
        assert pool_b.workers["127.0.0.1:9"].last_heartbeat > seen
        await asyncio.sleep(0.2)  # the DNS follower keeps both (a list of IPs does not change)
        assert sorted(memberships.registrations) == sorted([a, b])
    finally:
        await memberships.close()
        await server_b.stop(0)
