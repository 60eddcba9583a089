"""deploy/healthcheck.py (the image's HEALTHCHECK and the mtls component's probes) against real servers."""

from __future__ import annotations

import datetime
import importlib.util
import ipaddress
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tests.deploy.manifests import DEPLOY

spec = importlib.util.spec_from_file_location("pdserve_healthcheck", DEPLOY / "healthcheck.py")
healthcheck = importlib.util.module_from_spec(spec)
spec.loader.exec_module(healthcheck)


def start_server(credentials: grpc.ServerCredentials | None = None) -> tuple[grpc.Server, health.HealthServicer, int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = (server.add_secure_port("127.0.0.1:0", credentials) if credentials
            else server.add_insecure_port("127.0.0.1:0"))
    server.start()
    return server, servicer, port


def test_plaintext_statuses():
    server, servicer, port = start_server()
    try:
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert healthcheck.main([f"--port={port}"]) == 1
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert healthcheck.main([f"--port={port}"]) == 0
        assert healthcheck.check(healthcheck.parse_args([f"--port={port}", "--service=nope"])) == "NOT_FOUND"
    finally:
        server.stop(None)
    assert healthcheck.check(healthcheck.parse_args([f"--port={port}", "--timeout=0.5"])) in ("UNAVAILABLE", "DEADLINE_EXCEEDED")


def test_port_from_the_environment(monkeypatch):
    monkeypatch.setenv("PDSERVE_HEALTH_PORT", "50053")
    assert healthcheck.parse_args([]).port == 50053


def _cert(name: str, issuer_key, issuer_name, key, ca: bool = False, ip: str | None = None) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
               .issuer_name(issuer_name or x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=1)).not_valid_after(now + datetime.timedelta(hours=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ip:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(ip))]),
                                        critical=False)
    if not ca:
        builder = builder.add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, Path]:
    """A CA and one certificate for 127.0.0.1, as the mtls component's CSI volume lays them out."""
    pem = lambda c: c.public_bytes(serialization.Encoding.PEM)  # noqa: E731
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = _cert("pdserve-ca", ca_key, None, ca_key, ca=True)
    cert = _cert("pod", ca_key, ca.subject, key, ip="127.0.0.1")
    files = {"ca": tmp_path / "ca.crt", "cert": tmp_path / "tls.crt", "key": tmp_path / "tls.key"}
    files["ca"].write_bytes(pem(ca))
    files["cert"].write_bytes(pem(cert))
    files["key"].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
    return files


def test_mutual_tls(pki, monkeypatch):
    credentials = grpc.ssl_server_credentials([(pki["key"].read_bytes(), pki["cert"].read_bytes())],
                                              root_certificates=pki["ca"].read_bytes(), require_client_auth=True)
    server, servicer, port = start_server(credentials)
    try:
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        # What the mtls component sets: the files by environment, the port by flag.
        monkeypatch.setenv("PDSERVE_TLS_CA", str(pki["ca"]))
        monkeypatch.setenv("PDSERVE_TLS_CERT", str(pki["cert"]))
        monkeypatch.setenv("PDSERVE_TLS_KEY", str(pki["key"]))
        assert healthcheck.main([f"--port={port}"]) == 0
        # Without a client certificate the server refuses the handshake.
        monkeypatch.delenv("PDSERVE_TLS_CERT")
        monkeypatch.delenv("PDSERVE_TLS_KEY")
        assert healthcheck.check(healthcheck.parse_args([f"--port={port}"])) == "UNAVAILABLE"
    finally:
        server.stop(None)
