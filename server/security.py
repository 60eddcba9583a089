"""TLS for every gRPC link, and the API key for the public API.

TLS: a process given `--tls-cert/--tls-key` serves TLS with that identity and presents it as a client
too; `--tls-ca` is the CA it trusts, and on a server it also requires client certificates (mTLS).
API key: the public services need metadata `authorization: Bearer KEY`; `api_key_ok` is the same
check for the HTTP front.
"""

from __future__ import annotations

import hmac
import os
from dataclasses import dataclass
from pathlib import Path

import grpc

API_KEY_ENV = "PDSERVE_API_KEY"
PUBLIC_SERVICES = ("pdserve.v1.Generation",)
"""What needs the API key: services, or single methods as `service/Method` (internal services rely on
mTLS; health and reflection stay open to probes)."""


@dataclass(frozen=True)
class TlsConfig:
    cert: Path | None = None
    key: Path | None = None
    ca: Path | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        for flag, path in (("--tls-cert", self.cert), ("--tls-key", self.key), ("--tls-ca", self.ca)):
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{flag}: {path} is not a file")

    @property
    def enabled(self) -> bool:
        return self.cert is not None or self.ca is not None

    def server_credentials(self) -> grpc.ServerCredentials:
        if self.cert is None or self.key is None:
            raise ValueError("serving TLS needs --tls-cert and --tls-key")
        ca = Path(self.ca).read_bytes() if self.ca else None
        return grpc.ssl_server_credentials(
            [(Path(self.key).read_bytes(), Path(self.cert).read_bytes())],
            root_certificates=ca,
            require_client_auth=ca is not None,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=Path(self.ca).read_bytes() if self.ca else None,
            private_key=Path(self.key).read_bytes() if self.key else None,
            certificate_chain=Path(self.cert).read_bytes() if self.cert else None,
        )


def resolve_api_key(flag: str | None) -> str | None:
    """--api-key, else $PDSERVE_API_KEY, else None (no key needed)."""
    return flag or os.environ.get(API_KEY_ENV) or None


def api_key_ok(authorization: str | None, api_key: str) -> bool:
    """Whether an `authorization` header/metadata value is `Bearer <api_key>` (constant time)."""
    return hmac.compare_digest((authorization or "").encode(), f"Bearer {api_key}".encode())


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls to the public services without `authorization: Bearer KEY` (UNAUTHENTICATED)."""

    def __init__(self, api_key: str, services: tuple[str, ...] = PUBLIC_SERVICES):
        self.api_key = api_key
        self.prefixes = tuple(f"/{s}" if "/" in s else f"/{s}/" for s in services)

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or not details.method.startswith(self.prefixes):
            return handler
        metadata = dict(details.invocation_metadata or ())
        if api_key_ok(metadata.get("authorization"), self.api_key):
            return handler
        return _denied(handler, "missing or wrong API key: send metadata 'authorization: Bearer <key>'")


def _denied(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    async def unary(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def streaming(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover  (makes this an async generator)

    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(
        streaming if handler.response_streaming else unary,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
