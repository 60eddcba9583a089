"""mTLS on every gRPC link, the API key on the public API, and the transfer token on the KV push
endpoint, against real processes with a throwaway CA."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

from pdserve.kvcache.layout import KvLayout
from pdserve.kvcache.wire import PROTOCOL_VERSION
from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.v1 import worker_pb2 as pb
from pdserve.v1 import worker_pb2_grpc
from pdserve.server.client import open_channel
from pdserve.server.security import ROLE_URI_PREFIX, ROLES, TlsConfig
from tests.e2e.procs import Procs, blocks, generate, list_workers, request, wait_blocks_free, wait_until

API_KEY = "sk-test-1234"


def _pem_key(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def make_pki(out: Path, roles: tuple[str, ...] = ROLES) -> tuple[TlsConfig, TlsConfig]:
    """A CA, and one certificate (127.0.0.1, localhost; server and client use; every cluster role as a
    URI SAN) signed by it. Returns (the processes' TLS, a client with the CA but no certificate)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pdserve test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pdserve")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                 *(x509.UniformResourceIdentifier(f"{ROLE_URI_PREFIX}{r}") for r in roles)]), critical=False)
            .add_extension(x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    (out / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (out / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (out / "key.pem").write_bytes(_pem_key(key))
    return TlsConfig(out / "cert.pem", out / "key.pem", out / "ca.pem"), TlsConfig(ca=out / "ca.pem")


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("security")
    tls, _ = make_pki(tmp)
    procs = Procs(tiny_model("llama"), tmp, tls=tls)
    try:
        coordinator = procs.coordinator("coordinator", "--api-key", API_KEY)
        procs.worker("p0", "prefill", coordinator, wait=False)
        procs.worker("d0", "decode", coordinator, "--kv-port", "0")
        wait_until(lambda: [w.state for w in list_workers(coordinator)] == ["ready", "ready"], "p0 and d0 ready")
        yield procs
    finally:
        procs.stop_all()


def test_mtls_everywhere_and_the_api_key(cluster):
    coordinator, tls = cluster.procs["coordinator"], cluster.tls
    auth = (("authorization", f"Bearer {API_KEY}"),)
    # the whole path (client -> coordinator -> prefill -> decode KV push -> decode) runs over mTLS
    tokens = generate(coordinator.address, request([3, 4, 5], 6), metadata=auth, tls=tls)
    assert len(tokens) == 6
    for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", API_KEY),)):
        with pytest.raises(grpc.RpcError) as e:
            generate(coordinator.address, request([3, 4, 5], 6), metadata=metadata, tls=tls)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "API key" in e.value.details()
    with open_channel(coordinator.address, tls) as ch:  # health stays open to probes (over mTLS)
        assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status == \
            health_pb2.HealthCheckResponse.SERVING
        kserve = service_pb2_grpc.GRPCInferenceServiceStub(ch)  # KServe: liveness open, inference guarded
        assert kserve.ServerLive(service_pb2.ServerLiveRequest(), timeout=5).live
        with pytest.raises(grpc.RpcError) as e:
            kserve.ModelInfer(service_pb2.ModelInferRequest(model_name="x"), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    (cluster.tmp / "stranger").mkdir(exist_ok=True)
    stranger, _ = make_pki(cluster.tmp / "stranger")  # a certificate from a CA the servers do not trust
    for bad_tls in (None, TlsConfig(ca=tls.ca), stranger):  # plaintext; no client certificate; untrusted one
        with pytest.raises(grpc.RpcError) as e:
            generate(coordinator.address, request([3, 4, 5], 6), metadata=auth, tls=bad_tls, timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_kv_push_needs_the_coordinator_issued_transfer_token(cluster):
    d0, tls = cluster.procs["d0"], cluster.tls
    with open_channel(d0.address, tls) as ch:
        info = worker_pb2_grpc.ControlStub(ch).GetInfo(pb.GetInfoRequest(), timeout=5)
        assert info.kv_address and info.kv_address != d0.address  # --kv-port: KvTransfer on its own port
        call = worker_pb2_grpc.DecodeStub(ch).Decode(pb.DecodeRequest(
            request_id="victim", prompt_token_ids=[3, 4, 5], sampling=gen_pb.SamplingParams(max_tokens=4),
            transfer_token=b"s" * 16, lease_seconds=60))
        assert next(call).WhichOneof("event") == "reserved"
        with pytest.raises(grpc.RpcError) as e:  # the main port does not serve KvTransfer
            worker_pb2_grpc.KvTransferStub(ch).PushKv(iter([pb.KvChunk(header=pb.KvHeader(request_id="x"))]), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
        layout = KvLayout.from_proto(info.kv_layout).to_proto()

        def push(token: bytes, request_id: str = "victim") -> grpc.RpcError:
            header = pb.KvHeader(request_id=request_id, attempt=0, transfer_token=token, fingerprint=info.fingerprint,
                                 layout=layout, num_tokens=3)
            with open_channel(info.kv_address, tls) as kv:
                with pytest.raises(grpc.RpcError) as e:
                    worker_pb2_grpc.KvTransferStub(kv).PushKv(
                        iter([pb.KvChunk(header=header), pb.KvChunk(end=pb.KvEnd(first_token_id=1))]), timeout=5)
            return e.value

        assert push(b"").code() == grpc.StatusCode.PERMISSION_DENIED
        assert "no transfer token" in push(b"").details()
        assert push(b"w" * 16).code() == grpc.StatusCode.PERMISSION_DENIED
        assert "wrong transfer token" in push(b"w" * 16).details()
        assert push(b"s" * 16, request_id="nobody").code() == grpc.StatusCode.NOT_FOUND
        assert blocks(d0)[0] == blocks(d0)[1] - 1  # the refused pushes wrote nothing; still waiting
        call.cancel()
        assert wait_blocks_free([d0])[0] == (blocks(d0)[1], blocks(d0)[1])
        # Before a prefill worker begins the request no lease runs (it may queue): the call's deadline ends it
        call = worker_pb2_grpc.DecodeStub(ch).Decode(pb.DecodeRequest(
            request_id="queued", prompt_token_ids=[3, 4, 5], sampling=gen_pb.SamplingParams(max_tokens=4),
            transfer_token=b"q" * 16, lease_seconds=0.3), timeout=1.5)
        assert next(call).WhichOneof("event") == "reserved"
        with pytest.raises(grpc.RpcError) as e:
            next(call)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED  # the call's own deadline, not the lease:
        assert "did not arrive" not in e.value.details(), e.value.details()
        # KV that stops coming once the prefill began: the worker frees the reservation when the lease ends
        call = worker_pb2_grpc.DecodeStub(ch).Decode(pb.DecodeRequest(
            request_id="orphan", prompt_token_ids=[3, 4, 5], sampling=gen_pb.SamplingParams(max_tokens=4),
            transfer_token=b"o" * 16, lease_seconds=0.3), timeout=30)
        assert next(call).WhichOneof("event") == "reserved"
        with open_channel(info.kv_address, tls) as kv:
            worker_pb2_grpc.KvTransferStub(kv).BeginKv(pb.KvHeader(
                request_id="orphan", attempt=0, transfer_token=b"o" * 16, fingerprint=info.fingerprint,
                layout=layout, num_tokens=3, protocol_version=PROTOCOL_VERSION), timeout=5)
        with pytest.raises(grpc.RpcError) as e:
            next(call)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert e.value.details() == "KV for orphan did not arrive within 0.3 s"
    free, total = wait_blocks_free([d0])[0]
    assert free == total
