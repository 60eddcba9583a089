"""What every pdserve process shares: a grpc.aio server with health and reflection, on uvloop.

`configure(tls, cluster_secret)` once at start-up makes every server and channel of the process use TLS
(mTLS when a CA is given) and the cluster credential: channels send the secret, servers refuse internal
calls without it (and, under mTLS, from certificates without an allowed role). `WorkerOptions` are the
flags every worker shares (registration, metrics, KV port).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve.server.malformed import MalformedInterceptor
from pdserve.server.security import ClusterAuth, ClusterAuthInterceptor, TlsConfig, cluster_secret_interceptors

from pdserve.kvcache.grpc_sender import CHANNEL_OPTIONS, MAX_MESSAGE_BYTES  # noqa: F401  (one definition, re-exported)

RETRY_AFTER_MS = 500
"""The hint (ms) a refusal for lack of room carries (`retry-after-ms`), from a worker or the coordinator."""
RETRY_HINT = "retry-after-ms"
"""The metadata key of that hint (a worker's initial metadata, the coordinator's trailing metadata)."""


def retry_hint(ms: int = RETRY_AFTER_MS) -> tuple[tuple[str, str]]:
    """The metadata of a refusal the client may retry after `ms` milliseconds."""
    return ((RETRY_HINT, str(ms)),)

log = logging.getLogger("pdserve")

_tls: TlsConfig | None = None
_cluster_secret: str | None = None


@dataclass(frozen=True)
class WorkerOptions:
    """Flags every worker shares, beside its tier's config."""

    coordinator: str | None = None
    """HOST:PORT of the coordinator to register with and heartbeat (None: static, from its flags)."""
    advertise_address: str | None = None
    """HOST:PORT peers dial (default: --host:--port)."""
    metrics_port: int = 0
    kv_port: int | None = None
    """Decode: serve KvTransfer on its own server on this port (0 picks one; None: the main port)."""
    drain_seconds: float = 60.0
    """On SIGTERM, how long in-flight requests may take before the worker exits anyway."""


def configure(tls: TlsConfig | None, cluster_secret: str | None = None) -> None:
    """Every server and channel this process makes from now on uses `tls` (None or disabled: plaintext)
    and the cluster credential (`cluster_secret`, and role-bound certificates under mTLS)."""
    global _tls, _cluster_secret
    _tls = tls if tls is not None and tls.enabled else None
    _cluster_secret = cluster_secret
    if cluster_auth() is None:
        log.warning("internal RPCs are unauthenticated: anyone who reaches a port can register workers or call "
                    "them; set --cluster-secret-file (pdserve up does) or mTLS with role certificates")


def tls_config() -> TlsConfig | None:
    """The process's TLS (None: plaintext); the HTTP front serves HTTPS with the same files."""
    return _tls


def cluster_auth() -> ClusterAuth | None:
    """How this process's servers check internal calls (None: they do not)."""
    auth = ClusterAuth(_cluster_secret, role_bound=_tls is not None and _tls.ca is not None and _tls.cert is not None)
    return auth if auth.enabled else None


def server_interceptors() -> list[Any]:
    auth = cluster_auth()
    return [ClusterAuthInterceptor(auth)] if auth is not None else []


def channel_interceptors() -> list[Any] | None:
    return cluster_secret_interceptors(_cluster_secret) if _cluster_secret is not None else None


def channel_credentials() -> grpc.ChannelCredentials | None:
    return _tls.channel_credentials() if _tls is not None else None


def new_server(
    service_names: list[str], port: int, host: str = "127.0.0.1", interceptors: Sequence[Any] = (),
    reuse_port: bool | None = None,
) -> tuple[grpc.aio.Server, health.aio.HealthServicer, int]:
    """A server with grpc.health.v1 and reflection added; the caller adds its own servicers.
    reuse_port: SO_REUSEPORT on or off (None: gRPC's default, on)."""
    options = [*CHANNEL_OPTIONS, *([("grpc.so_reuseport", int(reuse_port))] if reuse_port is not None else [])]
    server = grpc.aio.server(options=options,
                             interceptors=[*server_interceptors(), *interceptors, MalformedInterceptor()])
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    bound = add_port(server, port, host)
    return server, health_servicer, bound


def add_port(server: grpc.aio.Server, port: int, host: str = "127.0.0.1") -> int:
    """Listens on host:port (TLS when configured); returns the bound port."""
    address = f"{host}:{port}"
    try:
        bound = (server.add_secure_port(address, _tls.server_credentials()) if _tls is not None
                 else server.add_insecure_port(address))
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise SystemExit(f"cannot listen on {host}:{port}: is the port in use? Choose another with --port")
    return bound


async def set_serving(health_servicer: health.aio.HealthServicer, names: list[str], serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *names]:
        await health_servicer.set(name, status)


def channel(address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
    """options: more channel arguments, after CHANNEL_OPTIONS."""
    all_options = [*CHANNEL_OPTIONS, *options]
    if _tls is not None:
        return grpc.aio.secure_channel(address, _tls.channel_credentials(), options=all_options,
                                       interceptors=channel_interceptors())
    return grpc.aio.insecure_channel(address, options=all_options, interceptors=channel_interceptors())


async def drain(health_servicer: health.aio.HealthServicer, names: list[str], busy: Callable[[], bool],
                seconds: float, beat: Callable[[], Coroutine[Any, Any, None]] | None = None) -> None:
    """SIGTERM: NOT_SERVING, tell the coordinator (one heartbeat with draining set), then wait up to
    `seconds` for `busy()` to turn False. The caller has already made its servicers refuse new work."""
    await set_serving(health_servicer, names, False)
    if beat is not None:
        try:
            await beat()
        except Exception as e:  # the coordinator may be gone; GetInfo reports draining too
            log.warning("could not tell the coordinator this worker drains: %r", e)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    if busy():
        log.info("draining: waiting up to %.0f s for in-flight requests", seconds)
    while busy() and loop.time() < deadline:
        await asyncio.sleep(0.05)
    if busy():
        log.warning("drain: in-flight requests still running after %.0f s; stopping anyway", seconds)


def run(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Runs an async main on uvloop; Ctrl-C and SIGTERM end it cleanly. Once it has stopped, every object
    left is frozen out of the garbage collector: the interpreter's exit then skips collecting the heap that
    torch, JAX and the model built (seconds of a stopping worker's CPU, for memory the exit frees anyway)."""
    import gc

    import uvloop

    try:
        uvloop.run(main())
    except KeyboardInterrupt:
        pass
    finally:
        gc.freeze()


async def wait_for_signal() -> None:
    """Returns on SIGINT or SIGTERM."""
    import signal

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
