"""Prefill MFU of the served path (PrefillEngine, JAX) on a GPU, against the bf16 matmul rate measured
in the same run.

    python -m pdserve.benchmarks.gpu.prefill --out DIR         # on the H200 (benchmarks/gpu.py calls run())
    python -m pdserve.benchmarks.gpu.prefill --dry-run         # anywhere: a tiny model at tiny lengths, on CPU

1. A Llama-3-8B-shaped model (32 layers, hidden 4096, 32 q / 8 kv heads, MLP 14336, vocab 128256) with
   random bf16 weights made on the device (no checkpoint, no download), in load_params' layout (the
   dry run checks the layout against load_params).
2. A PrefillEngine over it, as `pdserve prefill` serves it: one prompt per batch, every batch shape from
   the shortest length's bucket up to the longest compiled first (its time is reported).
3. At each length (512 / 4k / 16k): the bf16 matmul rate (`jnp.dot` of [T, 4096] x [4096, 14336],
   fp32 accumulation: the MLP's widest matmul at the same token count), then one prompt of T tokens
   from enqueue to its first token, repetition after repetition (one untimed first).
   MFU = model FLOPs / time / the matmul rate; also against the H200's dense bf16 peak (989 TFLOP/s).
   FLOPs as benchmarks/engine/prefill.py counts them (weights x 2T + causal attention + the last lm_head row).
Memory: XLA_PYTHON_CLIENT_PREALLOCATE=false (set here unless the caller set it before importing jax).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from pdserve.benchmarks.paths import RESULTS

H200_BF16_DENSE_TFLOPS = 989.0

LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
             "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 16384,
             "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
             "torch_dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": 128001}
TINY = {**LLAMA3_8B, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 512,
        "max_position_embeddings": 256, "bos_token_id": 1, "eos_token_id": 2}
LENGTHS = (512, 4096, 16384)
DRY_LENGTHS = (32, 64, 128)


def random_params(config, seed: int = 0) -> dict:
    """Random bf16 params in load_params' layout, made on the default device."""
    import jax
    import jax.numpy as jnp

    L, H, I, V = config.num_layers, config.hidden_size, config.intermediate_size, config.vocab_size  # noqa: E741
    hq, hkv, d = config.num_heads, config.num_kv_heads, config.head_dim
    keys = iter(jax.random.split(jax.random.key(seed), 16))

    def normal(*shape: int, scale: float = 0.02) -> jax.Array:
        return (scale * jax.random.normal(next(keys), shape, jnp.float32)).astype(jnp.bfloat16)

    layers = {
        "attn_norm": jnp.ones((L, H), jnp.float32),
        "wq": normal(L, H, hq, d), "wk": normal(L, H, hkv, d), "wv": normal(L, H, hkv, d),
        "wo": normal(L, hq, d, H),
        "mlp_norm": jnp.ones((L, H), jnp.float32),
        "w_gate": normal(L, H, I), "w_up": normal(L, H, I), "w_down": normal(L, I, H),
    }
    params = {"embed": normal(V, H), "final_norm": jnp.ones((H,), jnp.float32), "layers": layers}
    if not config.tie_word_embeddings:
        params["lm_head"] = normal(V, H)
    return params


def _layout_matches_load_params(config, params: dict) -> None:
    """The random params have exactly load_params' tree, shapes and dtypes (checked at tiny sizes)."""
    import jax
    import numpy as np

    from pdserve.server.prefill.model import load_params

    L, H, I, V = config.num_layers, config.hidden_size, config.intermediate_size, config.vocab_size  # noqa: E741
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes = {"input_layernorm.weight": (H,), "self_attn.q_proj.weight": (q, H), "self_attn.k_proj.weight": (kv, H),
              "self_attn.v_proj.weight": (kv, H), "self_attn.o_proj.weight": (H, q),
              "post_attention_layernorm.weight": (H,), "mlp.gate_proj.weight": (I, H), "mlp.up_proj.weight": (I, H),
              "mlp.down_proj.weight": (H, I)}
    weights = {f"model.layers.{i}.{name}": np.zeros(shape, np.float32) for i in range(L) for name, shape in shapes.items()}
    weights.update({"model.embed_tokens.weight": np.zeros((V, H), np.float32), "model.norm.weight": np.zeros(H, np.float32),
                    "lm_head.weight": np.zeros((V, H), np.float32)})
    want = jax.tree.map(lambda a: (a.shape, str(a.dtype)), load_params(config, weights, dtype="bfloat16"))
    got = jax.tree.map(lambda a: (a.shape, str(a.dtype)), params)
    if got != want:
        raise AssertionError(f"random_params drifted from load_params' layout:\n got {got}\nwant {want}")


def _matmul_tflops(tokens: int, hidden: int, inter: int, reps: int = 5) -> float:
    """bf16 [tokens, hidden] x [hidden, inter] with fp32 accumulation, TFLOP/s (median of reps)."""
    import statistics

    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(1), (tokens, hidden), jnp.float32).astype(jnp.bfloat16)
    b = jax.random.normal(jax.random.key(2), (hidden, inter), jnp.float32).astype(jnp.bfloat16)
    mm = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
    mm(a, b).block_until_ready()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        mm(a, b).block_until_ready()
        times.append(time.perf_counter() - t)
    return 2.0 * tokens * hidden * inter / statistics.median(times) / 1e12


def run(out_dir: str | Path, *, dry_run: bool = False, lengths: tuple[int, ...] | None = None, reps: int = 3,
        progress: bool = True, on_row: Callable[[dict], None] | None = None) -> dict:
    """Measures and writes <out_dir>/gpu_prefill.json (+ .md); returns the result (see the module docstring).
    on_row: called with each length's row as soon as it is measured, shortest first."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if dry_run:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import statistics

    import jax

    from pdserve.benchmarks.engine.prefill import prefill_flops
    from pdserve.v1 import generation_pb2 as gen_pb
    from pdserve.server.model.config import parse_config
    from pdserve.server.prefill.config import PrefillConfig
    from pdserve.server.prefill.engine import PrefillEngine

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lengths = tuple(lengths or (DRY_LENGTHS if dry_run else LENGTHS))
    config = parse_config(TINY if dry_run else LLAMA3_8B, out)
    t0 = time.perf_counter()
    params = jax.block_until_ready(random_params(config))
    if dry_run:
        _layout_matches_load_params(config, params)
    made_s = time.perf_counter() - t0
    longest = max(lengths)
    smallest = 1 << (min(lengths) - 1).bit_length()  # buckets from the shortest length up: fewer compiles
    engine = PrefillEngine(config, params, PrefillConfig(model_dir=out, max_batch_size=1, max_model_len=longest,
                                                         max_batch_tokens=longest, min_bucket=smallest,
                                                         prefix_cache_bytes=0))  # the prompt repeats
    compile_s = engine.warmup(progress=progress)
    greedy = gen_pb.SamplingParams(max_tokens=1, temperature=0.0)

    async def first_token(prompt: list[int]) -> float:
        t = time.perf_counter()
        job = engine.enqueue(prompt, greedy, 0, "bfloat16")
        await job.first_token
        elapsed = time.perf_counter() - t
        while await job.kv.get() is not None:  # the KV reaches the host too, as when served
            pass
        return elapsed

    async def measure() -> list[dict]:  # one event loop: the engine's loop task lives on it
        rows = []
        for n in sorted(lengths):
            matmul = _matmul_tflops(n, config.hidden_size, config.intermediate_size)
            prompt = [(7 * i + 3) % config.vocab_size for i in range(n)]
            times = [await first_token(prompt) for _ in range(reps + 1)][1:]  # the first one untimed
            seconds = statistics.median(times)
            tflops = prefill_flops(config, n) / seconds / 1e12
            rows.append({"tokens": n, "ttft_s": times, "ttft_median_s": seconds, "prefill_tflops": tflops,
                         "matmul_tflops": matmul, "mfu_vs_matmul": tflops / matmul,
                         "mfu_vs_h200_peak": tflops / H200_BF16_DENSE_TFLOPS})
            if on_row is not None:
                on_row(rows[-1])
            if progress:
                print(f"gpu_prefill: {n} tokens: {tflops:.1f} TFLOP/s, matmul {matmul:.1f} TFLOP/s "
                      f"(MFU {tflops / matmul:.2f} of it), TTFT {seconds * 1000:.1f} ms", file=sys.stderr, flush=True)
        return rows

    rows = asyncio.run(measure())
    devices = jax.devices()
    result = {"model": "llama-3-8b shape, random bf16" if not dry_run else "tiny llama, random bf16 (dry run)",
              "device": f"{devices[0].platform}: {devices[0].device_kind}", "devices": len(devices),
              "jax": jax.__version__, "params_made_s": made_s, "shapes_compiled": len(engine.shapes()),
              "compile_s": compile_s, "dry_run": dry_run, "rows": rows}
    (out / "gpu_prefill.json").write_text(json.dumps(result, indent=1))
    (out / "gpu_prefill.md").write_text(table(result))
    return result


def table(result: dict) -> str:
    lines = [f"Prefill MFU, served path (PrefillEngine), {result['model']} on {result['device']} (jax "
             f"{result['jax']}); {result['shapes_compiled']} shapes compiled at start in {result['compile_s']:.1f} s.",
             "", "| prompt tokens | TTFT (ms) | prefill TFLOP/s | bf16 matmul TFLOP/s (same run) | MFU vs matmul "
             "| MFU vs H200 peak |", "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['tokens']} | {r['ttft_median_s'] * 1000:.1f} | {r['prefill_tflops']:.3g} | "
                     f"{r['matmul_tflops']:.3g} | {r['mfu_vs_matmul']:.2f} | {r['mfu_vs_h200_peak']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.benchmarks.gpu.prefill", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=RESULTS / "gpu_prefill")
    p.add_argument("--dry-run", action="store_true", help="a tiny model at tiny lengths on CPU: checks it end to end")
    p.add_argument("--lengths", help="comma-separated prompt lengths (default 512,4096,16384; dry run 32,64,128)")
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)
    lengths = tuple(int(n) for n in args.lengths.split(",")) if args.lengths else None
    result = run(args.out, dry_run=args.dry_run, lengths=lengths, reps=args.reps)
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
