"""A soak: mixed traffic from several clients for a while (greedy and seeded streams, stop strings, cancels,
bad input, tiny deadlines), every request's outcome checked as it ends.

    python -m pdserve.benchmarks.load.soak --minutes 30 --clients 8

starts `pdserve up` (1 prefill + 2 decode workers) on the embedded model (or `--model`), or drives a running
cluster (`--coordinator HOST:PORT`), prints a progress line a minute and the outcome counts at the end, and exits
1 if any request was lost or wrong. The suite runs the same traffic for a few seconds
(tests/e2e/test_soak.py) and checks the blocks and counters after it.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.v1 import generation_pb2_grpc


@dataclass
class SoakResult:
    sent: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    failures: list[BaseException] = field(default_factory=list)

    def summary(self, seconds: float, clients: int) -> str:
        return (f"soak: {self.sent} requests in {seconds:.0f} s from {clients} clients: {dict(self.outcomes)}; "
                f"{len(self.failures)} lost or wrong")


def _greedy(prompt: list[int], max_tokens: int, **sampling) -> gen_pb.GenerateRequest:
    return gen_pb.GenerateRequest(token_ids=gen_pb.TokenIds(ids=prompt), sampling=gen_pb.SamplingParams(
        max_tokens=max_tokens, ignore_eos=True, temperature=0.0, **sampling))


def one_request(stub, rng: random.Random, vocab: int = 512) -> str:
    """Sends one request of a random kind; returns its outcome, checked (raises on a wrong one)."""
    kind = rng.choice(["greedy", "greedy", "seeded", "stop", "cancel", "bad", "deadline"])
    prompt = [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 60))]
    n = rng.randrange(1, 48)
    if kind == "bad":
        req = rng.choice([_greedy(prompt, 0), _greedy([3, vocab], 4), _greedy(prompt, 4, top_p=2.0),
                          gen_pb.GenerateRequest(text="")])
        try:
            list(stub.Generate(req, timeout=30))
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e
            return "invalid"
        raise AssertionError("a bad request was served")
    if kind == "deadline":
        try:
            tokens = [t for m in stub.Generate(_greedy(prompt, n), timeout=rng.uniform(0.005, 0.05))
                      for t in m.token_ids]
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
        call = stub.Generate(_greedy(prompt, 200), timeout=30)
        for _ in range(rng.randrange(1, 4)):
            next(call)
        call.cancel()
        return "cancelled"
    if kind == "seeded":
        req = _greedy(prompt, n, seed=rng.randrange(2**32), top_p=0.9)
        req.sampling.temperature = 1.0
    elif kind == "stop":
        req = gen_pb.GenerateRequest(text="def f(x): return x", sampling=gen_pb.SamplingParams(
            max_tokens=n, temperature=0.0, stop=["e", "a"], ignore_eos=True))
    else:
        req = _greedy(prompt, n)
    messages = list(stub.Generate(req, timeout=60))
    tokens = [t for m in messages for t in m.token_ids]
    final = messages[-1]
    assert final.usage.completion_tokens == len(tokens)
    if kind == "stop":
        assert final.finish_reason in (gen_pb.FINISH_REASON_STOP, gen_pb.FINISH_REASON_LENGTH)
    else:
        assert final.finish_reason == gen_pb.FINISH_REASON_LENGTH and len(tokens) == n
    return "completed"


def run_soak(address: str, seconds: float, clients: int = 4, vocab: int = 512, progress_every: float = 0.0,
             channel=grpc.insecure_channel) -> SoakResult:
    """`clients` threads sending `one_request` to the coordinator at `address` until `seconds` have passed;
    every request sent ends in `outcomes` or in `failures`."""
    result = SoakResult()
    lock = threading.Lock()
    stop_at = time.monotonic() + seconds

    def client(seed: int) -> None:
        rng = random.Random(seed)
        with channel(address) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            while time.monotonic() < stop_at:
                with lock:
                    result.sent += 1
                try:
                    outcome = one_request(stub, rng, vocab)
                except BaseException as e:  # a lost or wrong request
                    with lock:
                        result.failures.append(e)
                    continue
                with lock:
                    result.outcomes[outcome] += 1

    threads = [threading.Thread(target=client, args=(seed,), daemon=True) for seed in range(clients)]
    for t in threads:
        t.start()
    started = time.monotonic()
    next_report = started + progress_every
    while any(t.is_alive() for t in threads) and time.monotonic() < stop_at + 120:
        time.sleep(0.5)
        if progress_every and time.monotonic() >= next_report:
            next_report += progress_every
            with lock:
                print(f"{time.monotonic() - started:.0f} s: {result.sent} sent, {dict(result.outcomes)}, "
                      f"{len(result.failures)} lost or wrong", file=sys.stderr, flush=True)
    for t in threads:
        t.join(1)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--coordinator", help="a running cluster's gRPC address; without it `pdserve up` is started")
    p.add_argument("--model", type=Path, help="checkpoint for the started cluster (default: the embedded model)")
    args = p.parse_args(argv)
    from pdserve.benchmarks.paths import EMBEDDED_MODEL
    from pdserve.server.model.config import load_config

    seconds = args.minutes * 60
    model = args.model or EMBEDDED_MODEL
    vocab = 512 if args.coordinator else load_config(model).vocab_size
    if args.coordinator:
        result = run_soak(args.coordinator, seconds, args.clients, vocab, progress_every=60)
    else:
        from pdserve.benchmarks.servers import pdserve_up

        with tempfile.TemporaryDirectory(prefix="pdserve-soak-") as tmp, \
                pdserve_up(model, Path(tmp), prefill_workers=1, decode_workers=2) as cluster:
            print(f"cluster up at {cluster.grpc}; soaking for {args.minutes:g} min", file=sys.stderr, flush=True)
            result = run_soak(cluster.grpc, seconds, args.clients, vocab, progress_every=60)
    print(result.summary(seconds, args.clients))
    for e in result.failures[:5]:
        print(f"  {type(e).__name__}: {e}"[:500])
    return 1 if result.failures or not result.outcomes["completed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
