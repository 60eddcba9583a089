"""Raw bytes at an internal gRPC port (in process, no cluster): without the cluster credential every call is
refused (UNAUTHENTICATED) whatever its bytes; with it, malformed or oversized bytes are INVALID_ARGUMENT or
RESOURCE_EXHAUSTED naming the message, never UNKNOWN, and the server keeps answering (server/malformed.py
inside server/security.py's check, both installed by serving.new_server)."""

from __future__ import annotations

import grpc
import pytest

from pdserve.v1 import worker_pb2
from pdserve.server import serving
from pdserve.server.security import CLUSTER_SECRET_HEADER
from tests.coordinator.fakes import FakeControl, FakeDecode

SECRET = "malformed-bytes-secret-0123456789"
GET_INFO = "/pdserve.v1.Control/GetInfo"  # unary
DECODE = "/pdserve.v1.Decode/Decode"  # server streaming
MALFORMED = [b"\xff\xff\xff", b"\x0a\x05ab", b"\x0a" + b"\xff" * 10, b"\x12\xff\xff\xff\xff\x0f",
             bytes(range(256))]
"""Corrupt whatever the message: a bad tag, lengths past the end, a varint that never ends, field 0."""


@pytest.fixture
async def internal_port():
    serving.configure(None, SECRET)
    try:
        server, _, port = serving.new_server(["pdserve.v1.Control", "pdserve.v1.Decode"], 0)
        FakeControl("decode").add_to(server)
        FakeDecode().add_to(server)
        await server.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}",
                                             options=[("grpc.max_send_message_length", 80 * 2**20)]) as channel:
            yield channel
        await server.stop(0)
    finally:
        serving.configure(None, None)


async def _call(channel: grpc.aio.Channel, method: str, raw: bytes, secret: str | None) -> tuple[grpc.StatusCode, str]:
    identity = {"request_serializer": lambda b: b, "response_deserializer": lambda b: b}
    metadata = ((CLUSTER_SECRET_HEADER, secret),) if secret else None
    try:
        if method == DECODE:
            [_ async for _ in channel.unary_stream(method, **identity)(raw, timeout=10, metadata=metadata)]
        else:
            await channel.unary_unary(method, **identity)(raw, timeout=10, metadata=metadata)
    except grpc.RpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


async def test_internal_port_refuses_without_the_credential_and_never_fails_on_bytes(internal_port):
    valid = worker_pb2.GetInfoRequest().SerializeToString()
    for raw in [valid, *MALFORMED]:
        for secret in (None, "wrong-secret-but-long-enough-000"):
            for method in (GET_INFO, DECODE):
                code, details = await _call(internal_port, method, raw, secret)
                assert code == grpc.StatusCode.UNAUTHENTICATED and "cluster secret" in details, (method, raw, code)
    for raw in MALFORMED:
        for method in (GET_INFO, DECODE):
            code, details = await _call(internal_port, method, raw, SECRET)
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "not a valid message for " + method in details, (
                method, raw, code, details)
    code, _ = await _call(internal_port, GET_INFO, b"\x00" * (65 * 2**20), SECRET)  # over the 64 MiB limit
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    code, _ = await _call(internal_port, GET_INFO, valid, SECRET)
    assert code == grpc.StatusCode.OK
