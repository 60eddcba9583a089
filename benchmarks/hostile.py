"""What oversized prompts cost the other requests: the refusal latency of a 5 MB prompt, and the
inter-token latency of streams running beside a flood of them.

    python -m pdserve.benchmarks.hostile [--model DIR] [--streams 4] [--max-tokens 200] [--oversized 20]

Starts `pdserve up` (1 prefill + 1 decode worker, the launcher's processes) on 127.0.0.1. Runs
`--streams` greedy streams alone, then again while `--oversized` 5 MB text prompts (gRPC) are sent one
after another. Prints each oversized refusal's latency at the client (median, max) and the streams'
inter-token latency (p50, p99) in both runs.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path

import grpc

from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.v1 import generation_pb2_grpc

BIG = "x" * (5 * 2**20)


def _stream(address: str, prompt: list[int], max_tokens: int, gaps: list[float]) -> None:
    req = gen_pb.GenerateRequest(token_ids=gen_pb.TokenIds(ids=prompt), sampling=gen_pb.SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    last = None
    with grpc.insecure_channel(address) as ch:
        for message in generation_pb2_grpc.GenerationStub(ch).Generate(req, timeout=300):
            now = time.perf_counter()
            if last is not None and message.token_ids:
                gaps.extend([(now - last) / len(message.token_ids)] * len(message.token_ids))
            last = now


def _flood(address: str, count: int, latencies: list[float]) -> None:
    options = [("grpc.max_send_message_length", 64 * 2**20)]
    with grpc.insecure_channel(address, options=options) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        for _ in range(count):
            t0 = time.perf_counter()
            try:
                list(stub.Generate(gen_pb.GenerateRequest(text=BIG, sampling=gen_pb.SamplingParams(max_tokens=4)),
                                   timeout=60))
                raise RuntimeError("a 5 MB prompt was served")
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.INVALID_ARGUMENT:
                    raise
            latencies.append(time.perf_counter() - t0)


def _run(address: str, streams: int, max_tokens: int, oversized: int) -> tuple[list[float], list[float]]:
    gaps: list[float] = []
    latencies: list[float] = []
    threads = [threading.Thread(target=_stream, args=(address, [3 + i, 4, 5, 6], max_tokens, gaps))
               for i in range(streams)]
    if oversized:
        threads.append(threading.Thread(target=_flood, args=(address, oversized, latencies)))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return gaps, latencies


def _pct(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))] * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="checkpoint (default: the embedded model)")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--oversized", type=int, default=20)
    args = parser.parse_args(argv)
    from pdserve.server import launcher
    from pdserve.server.cli import default_model_dir

    cluster = launcher.launch(args.model or default_model_dir(), prefill_workers=1, decode_workers=1, port=0,
                              host="127.0.0.1")
    try:
        address = cluster.coordinator.address
        _run(address, 1, 8, 0)  # warm-up
        alone, _ = _run(address, args.streams, args.max_tokens, 0)
        beside, refusals = _run(address, args.streams, args.max_tokens, args.oversized)
    finally:
        cluster.stop()
    print(f"5 MB prompt refused (INVALID_ARGUMENT) in {statistics.median(refusals) * 1e3:.1f} ms median, "
          f"{max(refusals) * 1e3:.1f} ms max ({len(refusals)} prompts)")
    for name, gaps in (("alone", alone), (f"beside {args.oversized} x 5 MB prompts", beside)):
        print(f"ITL of {args.streams} streams {name}: p50 {_pct(gaps, 0.5):.2f} ms, p99 {_pct(gaps, 0.99):.2f} ms "
              f"({len(gaps)} tokens)")


if __name__ == "__main__":
    main()
