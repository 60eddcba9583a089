#!/usr/bin/env python3
"""grpc.health.v1 check of a local pdserve process: exit 0 when it reports SERVING, 1 otherwise.

The image's HEALTHCHECK runs it, and so do the exec probes of the `mtls` component (kubelet's native
gRPC probes cannot speak TLS). Port and TLS files come from flags or, in the image, the environment:
PDSERVE_HEALTH_PORT, PDSERVE_TLS_CA, PDSERVE_TLS_CERT, PDSERVE_TLS_KEY.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ.get
    p = argparse.ArgumentParser(prog="pdserve-healthcheck", description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=int(env("PDSERVE_HEALTH_PORT", "50051")))
    p.add_argument("--service", default="", help="the health service name ('' = the whole server)")
    p.add_argument("--timeout", type=float, default=2.0)
    p.add_argument("--tls-ca", default=env("PDSERVE_TLS_CA"))
    p.add_argument("--tls-cert", default=env("PDSERVE_TLS_CERT"))
    p.add_argument("--tls-key", default=env("PDSERVE_TLS_KEY"))
    p.add_argument("--tls-server-name", default=env("PDSERVE_TLS_SERVER_NAME"),
                   help="the name the server's certificate carries, when it is not the host")
    return p.parse_args(argv)


def open_channel(args: argparse.Namespace) -> grpc.Channel:
    target = f"{args.host}:{args.port}"
    if not args.tls_ca:
        return grpc.insecure_channel(target)
    read = lambda path: Path(path).read_bytes() if path else None  # noqa: E731
    creds = grpc.ssl_channel_credentials(read(args.tls_ca), read(args.tls_key), read(args.tls_cert))
    options = [("grpc.ssl_target_name_override", args.tls_server_name)] if args.tls_server_name else []
    return grpc.secure_channel(target, creds, options=options)


def check(args: argparse.Namespace) -> str:
    """The reported status name (SERVING, NOT_SERVING, ...) or the gRPC error code's name."""
    with open_channel(args) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
        except grpc.RpcError as e:
            return e.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    status = check(args)
    print(f"{args.host}:{args.port} {args.service or '(server)'}: {status}")
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
