"""uvicorn serving an ASGI app on the coordinator's own (uv)loop, started and stopped with it.

`uvicorn.Server.serve()` would install its own SIGINT/SIGTERM handlers over the process's; this drives
its public startup / main_loop / shutdown steps instead, on a socket bound here (so a taken port is
reported clearly and port 0 resolves to the port bound).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from dataclasses import dataclass

import uvicorn


@dataclass
class HttpServer:
    server: uvicorn.Server
    task: asyncio.Task[None]
    port: int
    watcher: asyncio.Task[None] | None = None
    """Reloads the HTTPS certificate when its files change."""

    async def stop(self, grace: float = 5.0) -> None:
        """Stops accepting, lets open requests finish for `grace` seconds, then closes them."""
        if self.watcher is not None:
            self.watcher.cancel()
        self.server.should_exit = True
        self.server.config.timeout_graceful_shutdown = grace
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


def _bind(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """reuse_port: SO_REUSEPORT, so several coordinator replicas on one host share the port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise SystemExit(
            f"cannot listen for HTTP on {host}:{port} ({e}): choose another with --http-port"
        ) from e
    sock.setblocking(False)
    return sock


async def start(app, host: str, port: int, tls=None, reuse_port: bool = False) -> HttpServer:
    """tls: a security.TlsConfig with a certificate: serve HTTPS, following renewals of its files."""
    sock = _bind(host, port, reuse_port)
    config = uvicorn.Config(
        app, log_config=None, access_log=False, lifespan="off", ws="none", timeout_keep_alive=30
    )
    config.load()
    watcher = None
    if tls is not None and tls.cert is not None:
        from pdserve.server.security import watch_ssl_context

        config.ssl = tls.ssl_context()  # uvicorn passes config.ssl to create_server
        watcher = asyncio.create_task(watch_ssl_context(config.ssl, tls))
    server = uvicorn.Server(config)
    server.lifespan = config.lifespan_class(config)
    await server.startup(sockets=[sock])

    async def run() -> None:
        try:
            await server.main_loop()
        finally:
            await server.shutdown(sockets=[sock])
            sock.close()

    return HttpServer(server, asyncio.create_task(run()), sock.getsockname()[1], watcher)
