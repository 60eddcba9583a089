"""The attacks of issue 16 against real processes: calls without the cluster credential, direct worker
calls with values that used to stall or poison others, and oversized prompts. Each fails alone, with
the status and the field named, while other streams on the same workers complete with their tokens."""

from __future__ import annotations

import asyncio
import socket
import time

import grpc
import numpy as np
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pdserve.kvcache.layout import KvLayout
from pdserve.kvcache.grpc_sender import GrpcKvTransport
from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.v1 import generation_pb2_grpc
from pdserve.v1 import worker_pb2 as pb
from pdserve.v1 import worker_pb2_grpc
from pdserve.server.security import cluster_secret_interceptors
from tests.e2e.procs import Stream, generate, list_workers, request, wait_blocks_free
from tests.security.conftest import INTERNAL, SECRET

PROMPTS = [[3, 4, 5, 6, 7], [11, 12, 13], [21, 22, 23, 24], [31, 32]]
GREEDY = gen_pb.SamplingParams(max_tokens=8, temperature=0.0, top_p=1.0, top_k=0, ignore_eos=True)


def _code(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code(), e.value.details()


def _info(proc) -> pb.WorkerInfo:
    with grpc.insecure_channel(proc.address) as ch:
        return worker_pb2_grpc.ControlStub(ch).GetInfo(pb.GetInfoRequest(), timeout=5, metadata=INTERNAL)


@pytest.fixture(scope="module")
def reference(secured) -> dict[int, list[list[int]]]:
    """The no-fault tokens of PROMPTS, by max_tokens."""
    coordinator = secured.procs["coordinator"]
    return {n: [generate(coordinator.address, request(p, n)) for p in PROMPTS] for n in (120,)}


def test_internal_services_refuse_calls_without_the_cluster_secret(secured):
    coordinator, p0, d0 = (secured.procs[n] for n in ("coordinator", "p0", "d0"))
    rogue = pb.WorkerInfo(role="prefill", address=d0.address, fingerprint=_info(d0).fingerprint,
                          load=pb.WorkerLoad(free_kv_blocks=10**6, total_kv_blocks=10**6))
    wrong = (("x-pdserve-cluster-secret", "not-the-secret-but-long-enough"),)
    tried = 0
    for metadata in ((), wrong):
        with grpc.insecure_channel(coordinator.address) as ch:
            registry = worker_pb2_grpc.RegistryStub(ch)
            calls = [lambda: registry.Register(pb.RegisterRequest(info=rogue), timeout=5, metadata=metadata),
                     lambda: registry.Heartbeat(pb.HeartbeatRequest(info=rogue), timeout=5, metadata=metadata),
                     lambda: registry.ListWorkers(pb.ListWorkersRequest(), timeout=5, metadata=metadata)]
            for call in calls:
                code, details = _code(call)
                assert code == grpc.StatusCode.UNAUTHENTICATED and "cluster secret" in details
                tried += 1
        for worker in (p0, d0):
            with grpc.insecure_channel(worker.address) as ch:
                calls = [lambda: worker_pb2_grpc.ControlStub(ch).GetInfo(pb.GetInfoRequest(), timeout=5,
                                                                         metadata=metadata)]
                if worker is d0:
                    calls += [
                        lambda: next(worker_pb2_grpc.DecodeStub(ch).Decode(pb.DecodeRequest(
                            request_id="x", prompt_token_ids=[1, 2], sampling=GREEDY, lease_seconds=1e9),
                            timeout=5, metadata=metadata)),
                        lambda: worker_pb2_grpc.DecodeStub(ch).Abort(pb.AbortRequest(request_id="x"), timeout=5,
                                                                     metadata=metadata),
                        lambda: worker_pb2_grpc.KvTransferStub(ch).PushKv(
                            iter([pb.KvChunk(header=pb.KvHeader(request_id="x"))]), timeout=5, metadata=metadata)]
                else:
                    calls += [lambda: worker_pb2_grpc.PrefillStub(ch).Prefill(pb.PrefillRequest(
                        request_id="x", token_ids=[1] * 5000, sampling=GREEDY), timeout=5, metadata=metadata)]
                for call in calls:
                    code, details = _code(call)
                    assert code == grpc.StatusCode.UNAUTHENTICATED, details
                    assert "cluster secret" in details
                    tried += 1
    assert tried == 18
    # the pool is as it was: the rogue registration of d0 as a prefill worker never happened
    assert sorted((w.role, w.address, w.state) for w in list_workers(coordinator)) == sorted(
        [("prefill", p0.address, "ready"), ("decode", d0.address, "ready"),
         ("decode", secured.procs["d1"].address, "ready")])
    # the public API needs no cluster secret; reflection lists only the public services
    assert len(generate(coordinator.address, request([3, 4, 5], 4))) == 4
    with grpc.insecure_channel(coordinator.address) as ch:
        reply = next(reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5))
    services = {s.name for s in reply.list_services_response.service}
    assert "pdserve.v1.Generation" in services and not any(s.startswith("pdserve.v1.Registry") for s in services)


def test_bad_direct_calls_fail_alone_while_other_streams_complete(secured, reference):
    coordinator, p0, d0, d1 = (secured.procs[n] for n in ("coordinator", "p0", "d0", "d1"))
    info = _info(d0)
    vocab = 512
    streams = [Stream(coordinator.address, request(p, 120)) for p in PROMPTS]
    target = pb.KvTarget(address=info.kv_address or d0.address, layout=info.kv_layout)
    nan = gen_pb.SamplingParams(max_tokens=8, temperature=float("nan"), ignore_eos=True)
    refused: list[tuple[grpc.StatusCode, str]] = []
    with grpc.insecure_channel(p0.address) as ch:
        prefill = worker_pb2_grpc.PrefillStub(ch)
        for req, field in ((pb.PrefillRequest(request_id="long", token_ids=[7] * 600, sampling=GREEDY,
                                              target=target), "token_ids"),
                           (pb.PrefillRequest(request_id="nan", token_ids=[7] * 6, sampling=nan, target=target),
                            "sampling.temperature"),
                           (pb.PrefillRequest(request_id="oov", token_ids=[7, vocab], sampling=GREEDY, target=target),
                            "token_ids")):
            code, details = _code(lambda: prefill.Prefill(req, timeout=10, metadata=INTERNAL))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(field), details
            refused.append((code, details))
    with grpc.insecure_channel(d0.address) as ch:
        decode = worker_pb2_grpc.DecodeStub(ch)
        bad = [(dict(sampling=nan), "sampling.temperature"),
               (dict(sampling=gen_pb.SamplingParams(max_tokens=8, top_p=float("inf"))), "sampling.top_p"),
               (dict(sampling=gen_pb.SamplingParams(max_tokens=8, top_k=-1)), "sampling.top_k"),
               (dict(sampling=gen_pb.SamplingParams(max_tokens=8, stop_token_ids=[vocab])), "sampling.stop_token_ids"),
               (dict(lease_seconds=1e9), "lease_seconds"),
               (dict(lease_seconds=float("nan")), "lease_seconds"),
               (dict(prompt_token_ids=[1] * 600), "prompt_token_ids"),
               (dict(prompt_token_ids=[1, -4]), "prompt_token_ids"),
               (dict(num_output_tokens=8), "num_output_tokens"),
               (dict(request_id=""), "request_id"),
               (dict(transfer_token=b"t" * 65), "transfer_token")]
        for overrides, field in bad:
            fields = dict(request_id="bad", prompt_token_ids=[1, 2, 3], sampling=GREEDY, lease_seconds=5,
                          transfer_token=b"t" * 16)
            fields.update(overrides)
            code, details = _code(lambda: next(decode.Decode(pb.DecodeRequest(**fields), timeout=10,
                                                             metadata=INTERNAL)))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(field), details
            refused.append((code, details))
        # a KV push whose first token lies past the vocabulary fails that request alone
        call = decode.Decode(pb.DecodeRequest(request_id="oov-first", prompt_token_ids=[1, 2, 3], sampling=GREEDY,
                                              lease_seconds=10, transfer_token=b"k" * 16), timeout=30, metadata=INTERNAL)
        assert next(call).WhichOneof("event") == "reserved"
        layout = KvLayout.from_proto(info.kv_layout)
        k = np.zeros((layout.num_layers, 3, layout.num_kv_heads, layout.head_dim), dtype=layout.np_dtype)
        header = pb.KvHeader(request_id="oov-first", attempt=0, transfer_token=b"k" * 16, fingerprint=info.fingerprint,
                             layout=info.kv_layout, num_tokens=3)

        async def push() -> None:
            sender = GrpcKvTransport(interceptors=cluster_secret_interceptors(SECRET), timeout=10)
            try:
                await sender.send(info.kv_address or d0.address, header, layout, k, k.copy(), vocab + 7)
            finally:
                await sender.close()

        asyncio.run(push())
        code, details = _code(lambda: next(call))
        assert code == grpc.StatusCode.ABORTED and "first_token_id 519" in details, details
        refused.append((code, details))
    for s in streams:
        s.join(120)
    assert [s.error for s in streams] == [None] * 4
    assert [s.tokens for s in streams] == reference[120]
    # the prefill engine still serves after the over-long prompt; no block is left taken
    assert generate(coordinator.address, request(PROMPTS[0], 120)) == reference[120][0]
    assert all(free == total for free, total in wait_blocks_free([d0, d1]))
    assert len(refused) == 15


def test_oversized_prompts_are_refused_before_any_work(secured, reference):
    coordinator = secured.procs["coordinator"]
    streams = [Stream(coordinator.address, request(p, 120)) for p in PROMPTS]
    huge = "x" * (5 * 2**20)
    with grpc.insecure_channel(coordinator.address, options=[("grpc.max_send_message_length", 64 * 2**20)]) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        for req, words in (
            (gen_pb.GenerateRequest(text=huge, sampling=gen_pb.SamplingParams(max_tokens=4)),
             f"text: a prompt of {5 * 2**20} bytes; the limit is {4 * 2**20} bytes"),
            (gen_pb.GenerateRequest(text="y" * 100_000, sampling=gen_pb.SamplingParams(max_tokens=4)),
             "exceeds the model's max_model_len 512"),
            (gen_pb.GenerateRequest(token_ids=gen_pb.TokenIds(ids=[1] * 100_000),
                                    sampling=gen_pb.SamplingParams(max_tokens=4)),
             "a prompt of 100000 tokens = 100004 exceeds the model's max_model_len 512"),
            (gen_pb.GenerateRequest(text="hi", sampling=gen_pb.SamplingParams(max_tokens=4, stop=["s" * 5000])),
             "stop: a stop string of 5000 bytes; the limit is 1024 bytes"),
        ):
            code, details = _code(lambda: list(stub.Generate(req, timeout=30)))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and words in details, details
    # HTTP: a prompt over the limit, and a body over the body limit declared before it is sent
    import httpx

    base = f"http://127.0.0.1:{secured.http_port}"
    name = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
    r = httpx.post(f"{base}/v1/completions", json={"model": name, "prompt": huge, "max_tokens": 4}, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["param"] == "text", r.text
    r = httpx.post(f"{base}/tokenize", json={"model": name, "prompt": huge}, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["param"] == "prompt", r.text
    r = httpx.post(f"{base}/v1/chat/completions", json={"model": name, "messages": [
        {"role": "user", "content": huge[: 3 * 2**20]}, {"role": "user", "content": huge[: 2 * 2**20]}]}, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["param"] == "messages", r.text
    assert "the limit is 4194304 bytes" in r.json()["error"]["message"]
    with socket.create_connection(("127.0.0.1", secured.http_port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 104857600\r\n\r\n{\"model\":")
        reply = b""
        while chunk := sock.recv(65536):  # the server closes after its answer
            reply += chunk
        reply = reply.decode()
    assert reply.startswith("HTTP/1.1 413") and "\"code\": 413" in reply and "exceeds the limit of" in reply
    for s in streams:
        s.join(120)
    assert [s.error for s in streams] == [None] * 4
    assert [s.tokens for s in streams] == reference[120]


def test_a_client_gone_before_its_first_token_frees_its_reservation_at_once(secured):
    import os
    import signal

    coordinator, p0, d0, d1 = (secured.procs[n] for n in ("coordinator", "p0", "d0", "d1"))
    os.kill(p0.popen.pid, signal.SIGSTOP)  # the prefill never answers: the request waits before its first token
    try:
        with grpc.insecure_channel(coordinator.address) as ch:
            call = generation_pb2_grpc.GenerationStub(ch).Generate(request([5, 6, 7], 200), timeout=60)
            deadline = time.monotonic() + 30
            while all(f == t for f, t in wait_blocks_free([d0, d1], timeout=0)) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not all(f == t for f, t in wait_blocks_free([d0, d1], timeout=0)), "no blocks were reserved"
            call.cancel()
        pairs = wait_blocks_free([d0, d1], timeout=5)
        assert all(free == total for free, total in pairs), pairs
    finally:
        os.kill(p0.popen.pid, signal.SIGCONT)
