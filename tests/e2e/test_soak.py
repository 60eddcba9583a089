"""About a minute of mixed traffic from several clients (streams, seeded sampling, stop strings, cancels,
bad input, tiny deadlines): every request is accounted for, and every KV block comes back."""

from __future__ import annotations

import os
import random
import threading
import time
from collections import Counter

import grpc
import pytest

from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.v1 import generation_pb2_grpc
from tests.e2e.procs import Procs, counter, list_workers, request, wait_blocks_free, wait_until

SECONDS = float(os.environ.get("PDSERVE_SOAK_SECONDS", "60"))
CLIENTS = 4


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    procs = Procs(tiny_model("llama"), tmp_path_factory.mktemp("soak"))
    try:
        coordinator = procs.coordinator()
        for name, role in (("p0", "prefill"), ("d0", "decode"), ("d1", "decode")):
            procs.worker(name, role, coordinator, wait=False)
        wait_until(lambda: [w.state for w in list_workers(coordinator)] == ["ready"] * 3, "3 workers ready", 120)
        yield procs
    finally:
        procs.stop_all()


def one_request(stub, rng: random.Random) -> str:
    """Sends one request of a random kind; returns its outcome, checked (raises on a wrong one)."""
    kind = rng.choice(["greedy", "greedy", "seeded", "stop", "cancel", "bad", "deadline"])
    prompt = [rng.randrange(3, 512) for _ in range(rng.randrange(1, 60))]
    n = rng.randrange(1, 48)
    if kind == "bad":
        req = rng.choice([request(prompt, 0), request([3, 512], 4), request(prompt, 4, top_p=2.0),
                          gen_pb.GenerateRequest(text="")])
        try:
            list(stub.Generate(req, timeout=30))
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e
            return "invalid"
        raise AssertionError("a bad request was served")
    if kind == "deadline":
        try:
            tokens = [t for m in stub.Generate(request(prompt, n), timeout=rng.uniform(0.005, 0.05)) for t in m.token_ids]
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                # admission by expected wait: a deadline no prefill can meet is refused at once, with a hint
                hints = dict(e.trailing_metadata() or ())
                assert "retry-after-ms" in hints, e
                return "refused_early"
            assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED, e
            return "deadline_exceeded"
        assert len(tokens) == n
        return "completed"
    if kind == "cancel":
        call = stub.Generate(request(prompt, 200), timeout=30)
        for _ in range(rng.randrange(1, 4)):
            next(call)
        call.cancel()
        return "cancelled"
    if kind == "seeded":
        req = request(prompt, n, seed=rng.randrange(2**32), top_p=0.9)
        req.sampling.temperature = 1.0
    elif kind == "stop":
        req = gen_pb.GenerateRequest(text="def f(x): return x", sampling=gen_pb.SamplingParams(
            max_tokens=n, temperature=0.0, stop=["e", "a"], ignore_eos=True))
    else:
        req = request(prompt, n)
    messages = list(stub.Generate(req, timeout=60))
    tokens = [t for m in messages for t in m.token_ids]
    final = messages[-1]
    assert final.usage.completion_tokens == len(tokens)
    if kind == "stop":
        assert final.finish_reason in (gen_pb.FINISH_REASON_STOP, gen_pb.FINISH_REASON_LENGTH)
    else:
        assert final.finish_reason == gen_pb.FINISH_REASON_LENGTH and len(tokens) == n
    return "completed"


def test_soak_every_request_accounted_for_and_every_block_back(cluster):
    p = cluster.procs
    coordinator = p["coordinator"]
    outcomes: Counter[str] = Counter()
    failures: list[BaseException] = []
    sent = [0]
    lock = threading.Lock()
    stop_at = time.monotonic() + SECONDS

    def client(seed: int) -> None:
        rng = random.Random(seed)
        with grpc.insecure_channel(coordinator.address) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            while time.monotonic() < stop_at:
                with lock:
                    sent[0] += 1
                try:
                    outcome = one_request(stub, rng)
                except BaseException as e:  # a lost or wrong request
                    with lock:
                        failures.append(e)
                    continue
                with lock:
                    outcomes[outcome] += 1

    threads = [threading.Thread(target=client, args=(seed,), daemon=True) for seed in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(SECONDS + 120)
    print(f"soak: {sent[0]} requests in {SECONDS:.0f} s from {CLIENTS} clients: {dict(outcomes)}")

    assert failures == []
    assert sum(outcomes.values()) == sent[0]  # lost = 0
    assert outcomes["completed"] > 0 and outcomes["cancelled"] > 0 and outcomes["invalid"] > 0
    pairs = wait_blocks_free([p["d0"], p["d1"]], timeout=30)
    assert all(free == total for free, total in pairs), pairs
    wait_until(lambda: all(w.inflight == 0 for w in list_workers(coordinator)), "no request left in flight")
    # the coordinator counted every request that reached it once (a tiny deadline may expire before that)
    metrics = coordinator.metrics()
    served = counter(metrics, "pdserve_request_success_total") + counter(metrics, "pdserve_request_failure_total")
    assert sent[0] - outcomes["deadline_exceeded"] <= served <= sent[0]
