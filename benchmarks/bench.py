"""`pdserve bench`: an asyncio load generator for pdserve's gRPC API or any OpenAI-compatible server.

    pdserve bench --target grpc --addr 127.0.0.1:50051 --num-prompts 200 --request-rate 4 \
        --input-len 256 --output-len 64 --slo-ttft-ms 500 --slo-tpot-ms 100 --out results/run1
    pdserve bench --target openai --base-url http://127.0.0.1:8000 --dataset sharegpt \
        --dataset-path sg.json --tokenizer MODEL_DIR --concurrency 8 --duration 60

Writes results.json, latency_cdf.png and throughput.png into --out and prints a summary.
A run is one or more groups of requests, each with its own load (see `Group`); the CLI runs one,
benchmarks.load.side_by_side runs a decode-heavy group beside a prefill-burst group.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pdserve.benchmarks import report
from pdserve.benchmarks.clients import GrpcTarget, OpenAITarget, Target
from pdserve.server.plan import datasets
from pdserve.server.plan.arrivals import LoadSpec, arrival_offsets
from pdserve.server.plan.bench_flags import add_bench_flags, make_requests, prompt_count
from pdserve.server.plan.run_summary import RequestOutput, format_summary, summarize


@dataclass
class Group:
    """Requests (cycled in order) sent with one load pattern, until `max_requests` or the run's duration."""

    name: str
    requests: list[datasets.BenchRequest]
    load: LoadSpec = field(default_factory=LoadSpec)
    max_requests: int | None = None


@dataclass
class RunResult:
    outputs: list[RequestOutput]
    start: float
    end: float


async def _send_group(
    target: Target,
    group: Group,
    start: float,
    duration: float | None,
    tasks: list[asyncio.Task],
    outputs: list[RequestOutput],
    on_done,
) -> None:
    sem = asyncio.Semaphore(group.load.concurrency) if group.load.concurrency else None

    async def one(req: datasets.BenchRequest) -> None:
        out = RequestOutput(group=group.name, prompt_len=req.prompt_len)
        outputs.append(out)
        try:
            await target.send(req, out)
        finally:
            if sem is not None:
                sem.release()
            on_done(out)

    for i, offset in enumerate(arrival_offsets(group.load)):
        if group.max_requests is not None and i >= group.max_requests:
            break
        if duration is not None and offset >= duration:
            break
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if sem is not None:
            await sem.acquire()
        if duration is not None and time.perf_counter() - start >= duration:
            if sem is not None:
                sem.release()
            break
        tasks.append(asyncio.create_task(one(group.requests[i % len(group.requests)])))


async def run_groups(
    target: Target, groups: list[Group], *, duration: float | None = None, progress: bool = True
) -> RunResult:
    """Sends every group's requests concurrently; returns when all have finished."""
    for g in groups:
        if g.max_requests is None and duration is None:
            raise ValueError(f"group {g.name!r}: give a request count or a duration")
        if g.max_requests is None and math.isinf(g.load.rate) and not g.load.concurrency:
            raise ValueError(f"group {g.name!r}: a closed loop with a duration needs --concurrency")
    total = sum(g.max_requests for g in groups) if all(g.max_requests is not None for g in groups) else None
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="req", desc="bench", file=sys.stderr, dynamic_ncols=True)
    outputs: list[RequestOutput] = []
    tasks: list[asyncio.Task] = []

    def on_done(out: RequestOutput) -> None:
        if bar is not None:
            bar.update(1)
            bar.set_postfix(failed=sum(1 for o in outputs if o.done and not o.success), refresh=False)

    start = time.perf_counter()
    await asyncio.gather(*(_send_group(target, g, start, duration, tasks, outputs, on_done) for g in groups))
    await asyncio.gather(*tasks)
    end = time.perf_counter()
    if bar is not None:
        bar.close()
    return RunResult(outputs=outputs, start=start, end=end)


WARMUP_SEED_OFFSET = 1_000_003
"""The warm-up's prompts are drawn with seed + this: the shapes of the measured requests, none of their ids (a
warm-up on the measured prompts would put their KV in the server's prefix caches, and the first measured
requests would be cache hits)."""


async def warmup(target: Target, requests: list[datasets.BenchRequest], n: int) -> None:
    """Sends n requests (up to 4 at a time) whose results are thrown away: compiles, connections
    (`requests`: the warm-up's own, drawn with the seed + `WARMUP_SEED_OFFSET`)."""
    sem = asyncio.Semaphore(4)

    async def one(req):
        async with sem:
            await target.send(req, RequestOutput(group="warmup", prompt_len=req.prompt_len))

    await asyncio.gather(*(one(requests[i % len(requests)]) for i in range(n)))


def write_results(
    out_dir: Path,
    result: RunResult,
    config: dict,
    *,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
    plots: bool = True,
    title: str = "",
) -> dict:
    """results.json (+ PNGs): the whole run's summary, one per group, and every request's record."""
    outs = result.outputs
    summary = summarize(
        outs, slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms, duration=result.end - result.start
    )
    groups = sorted({o.group for o in outs})
    by_group = (
        {
            g: summarize(
                [o for o in outs if o.group == g],
                slo_ttft_ms=slo_ttft_ms,
                slo_tpot_ms=slo_tpot_ms,
                duration=result.end - result.start,
            )
            for g in groups
        }
        if len(groups) > 1
        else {}
    )
    doc = {
        "config": config,
        "summary": summary,
        "groups": by_group,
        "requests": report.request_records(outs, result.start),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    report.write_json(out_dir / "results.json", doc)
    if plots:
        report.plot_latency_cdfs(out_dir / "latency_cdf.png", outs, title)
        report.plot_throughput(out_dir / "throughput.png", outs, result.start, title)
    return doc


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(
        prog="pdserve bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    return add_bench_flags(p)


def make_target(args) -> Target:
    if args.target == "grpc":
        return GrpcTarget(args.addr, timeout=args.timeout)
    import os

    return OpenAITarget(
        args.base_url,
        model=args.model,
        api_key=args.api_key or os.environ.get("PDSERVE_API_KEY"),
        timeout=args.timeout,
    )


async def _main(args) -> dict:
    n = args.num_prompts or (None if args.duration else 100)
    requests = make_requests(args, n or prompt_count(args))
    target = make_target(args)
    group = Group(
        "default",
        requests,
        LoadSpec(rate=args.request_rate, arrival=args.arrival, concurrency=args.concurrency, seed=args.seed),
        max_requests=n,
    )
    try:
        if args.warmup:
            await warmup(target, make_requests(args, args.warmup, args.seed + WARMUP_SEED_OFFSET), args.warmup)
        result = await run_groups(target, [group], duration=args.duration, progress=not args.no_progress)
    finally:
        await target.close()
    out = args.out or Path("benchmarks/results") / time.strftime("%Y%m%d-%H%M%S")
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"}
    config["load"] = asdict(group.load)
    doc = write_results(
        out,
        result,
        config,
        slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms,
        plots=not args.no_plots,
        title=f"{target.name} {args.addr if args.target == 'grpc' else args.base_url}",
    )
    print(format_summary(doc["summary"], target.name))
    print(
        f"results: {out / 'results.json'}"
        + ("" if args.no_plots else f", {out / 'latency_cdf.png'}, {out / 'throughput.png'}")
    )
    return doc


def run_cli(args) -> int:
    doc = asyncio.run(_main(args))
    return 0 if doc["summary"]["completed"] else 1


def main(argv: list[str] | None = None) -> int:
    return run_cli(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
