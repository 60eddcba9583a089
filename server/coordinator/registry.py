"""pdserve.v1.Registry on the coordinator: workers join, heartbeat, and `pdserve status` lists them."""

from __future__ import annotations

import time

import grpc

from pdserve.v1 import worker_pb2 as pb
from pdserve.v1 import worker_pb2_grpc
from pdserve.server.coordinator.router import RegistrationRefused, WorkerPool

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Registry"].full_name


class RegistryService(worker_pb2_grpc.RegistryServicer):
    def __init__(self, pool: WorkerPool, heartbeat_seconds: float):
        self.pool = pool
        self.heartbeat_seconds = heartbeat_seconds

    async def Register(self, request: pb.RegisterRequest, context: grpc.aio.ServicerContext) -> pb.RegisterResponse:
        try:
            await self.pool.register(request.info)
        except RegistrationRefused as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        return pb.RegisterResponse(heartbeat_seconds=self.heartbeat_seconds)

    async def Heartbeat(self, request: pb.HeartbeatRequest, context) -> pb.HeartbeatResponse:
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
