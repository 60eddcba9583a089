"""pdserve.v1.Registry on the coordinator: workers join, heartbeat, and `pdserve status` lists them."""

from __future__ import annotations

import time

import grpc

from pdserve.v1 import worker_pb2 as pb
from pdserve.v1 import worker_pb2_grpc
from pdserve.server.coordinator.worker_pool import RegistrationRefused, WorkerPool
from pdserve.server.security import ROLE_URI_PREFIX, peer_roles

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Registry"].full_name


def claim_problem(info: pb.WorkerInfo) -> str | None:
    """What is impossible in a worker's own account of itself (capacities it cannot have), or None."""
    load = info.load
    if load.total_kv_blocks < 0 or not 0 <= load.free_kv_blocks <= load.total_kv_blocks:
        return (f"load: free_kv_blocks {load.free_kv_blocks} must lie in [0, total_kv_blocks "
                f"{load.total_kv_blocks}]")
    for name in ("running_requests", "waiting_requests", "queued_prefill_tokens", "max_running_requests"):
        if getattr(load, name) < 0:
            return f"load: {name} must be >= 0, got {getattr(load, name)}"
    if info.max_model_len < 0:
        return f"max_model_len must be >= 0, got {info.max_model_len}"
    return None


class RegistryService(worker_pb2_grpc.RegistryServicer):
    def __init__(self, pool: WorkerPool, heartbeat_seconds: float, role_bound: bool = False):
        self.pool = pool
        self.heartbeat_seconds = heartbeat_seconds
        self.role_bound = role_bound
        """mTLS: a worker's certificate must carry the role it registers as."""

    async def _check_claim(self, info: pb.WorkerInfo, context: grpc.aio.ServicerContext) -> None:
        if self.role_bound and info.role not in peer_roles(context):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"a {info.role or '?'} worker's certificate must carry the URI SAN "
                                f"{ROLE_URI_PREFIX}{info.role or '<role>'}; this one carries roles "
                                f"{sorted(peer_roles(context)) or 'none'}")
        problem = claim_problem(info)
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)

    async def Register(self, request: pb.RegisterRequest, context: grpc.aio.ServicerContext) -> pb.RegisterResponse:
        await self._check_claim(request.info, context)
        try:
            await self.pool.register(request.info)
        except RegistrationRefused as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        return pb.RegisterResponse(heartbeat_seconds=self.heartbeat_seconds)

    async def Heartbeat(self, request: pb.HeartbeatRequest, context) -> pb.HeartbeatResponse:
        await self._check_claim(request.info, context)
        return pb.HeartbeatResponse(known=await self.pool.heartbeat(request.info))

    async def ListWorkers(self, request: pb.ListWorkersRequest, context) -> pb.ListWorkersResponse:
        now = time.monotonic()
        workers = sorted(self.pool.workers.values(), key=lambda w: (w.role != "prefill", w.address))
        return pb.ListWorkersResponse(workers=[
            pb.WorkerStatus(
                info=w.info, state=w.state, registered=w.registered, inflight=w.inflight, role=w.role,
                address=w.address, seconds_since_seen=now - w.last_seen if w.last_seen else -1.0,
            )
            for w in workers
        ])
