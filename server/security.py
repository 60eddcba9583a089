"""TLS for every gRPC link, the API key for the public API, the cluster credential for internal ones.

TLS: a process given `--tls-cert/--tls-key` serves TLS with that identity and presents it as a client
too; `--tls-ca` is the CA it trusts, and on a server it also requires client certificates (mTLS). The
servers load renewed certificate files at the next handshake (`CertFiles`), the HTTPS front too.
API key: the public services need metadata `authorization: Bearer KEY`; `api_key_ok` is the same
check for the HTTP front.
Cluster credential: every internal call (INTERNAL_CALLERS: registry, prefill, decode, KV push,
control) carries the cluster secret (`--cluster-secret-file`) when one is set, and under mTLS comes
from a certificate whose URI SAN `urn:pdserve:role:<role>` names a role allowed for the method;
`ClusterAuthInterceptor` refuses the rest (UNAUTHENTICATED / PERMISSION_DENIED) before the servicer runs.
"""

from __future__ import annotations

import hmac
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import grpc

API_KEY_ENV = "PDSERVE_API_KEY"
PUBLIC_SERVICES = ("pdserve.v1.Generation",)
"""What needs the API key: services, or single methods as `service/Method` (internal services need the
cluster credential instead; health and reflection stay open to probes)."""


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
        """TLS that follows the files: a renewed certificate (or CA) serves the next handshakes."""
        if self.cert is None or self.key is None:
            raise ValueError("serving TLS needs --tls-cert and --tls-key")
        files = CertFiles(self)
        return grpc.dynamic_ssl_server_credentials(files.grpc_config(), files.grpc_changed,
                                                   require_client_authentication=self.ca is not None)

    def ssl_context(self):
        """An `ssl.SSLContext` for HTTPS with the same certificate, reloaded when its files change
        (`watch_ssl_context`). Public HTTP clients authenticate with the API key, not certificates."""
        import ssl

        if self.cert is None or self.key is None:
            raise ValueError("serving HTTPS needs --tls-cert and --tls-key")
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.cert, self.key)
        return context

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=Path(self.ca).read_bytes() if self.ca else None,
            private_key=Path(self.key).read_bytes() if self.key else None,
            certificate_chain=Path(self.cert).read_bytes() if self.cert else None,
        )


class CertFiles:
    """The TLS files and when they last changed (cert-manager's CSI driver renews them in place)."""

    def __init__(self, tls: TlsConfig):
        self.tls = tls
        self.paths = [Path(p) for p in (tls.cert, tls.key, tls.ca) if p is not None]
        self.stamp = self._stamp()

    def _stamp(self) -> tuple:
        try:
            return tuple((p.stat().st_mtime_ns, p.stat().st_size) for p in self.paths)
        except OSError:
            return ()

    def changed(self) -> bool:
        """True once after the files change (and are all readable again)."""
        stamp = self._stamp()
        if not stamp or stamp == self.stamp:
            return False
        self.stamp = stamp
        return True

    def grpc_config(self):
        return grpc.ssl_server_certificate_configuration(
            [(Path(self.tls.key).read_bytes(), Path(self.tls.cert).read_bytes())],
            root_certificates=Path(self.tls.ca).read_bytes() if self.tls.ca else None,
        )

    def grpc_changed(self):
        """grpc's fetcher (called at handshakes): the new configuration once the files changed, else None."""
        if not self.changed():
            return None
        try:
            config = self.grpc_config()
        except Exception as e:  # a half-written renewal: keep serving the old one until the next change
            logging.getLogger("pdserve").warning("TLS files changed but cannot be loaded (%r); keeping the old", e)
            return None
        logging.getLogger("pdserve").info("TLS certificate reloaded from %s", self.tls.cert)
        return config


async def watch_ssl_context(context, tls: TlsConfig, every: float = 1.0) -> None:
    """Reloads `context`'s certificate whenever the files change (new handshakes use the new one)."""
    import asyncio

    files = CertFiles(tls)
    while True:
        await asyncio.sleep(every)
        if files.changed():
            try:
                context.load_cert_chain(tls.cert, tls.key)
                logging.getLogger("pdserve").info("HTTPS certificate reloaded from %s", tls.cert)
            except Exception as e:
                logging.getLogger("pdserve").warning("HTTPS certificate files changed but cannot be loaded: %r", e)


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

    return _same_kind(handler, unary, streaming)


# ---- the cluster credential: what every internal call carries ---------------------------------------

CLUSTER_SECRET_HEADER = "x-pdserve-cluster-secret"
CLUSTER_SECRET_ENV = "PDSERVE_CLUSTER_SECRET_FILE"
MIN_SECRET_CHARS = 16
ROLE_URI_PREFIX = "urn:pdserve:role:"
"""A worker certificate carries its role as a URI SAN: `urn:pdserve:role:decode`."""
CallerRole = str
ROLES = ("coordinator", "prefill", "decode", "operator")

INTERNAL_CALLERS: dict[str, tuple[CallerRole, ...]] = {
    "pdserve.v1.Registry/Register": ("prefill", "decode"),
    "pdserve.v1.Registry/Heartbeat": ("prefill", "decode"),
    "pdserve.v1.Registry": ("coordinator", "prefill", "decode", "operator"),
    "pdserve.v1.Prefill": ("coordinator",),
    "pdserve.v1.Decode": ("coordinator",),
    "pdserve.v1.Control": ("coordinator", "operator"),
    "pdserve.v1.KvTransfer": ("prefill",),
}
"""Internal services (or `service/Method`, which wins) and the certificate roles that may call them."""


def read_cluster_secret(path: Path | str) -> str:
    """The secret in `path` (surrounding whitespace dropped); ValueError when unreadable or too short."""
    try:
        secret = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--cluster-secret-file {path}: cannot read it ({e})") from e
    if len(secret) < MIN_SECRET_CHARS:
        raise ValueError(f"--cluster-secret-file {path}: the secret has {len(secret)} characters; "
                         f"use at least {MIN_SECRET_CHARS} (e.g. `openssl rand -hex 32 > {path}`)")
    return secret


def resolve_cluster_secret(flag: Path | None) -> str | None:
    """--cluster-secret-file, else $PDSERVE_CLUSTER_SECRET_FILE, else None (no secret)."""
    path = flag or os.environ.get(CLUSTER_SECRET_ENV) or None
    return read_cluster_secret(path) if path else None


def write_cluster_secret(path: Path) -> Path:
    """A fresh random secret, readable by its owner only."""
    import secrets

    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    return path


def cluster_secret_ok(metadata, secret: str) -> bool:
    given = dict(metadata or ()).get(CLUSTER_SECRET_HEADER, "")
    return hmac.compare_digest(given.encode() if isinstance(given, str) else given, secret.encode())


def peer_roles(context: grpc.aio.ServicerContext) -> set[CallerRole]:
    """The roles in the caller's verified certificate's URI SANs (empty without a client certificate)."""
    auth = context.auth_context() or {}
    names = [*auth.get("x509_subject_alternative_name", ()), *auth.get("peer_uri", ())]
    roles = set()
    for name in names:
        text = name.decode(errors="replace") if isinstance(name, bytes) else str(name)
        if text.startswith(ROLE_URI_PREFIX):
            roles.add(text[len(ROLE_URI_PREFIX):])
    return roles


@dataclass(frozen=True)
class ClusterAuth:
    """How a server checks internal calls: the shared secret (when set) and, under mTLS, the caller's role."""

    secret: str | None = None
    role_bound: bool = False
    """mTLS: the caller's certificate must carry a role allowed for the method (INTERNAL_CALLERS)."""

    @property
    def enabled(self) -> bool:
        return self.secret is not None or self.role_bound

    def refusal(self, method: str, context: grpc.aio.ServicerContext) -> tuple[grpc.StatusCode, str] | None:
        """Why `context`'s caller may not call `method` (a status and a message), or None."""
        allowed = allowed_roles(method)
        if allowed is None:
            return None
        if self.secret is not None and not cluster_secret_ok(context.invocation_metadata(), self.secret):
            return (grpc.StatusCode.UNAUTHENTICATED,
                    f"{method} is internal: it needs the cluster secret (metadata {CLUSTER_SECRET_HEADER}, "
                    f"from --cluster-secret-file)")
        if self.role_bound:
            roles = peer_roles(context)
            if not roles & set(allowed):
                return (grpc.StatusCode.PERMISSION_DENIED,
                        f"{method} is internal: the caller's certificate carries roles "
                        f"{sorted(roles) or 'none'}; it needs a URI SAN {ROLE_URI_PREFIX}<role> with a role in "
                        f"{list(allowed)}")
        return None


def allowed_roles(method: str) -> tuple[CallerRole, ...] | None:
    """The roles that may call a `/service/Method` path, or None for a public method."""
    service, _, name = method.lstrip("/").partition("/")
    return INTERNAL_CALLERS.get(f"{service}/{name}", INTERNAL_CALLERS.get(service))


class ClusterAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses internal calls without the cluster credential (UNAUTHENTICATED / PERMISSION_DENIED).

    The check runs inside the handler, where the caller's certificate (auth context) is visible."""

    def __init__(self, auth: ClusterAuth):
        self.auth = auth

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or allowed_roles(details.method) is None:
            return handler
        return _checked(handler, lambda context: self.auth.refusal(details.method, context))


def _checked(handler: grpc.RpcMethodHandler, refusal) -> grpc.RpcMethodHandler:
    """`handler` behind a check made on each call's context before the servicer runs."""
    import inspect

    behavior = (handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream)

    async def unary(request_or_iterator, context):
        problem = refusal(context)
        if problem is not None:
            await context.abort(*problem)
        return await behavior(request_or_iterator, context)

    async def streaming(request_or_iterator, context):
        problem = refusal(context)
        if problem is not None:
            await context.abort(*problem)
        result = behavior(request_or_iterator, context)
        if inspect.isasyncgen(result):
            async for response in result:
                yield response
        else:
            await result

    return _same_kind(handler, unary, streaming)


class _SecretMetadata:
    def __init__(self, secret: str):
        self.pair = (CLUSTER_SECRET_HEADER, secret)

    def _details(self, d: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(d.metadata or ()), self.pair)
        return grpc.aio.ClientCallDetails(d.method, d.timeout, metadata, d.credentials, d.wait_for_ready)


class _UnaryUnary(_SecretMetadata, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _UnaryStream(_SecretMetadata, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _StreamUnary(_SecretMetadata, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


class _StreamStream(_SecretMetadata, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


def cluster_secret_interceptors(secret: str) -> list:
    """Client interceptors that add the cluster secret to every call of a grpc.aio channel (one per
    call kind: a channel files each interceptor under the first kind it is)."""
    return [kind(secret) for kind in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]


_HANDLER_KINDS = {  # (request streaming, response streaming) -> the grpc handler factory
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def _same_kind(handler, unary, streaming):
    """A handler of `handler`'s kind and (de)serializers running `unary` or `streaming` instead."""
    make = _HANDLER_KINDS[(handler.request_streaming, handler.response_streaming)]
    return make(
        streaming if handler.response_streaming else unary,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
