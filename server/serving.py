"""What every pdserve process shares: a grpc.aio server with health and reflection, on uvloop."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

MAX_MESSAGE_BYTES = 64 * 2**20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]

log = logging.getLogger("pdserve")


def new_server(service_names: list[str], port: int, host: str = "127.0.0.1") -> tuple[grpc.aio.Server, health.aio.HealthServicer, int]:
    """A server with grpc.health.v1 and reflection added; the caller adds its own servicers."""
    server = grpc.aio.server(options=CHANNEL_OPTIONS)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise SystemExit(f"cannot listen on {host}:{port}: is the port in use? Choose another with --port")
    return server, health_servicer, bound


async def set_serving(health_servicer: health.aio.HealthServicer, names: list[str], serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *names]:
        await health_servicer.set(name, status)


def channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)


def run(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Runs an async main on uvloop; Ctrl-C and SIGTERM end it cleanly."""
    import uvloop

    try:
        uvloop.run(main())
    except KeyboardInterrupt:
        pass


async def wait_for_signal() -> None:
    """Returns on SIGINT or SIGTERM."""
    import signal

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
