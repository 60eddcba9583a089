"""Under mTLS a certificate's role decides what it may call: a client certificate cannot register or
call a worker, a worker cannot register as another role, only the coordinator calls workers, only a
prefill worker pushes KV; the public API stays open to any trusted client."""

from __future__ import annotations

import socket
import ssl

import grpc
import httpx
import pytest

from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.v1 import worker_pb2 as pb
from pdserve.v1 import worker_pb2_grpc
from pdserve.server.client import open_channel
from pdserve.server.launcher import free_port
from tests.e2e.procs import Procs, generate, request, wait_until
from tests.security.pki import Pki, tls_args

GREEDY = gen_pb.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def roles_cluster(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("roles")
    pki = Pki(tmp)
    certs = {name: pki.issue(name, roles) for name, roles in (
        ("coordinator", ("coordinator",)), ("decode", ("decode",)), ("prefill", ("prefill",)),
        ("operator", ("operator",)), ("client", ()))}
    procs = Procs(tiny_model("llama"), tmp)
    procs.pki = pki
    try:
        procs.http_port = free_port()
        coordinator = procs.start("coordinator", "coordinator", "--heartbeat-timeout", "2", "--http-port",
                                  str(procs.http_port), *tls_args(certs["coordinator"]), wait=False)
        coordinator.tls = certs["operator"]
        procs.wait_serving(coordinator)
        d0 = procs.start("d0", "decode", "--coordinator", coordinator.address, *tls_args(certs["decode"]), wait=False)
        d0.tls = certs["operator"]
        procs.wait_serving(d0)
        wait_until(lambda: [w.state for w in _workers(coordinator.address, certs["operator"])] == ["ready"],
                   "d0 registered")
        yield procs, certs
    finally:
        procs.stop_all()


def _workers(address, tls) -> list[pb.WorkerStatus]:
    with open_channel(address, tls) as ch:
        return list(worker_pb2_grpc.RegistryStub(ch).ListWorkers(pb.ListWorkersRequest(), timeout=5).workers)


def _refused(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code(), e.value.details()


def test_roles_decide_the_internal_calls(roles_cluster):
    procs, certs = roles_cluster
    coordinator, d0 = procs.procs["coordinator"], procs.procs["d0"]
    with open_channel(d0.address, certs["operator"]) as ch:
        info = worker_pb2_grpc.ControlStub(ch).GetInfo(pb.GetInfoRequest(), timeout=5)
    rogue = pb.WorkerInfo(role="decode", address="127.0.0.1:1", fingerprint=info.fingerprint, kv_layout=info.kv_layout,
                          load=pb.WorkerLoad(free_kv_blocks=10**6, total_kv_blocks=10**6))
    liar = pb.WorkerInfo(role="decode", address="127.0.0.1:1", fingerprint=info.fingerprint, kv_layout=info.kv_layout,
                         load=pb.WorkerLoad(free_kv_blocks=10**6, total_kv_blocks=10))
    for cert, message, code, words in (
        ("client", rogue, grpc.StatusCode.PERMISSION_DENIED, "carries roles none"),
        ("operator", rogue, grpc.StatusCode.PERMISSION_DENIED, "carries roles ['operator']"),
        ("prefill", rogue, grpc.StatusCode.PERMISSION_DENIED, "urn:pdserve:role:decode"),
        ("decode", liar, grpc.StatusCode.INVALID_ARGUMENT, "free_kv_blocks 1000000 must lie in [0, total_kv_blocks 10]"),
    ):
        with open_channel(coordinator.address, certs[cert]) as ch:
            got = _refused(lambda: worker_pb2_grpc.RegistryStub(ch).Register(pb.RegisterRequest(info=message), timeout=5))
        assert got[0] == code and words in got[1], (cert, got)
    assert _refused(lambda: _workers(coordinator.address, certs["client"]))[0] == grpc.StatusCode.PERMISSION_DENIED
    assert [w.address for w in _workers(coordinator.address, certs["operator"])] == [d0.address]  # no rogue joined
    decode_request = pb.DecodeRequest(request_id="x", prompt_token_ids=[1, 2], sampling=GREEDY, lease_seconds=5,
                                      transfer_token=b"t" * 16)
    for cert in ("client", "decode", "prefill", "operator"):
        with open_channel(d0.address, certs[cert]) as ch:
            code, details = _refused(lambda: next(worker_pb2_grpc.DecodeStub(ch).Decode(decode_request, timeout=5)))
            assert code == grpc.StatusCode.PERMISSION_DENIED and "['coordinator']" in details, (cert, details)
    for cert in ("client", "decode", "coordinator"):
        with open_channel(d0.address, certs[cert]) as ch:
            code, details = _refused(lambda: worker_pb2_grpc.KvTransferStub(ch).PushKv(
                iter([pb.KvChunk(header=pb.KvHeader(request_id="x"))]), timeout=5))
            assert code == grpc.StatusCode.PERMISSION_DENIED and "['prefill']" in details, (cert, details)
    with open_channel(d0.address, certs["client"]) as ch:
        code, _ = _refused(lambda: worker_pb2_grpc.ControlStub(ch).GetInfo(pb.GetInfoRequest(), timeout=5))
        assert code == grpc.StatusCode.PERMISSION_DENIED
    # the public API: any certificate the CA signed (no prefill worker: the decode worker prefills)
    assert len(generate(coordinator.address, request([3, 4, 5], 5), tls=certs["client"])) == 5


def _served_cert(port: int, tls, alpn: str) -> bytes:
    """The certificate a fresh TLS handshake on 127.0.0.1:port gets (presenting `tls`'s client certificate)."""
    context = ssl.create_default_context(cafile=str(tls.ca))
    context.load_cert_chain(tls.cert, tls.key)
    context.set_alpn_protocols([alpn])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        with context.wrap_socket(raw, server_hostname="localhost") as sock:
            return sock.getpeercert(binary_form=True)


def test_https_and_certificates_renewed_in_place(roles_cluster, tmp_path):
    procs, certs = roles_cluster
    coordinator = procs.procs["coordinator"]
    grpc_port = int(coordinator.address.rpartition(":")[2])
    r = httpx.get(f"https://localhost:{procs.http_port}/v1/models", verify=ssl.create_default_context(
        cafile=str(certs["client"].ca)), timeout=10)
    assert r.status_code == 200 and r.json()["data"][0]["object"] == "model"
    before = {port: _served_cert(port, certs["operator"], alpn)
              for port, alpn in ((grpc_port, "h2"), (procs.http_port, "http/1.1"))}
    import shutil

    new = procs.pki.issue("coordinator-renewed", ("coordinator",), days=2)  # the same CA, a new leaf
    shutil.copy(new.cert, certs["coordinator"].cert)
    shutil.copy(new.key, certs["coordinator"].key)
    for port, alpn in ((grpc_port, "h2"), (procs.http_port, "http/1.1")):
        wait_until(lambda: _served_cert(port, certs["operator"], alpn) != before[port], f"port {port} renewed",
                   timeout=20, every=0.3)
        assert _served_cert(port, certs["operator"], alpn) == ssl.PEM_cert_to_DER_cert(new.cert.read_text())
    # and the cluster still works through the renewed certificate
    assert len(generate(coordinator.address, request([3, 4, 5], 3), tls=certs["client"])) == 3
