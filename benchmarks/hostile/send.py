"""How the hostile harness sends one request to a port and names what came back.

Every request goes out as bytes (an HTTP body, a serialized protobuf, or bytes that are no protobuf at
all), so that what a well-behaved client library would refuse to send still reaches the server. Each
answer becomes an `Outcome`: a client error (HTTP 4xx; a gRPC status in `CLIENT_CODES`; a KServe stream's
in-band `error_message`), served (2xx / OK: allowed, the request may have been valid after all), or a
failure (5xx, any other gRPC status, a reset connection, no answer before the deadline).
"""

from __future__ import annotations

import re
import select
import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

import grpc
import httpx
from tritonclient.grpc import service_pb2

Kind = Literal["client_error", "served", "failure"]

CLIENT_CODES = frozenset({
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ALREADY_EXISTS,
})
"""gRPC statuses that say "your request is wrong" (or "too big / not now"): what bad input must get."""

UNLIMITED = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]


@dataclass(frozen=True)
class Outcome:
    kind: Kind
    code: str
    """HTTP status, gRPC status name, or what went wrong on the wire (reset, hang)."""
    detail: str = ""


def _grpc_outcome(e: grpc.RpcError) -> Outcome:
    code = e.code()
    kind: Kind = "client_error" if code in CLIENT_CODES else "failure"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return Outcome("failure", "hang", f"no answer before the deadline ({e.details()})")
    return Outcome(kind, code.name, (e.details() or "")[:300])


class Ports:
    """One gRPC channel per address (thread-safe) and one httpx client per thread."""

    def __init__(self, http: str, deadline: float):
        self.http = http
        self.deadline = deadline
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()
        self._local = threading.local()

    def channel(self, address: str) -> grpc.Channel:
        with self._lock:
            if address not in self._channels:
                self._channels[address] = grpc.insecure_channel(address, options=UNLIMITED)
            return self._channels[address]

    def client(self) -> httpx.Client:
        if not hasattr(self._local, "client"):
            # A connection per request: a server that closes a connection after a 500 would otherwise
            # reset the next request on it, and that failure would be blamed on the wrong case.
            self._local.client = httpx.Client(base_url=self.http, timeout=self.deadline,
                                              limits=httpx.Limits(max_keepalive_connections=0))
        return self._local.client

    def close(self) -> None:
        for ch in self._channels.values():
            ch.close()

    # --- HTTP -----------------------------------------------------------------------------------

    def post(self, path: str, body: bytes | str, content_type: str = "application/json") -> Outcome:
        """POSTs `body` as is and reads the whole answer (an SSE stream to its end)."""
        data = body.encode("utf-8", "surrogatepass") if isinstance(body, str) else body
        try:
            with self.client().stream("POST", path, content=data, headers={"content-type": content_type}) as r:
                tail = b"".join(r.iter_bytes())[-300:]
        except httpx.TimeoutException as e:
            return Outcome("failure", "hang", f"no answer within {self.deadline:.0f} s ({type(e).__name__})")
        except httpx.HTTPError as e:
            return Outcome("failure", "reset", f"{type(e).__name__}: {e}"[:300])
        return _http_outcome(r.status_code, tail)

    def post_raw(self, path: str, headers: dict[str, str], chunks: Iterable[bytes]) -> Outcome:
        """Writes the request on a socket of its own, chunk by chunk, and stops writing as soon as an
        answer arrives (a server that refuses an oversized body early, as it should, then closes)."""
        url = urlsplit(self.http)
        head = f"POST {path} HTTP/1.1\r\nhost: {url.hostname}\r\nconnection: close\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
        deadline = time.monotonic() + self.deadline
        try:
            with socket.create_connection((url.hostname, url.port), timeout=self.deadline) as s:
                s.sendall(head.encode())
                for chunk in chunks:
                    if select.select([s], [], [], 0)[0]:
                        break  # answered already
                    try:
                        s.sendall(chunk)
                    except (BrokenPipeError, ConnectionResetError):
                        break
                answer = b""
                while b"\r\n" not in answer:
                    s.settimeout(max(0.01, deadline - time.monotonic()))
                    part = s.recv(65536)
                    if not part:
                        break
                    answer += part
        except TimeoutError:
            return Outcome("failure", "hang", f"no answer within {self.deadline:.0f} s")
        except OSError as e:
            return Outcome("failure", "reset", f"{type(e).__name__}: {e}"[:300])
        status = answer.split(b" ", 2)[1] if answer.startswith(b"HTTP/") else b""
        if not status.isdigit():
            return Outcome("failure", "reset", f"the connection closed without an HTTP answer ({answer[:80]!r})")
        return _http_outcome(int(status), answer[-300:])

    # --- gRPC -----------------------------------------------------------------------------------

    def call(self, address: str, method: str, request: bytes, *, streaming: bool = False,
             metadata: tuple[tuple[str, str], ...] = ()) -> Outcome:
        """A unary (or server-streaming) call of `method` with `request` as its serialized message."""
        ch = self.channel(address)
        try:
            if streaming:
                for _ in ch.unary_stream(method)(request, timeout=self.deadline, metadata=metadata):
                    pass
            else:
                ch.unary_unary(method)(request, timeout=self.deadline, metadata=metadata)
        except grpc.RpcError as e:
            return _grpc_outcome(e)
        return Outcome("served", "OK")

    def call_stream(self, address: str, method: str, requests: list[bytes], *, kserve: bool = False,
                    metadata: tuple[tuple[str, str], ...] = ()) -> Outcome:
        """A client-streaming or bidi call; `kserve`: the answers are ModelStreamInferResponses, whose
        error_message is KServe's in-band refusal."""
        ch = self.channel(address)
        errors = []
        try:
            for raw in ch.stream_stream(method)(iter(requests), timeout=self.deadline, metadata=metadata):
                if kserve:
                    message = service_pb2.ModelStreamInferResponse.FromString(raw).error_message
                    if message:
                        errors.append(message)
        except grpc.RpcError as e:
            return _grpc_outcome(e)
        if errors:
            return Outcome("client_error", "error_message", errors[0][:300])
        return Outcome("served", "OK")


def _http_outcome(status: int, tail: bytes) -> Outcome:
    detail = tail.decode("utf-8", "replace")
    if 400 <= status < 500:
        return Outcome("client_error", str(status), detail)
    if 200 <= status < 300:
        if b'"error"' in tail and b"data:" in tail:  # an SSE stream that ended in an error event
            server_side = re.search(rb'"code":\s*5\d\d', tail)
            return Outcome("failure" if server_side else "client_error", f"{status}+error event", detail)
        return Outcome("served", str(status))
    return Outcome("failure", str(status), detail)
