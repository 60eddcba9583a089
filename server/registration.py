"""A worker's membership in its coordinators' pools (`--coordinator`): Register, then Heartbeat.

`--coordinator` names one coordinator or several replicas: a comma-separated list of HOST:PORT, where a
HOST may be a DNS name resolving to every replica (a Kubernetes headless service). `Memberships` keeps one
`Registration` per resolved address and resolves the names again every `resolve_seconds`: a replica that
appears is joined, one that is gone from DNS is let go. One replica down never stops the worker serving
the others.

For each coordinator:
1. `start()` registers (waiting up to `connect_seconds` for the coordinator to come up). A refusal
   (FAILED_PRECONDITION: another model or KV layout) raises SystemExit with the coordinator's message.
   A replica found later registers from its first heartbeat (it answers `known=False`).
2. A background task heartbeats the worker's info (load, draining) every `heartbeat_seconds`; when
   the coordinator answers `known=False` (it restarted) the worker registers again.
3. On SIGTERM the worker sets draining and calls `beat()` at once, so no new work is routed to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from collections.abc import Callable

import grpc

from pdserve.v1 import worker_pb2 as pb
from pdserve.v1 import worker_pb2_grpc
from pdserve.server.serving import channel

log = logging.getLogger("pdserve.registration")


class Registration:
    def __init__(self, coordinator: str, info: Callable[[], pb.WorkerInfo], *, connect_seconds: float = 60.0):
        self.coordinator = coordinator
        self.info = info
        self.connect_seconds = connect_seconds
        self.heartbeat_seconds = 0.5
        self._channel = channel(coordinator)
        self._stub = worker_pb2_grpc.RegistryStub(self._channel)
        self._task: asyncio.Task[None] | None = None

    async def start(self, wait: bool = True) -> None:
        """wait: register now (SystemExit when it cannot); else from the first heartbeat on."""
        if wait:
            await self._register(wait=True)
        self._task = asyncio.create_task(self._beat_forever(), name=f"heartbeat-{self.coordinator}")

    async def _register(self, wait: bool) -> None:
        info = self.info()
        try:
            reply = await self._stub.Register(
                pb.RegisterRequest(info=info), timeout=self.connect_seconds if wait else 5.0, wait_for_ready=wait
            )
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise SystemExit(f"the coordinator at {self.coordinator} refused this worker: {e.details()}") from e
            if wait:
                raise SystemExit(
                    f"cannot register with the coordinator at {self.coordinator}: {e.code().name} {e.details()}"
                ) from e
            raise
        if reply.heartbeat_seconds > 0:
            self.heartbeat_seconds = reply.heartbeat_seconds
        log.info("registered as %s worker %s with the coordinator at %s", info.role, info.address, self.coordinator)

    async def beat(self) -> None:
        """One heartbeat now (registers again when the coordinator does not know this worker)."""
        reply = await self._stub.Heartbeat(pb.HeartbeatRequest(info=self.info()), timeout=2.0)
        if not reply.known:
            log.warning("the coordinator at %s does not know this worker; registering again", self.coordinator)
            await self._register(wait=False)

    async def _beat_forever(self) -> None:
        failing = False
        while True:
            await asyncio.sleep(self.heartbeat_seconds)
            try:
                await self.beat()
                if failing:
                    log.info("heartbeats reach the coordinator at %s again", self.coordinator)
                failing = False
            except SystemExit as e:  # refused on re-registration: a new pool with another model
                log.error("%s", e)
                raise
            except grpc.aio.AioRpcError as e:
                if not failing:
                    log.warning("heartbeat to %s failed: %s %s", self.coordinator, e.code().name, e.details())
                failing = True

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, SystemExit):
                await self._task
        await self._channel.close()


RESOLVE_SECONDS = 10.0
"""How often `--coordinator`'s DNS names are resolved again (replicas come and go)."""


def coordinator_names(spec: str) -> list[tuple[str, int]]:
    """`--coordinator`'s comma-separated HOST:PORT entries; SystemExit naming a bad one."""
    names = []
    for entry in (e.strip() for e in spec.split(",")):
        host, sep, port = entry.rpartition(":")
        if not entry or not sep or not host or not port.isdigit():
            raise SystemExit(f"--coordinator: {entry!r} is not HOST:PORT (a list: HOST:PORT,HOST:PORT)")
        names.append((host.strip("[]"), int(port)))
    return names


def resolve(names: list[tuple[str, int]]) -> list[str]:
    """Every address the names resolve to (an IP stays itself; a DNS name gives all its IPv4 addresses,
    else all of its addresses), in order, without duplicates; a name that does not resolve gives none."""
    out: list[str] = []
    for host, port in names:
        try:
            ipaddress.ip_address(host)
            found = [host]
        except ValueError:
            found = []
            for family in (socket.AF_INET, socket.AF_UNSPEC):
                with contextlib.suppress(OSError):
                    found = [info[4][0] for info in socket.getaddrinfo(host, port, family, socket.SOCK_STREAM)]
                if found:
                    break
            if not found:
                log.warning("--coordinator: %s does not resolve (yet)", host)
        for ip in found:
            address = f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
            if address not in out:
                out.append(address)
    return out


class Memberships:
    """One Registration per coordinator replica the `--coordinator` names resolve to, kept in step with DNS."""

    def __init__(self, spec: str, info: Callable[[], pb.WorkerInfo], *, resolve_seconds: float = RESOLVE_SECONDS,
                 connect_seconds: float = 60.0):
        self.names = coordinator_names(spec)
        self.info = info
        self.resolve_seconds = resolve_seconds
        self.connect_seconds = connect_seconds
        self.registrations: dict[str, Registration] = {}
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Registers with every replica found now (SystemExit if none resolves, or one refuses or never
        answers within connect_seconds), then follows DNS."""
        addresses = await asyncio.to_thread(resolve, self.names)
        if not addresses:
            raise SystemExit(f"--coordinator: {', '.join(h for h, _ in self.names)} resolves to no address; "
                             f"check the name (a headless service lists its ready replicas)")
        for address in addresses:
            self.registrations[address] = Registration(address, self.info, connect_seconds=self.connect_seconds)
        for registration in self.registrations.values():  # one by one: a refusal's SystemExit must not
            await registration.start()  # leave a task of asyncio.gather (it escapes the event loop there)
        self._task = asyncio.create_task(self._follow_dns(), name="coordinator-dns")

    async def _follow_dns(self) -> None:
        while True:
            await asyncio.sleep(self.resolve_seconds)
            addresses = await asyncio.to_thread(resolve, self.names)
            if not addresses:
                continue  # DNS hiccup: keep the replicas known
            for address in addresses:
                if address not in self.registrations:
                    log.info("coordinator replica %s appeared; joining its pool", address)
                    registration = self.registrations[address] = Registration(address, self.info)
                    await registration.start(wait=False)
            for address in [a for a in self.registrations if a not in addresses]:
                log.info("coordinator replica %s is gone from DNS; leaving it", address)
                await self.registrations.pop(address).close()

    async def beat(self) -> None:
        """One heartbeat to every replica now (one unreachable does not stop the others)."""
        for address, registration in list(self.registrations.items()):
            try:
                await registration.beat()
            except grpc.aio.AioRpcError as e:
                log.warning("heartbeat to %s failed: %s %s", address, e.code().name, e.details())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await asyncio.gather(*(r.close() for r in self.registrations.values()))


async def join(worker, coordinator: str, info: Callable[[], pb.WorkerInfo]) -> None:
    """Registers a started worker with every coordinator replica (`worker.registration`); a refusal stops
    it and exits non-zero."""
    worker.registration = Memberships(coordinator, info)
    try:
        await worker.registration.start()
    except SystemExit:
        await worker.stop(0)
        raise


async def serve_until_signal(worker, role: str, drain_seconds: float) -> None:
    """Serves until SIGINT or SIGTERM, then drains (in-flight work finishes) and stops."""
    from pdserve.server.serving import wait_for_signal

    await wait_for_signal()
    log.info("%s worker draining", role)
    await worker.drain(drain_seconds)
    log.info("%s worker stopping", role)
    await worker.stop()
