"""Prefill tokens/s, decode tokens/s and KV-transfer GB/s, each beside this machine's ceiling.

    python -m pdserve.benchmarks.tiers [--models tiny,qwen2.5-0.5b] [--json out.json] [--quick]

Each model is loaded once through the real loading code and run through the real tiers:
1. Prefill (JAX `make_prefill_fn`) at a few (batch x length) shapes; compile excluded.
2. Decode (torch `DecoderModel.decode` over a `PagedKvCache`) at batch 1, 8, 32, ~128-token contexts.
3. KV transfer: `KvSender.send` of a 2048-token prompt's KV to a `KvReceiver` served in-process on
   127.0.0.1, whose sink writes a `PagedKvCache` (what a decode worker does).

Ceilings (benchmarks/ceilings.py) are measured in the same run. A tokens/s ceiling is the roofline:
the step could take no less than max(flops / matmul GFLOP/s, bytes / memory GB/s). Every time is the
best of a few runs after a warm-up (the machine is shared). Progress goes to stderr, the table to stdout.
The tiny model's weights fit in CPU caches: its ratios measure per-step overhead, not bandwidth.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import numpy as np

from pdserve.benchmarks import ceilings
from pdserve.benchmarks.ceilings import GB, best_time
from pdserve.benchmarks.protocol import LoadMonitor, MachineRecord, gate
from pdserve.server.model.config import ModelConfig, load_config
from pdserve.server.model.fingerprint import fingerprint
from pdserve.server.model.weights import load_weights
from pdserve.server.cache_dir import cache_dir

MODELS = ("tiny", "qwen2.5-0.5b")
_START = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - _START:6.1f}s] {message}", file=sys.stderr, flush=True)


@dataclass
class Row:
    model: str
    tier: str
    measure: str
    value: float
    ceiling: float | None = None
    unit: str = ""

    @property
    def ratio(self) -> float | None:
        return None if self.ceiling is None else self.value / self.ceiling


@dataclass(frozen=True)
class Plan:
    """How much each stage runs; `--quick` trades precision for a run of seconds."""

    repeats: int
    memcpy_bytes: int
    matmul_n: int
    prefill_shapes: dict[str, list[tuple[int, int]]]
    """(batch, length) points per model."""
    decode_batches: tuple[int, ...] = (1, 8, 32)
    decode_context: int = 128
    decode_steps: int = 8
    transfer_tokens: int = 2048


FULL = Plan(
    repeats=3,
    memcpy_bytes=512 * 2**20,
    matmul_n=2048,
    prefill_shapes={"tiny": [(1, 128), (1, 512), (4, 256)], "qwen2.5-0.5b": [(1, 128), (1, 512)]},
)
QUICK = Plan(
    repeats=2,
    memcpy_bytes=64 * 2**20,
    matmul_n=1024,
    prefill_shapes={"tiny": [(1, 128), (4, 256)]},
    decode_steps=4,
)


# ---- models ---------------------------------------------------------------------------------------


def qwen25_05b_random(out: Path) -> None:
    """A random-weight checkpoint of Qwen2.5-0.5B's shape, fp32 (~2 GB)."""
    import torch
    import transformers

    from pdserve.benchmarks.checkpoint import QWEN25_05B

    config = transformers.Qwen2Config(
        **QWEN25_05B, use_sliding_window=False, bos_token_id=151643, eos_token_id=151643
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)


def model_dir(name: str, cache: Path) -> Path:
    """The model's checkpoint under cache, built on first use (into a temp dir, then renamed)."""
    out = cache / {"tiny": "tiny-llama", "qwen2.5-0.5b": "qwen2.5-0.5b-random"}[name]
    if (out / "config.json").exists():
        return out
    log(f"{name}: building a random-weight checkpoint in {out} (first run only; the 0.5B takes ~30 s)")
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    if name == "tiny":
        from pdserve.server.model.tiny import make_tiny_model

        make_tiny_model(tmp, "llama")
    else:
        qwen25_05b_random(tmp)
    try:
        tmp.rename(out)
    except OSError:  # another run built it first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


# ---- model arithmetic -----------------------------------------------------------------------------


def matmul_weights(config: ModelConfig) -> tuple[int, int]:
    """(matmul weights of all layers, lm-head weights); norms and biases (< 0.1%) are left out."""
    h, d = config.hidden_size, config.head_dim
    attention = h * d * (2 * config.num_heads + 2 * config.num_kv_heads)  # q, o; k, v
    mlp = 3 * h * config.intermediate_size  # gate, up, down
    return config.num_layers * (attention + mlp), config.vocab_size * h


def prefill_flops(config: ModelConfig, batch: int, length: int) -> float:
    """2 flops per weight per token, the lm head at one position per row, and causal attention.

    Attention: QK^T and PV each take 2 * D flops per (query, key) pair per q head, over the S^2 / 2
    causal pairs: 4 * L * Hq * D * S^2 / 2 per row. (The code computes the full S x S square, twice
    that, and masks half: this counts the useful work.)
    """
    layers, head = matmul_weights(config)
    attention = 4 * config.num_layers * config.num_heads * config.head_dim * length**2 / 2
    return batch * (2 * layers * length + 2 * head + attention)


def decode_step_flops(config: ModelConfig, context_lens: np.ndarray) -> float:
    """One step: 2 flops per weight per sequence, plus QK^T and PV over each context (4 * L * Hq * D * T)."""
    layers, head = matmul_weights(config)
    attention = 4 * config.num_layers * config.num_heads * config.head_dim * float(context_lens.sum())
    return 2 * (layers + head) * len(context_lens) + attention


def roofline_seconds(flops: float, nbytes: float, gflops: float, gbps: float) -> float:
    return max(flops / (gflops * 1e9), nbytes / (gbps * GB))


# ---- tiers ----------------------------------------------------------------------------------------


def bench_prefill(name: str, config: ModelConfig, weights, plan: Plan, ceil: dict) -> list[Row]:
    import jax
    import jax.numpy as jnp

    from pdserve.server.prefill.model import load_params, make_prefill_fn

    params = load_params(config, weights, dtype="float32")
    fn = make_prefill_fn(config)
    weight_bytes = 4 * sum(matmul_weights(config))
    rng = np.random.default_rng(0)
    rows = []
    for batch, length in plan.prefill_shapes[name]:
        log(f"{name}: prefill {batch}x{length} (compile, then best of {plan.repeats})")
        tokens = jnp.asarray(rng.integers(0, config.vocab_size, (batch, length)), dtype=jnp.int32)
        lengths = jnp.full((batch,), length, dtype=jnp.int32)
        seconds = best_time(partial(_prefill, fn, params, tokens, lengths), plan.repeats)
        flops = prefill_flops(config, batch, length)
        gflops = ceil["matmul_jax_gflops"]
        floor = roofline_seconds(flops, weight_bytes, gflops, ceil["memory_gbps"])
        shape, tokens_in = f"{batch}x{length}", batch * length
        rows += [
            Row(name, "prefill", f"tokens/s {shape}", tokens_in / seconds, tokens_in / floor, "tok/s"),
            Row(name, "prefill", f"GFLOP/s {shape}", flops / seconds / 1e9, gflops, "GFLOP/s"),
        ]
    jax.clear_caches()
    return rows


def _prefill(fn, params, tokens, lengths) -> None:
    import jax

    jax.block_until_ready(fn(params, tokens, lengths))


def bench_decode(name: str, config: ModelConfig, weights, plan: Plan, ceil: dict) -> list[Row]:
    import torch

    from pdserve.kvcache.layout import KvLayout
    from pdserve.server.decode.kv_cache import PagedKvCache
    from pdserve.server.decode.weights import build_model

    model = build_model(config, weights, dtype=torch.float32)
    layout = KvLayout(config.num_layers, config.num_kv_heads, config.head_dim, block_size=16, dtype="float32")
    prompt_len, steps, max_batch = plan.decode_context, plan.decode_steps, max(plan.decode_batches)
    blocks_per_seq = layout.num_blocks(prompt_len + steps)
    cache = PagedKvCache(layout, max_batch * blocks_per_seq)
    tables = torch.arange(max_batch * blocks_per_seq).view(max_batch, blocks_per_seq)  # [B, M]

    log(f"{name}: decode: prefilling a {prompt_len}-token prompt into {max_batch} sequences")
    prompt = torch.randint(0, config.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(0))
    first_token = int(model.prefill(prompt, tables[0].tolist(), cache)[-1].argmax())
    # Every other sequence gets a copy of the first one's prompt blocks: the KV values do not change
    # a step's cost, and one prefill per sequence would take longer than the decode it prepares.
    prompt_blocks = tables[:, : layout.num_blocks(prompt_len)]  # [B, m]
    cache.k[:, prompt_blocks[1:]] = cache.k[:, prompt_blocks[0]][:, None]
    cache.v[:, prompt_blocks[1:]] = cache.v[:, prompt_blocks[0]][:, None]

    weight_bytes = 4 * sum(matmul_weights(config))
    rows = []
    for batch in plan.decode_batches:
        log(f"{name}: decode batch {batch}: {steps} steps, best of {plan.repeats}")
        run = partial(_decode_steps, model, cache, tables[:batch], first_token, prompt_len, steps)
        seconds = best_time(run, plan.repeats)
        # Bytes a step must read: every weight once plus each sequence's context KV (its true length,
        # not the whole blocks the code gathers). Writes (new KV, activations) are left out.
        contexts = [np.full(batch, prompt_len + step + 1) for step in range(steps)]
        nbytes = sum(weight_bytes + c.sum() * layout.bytes_per_token for c in contexts)
        flops = sum(decode_step_flops(config, c) for c in contexts)
        floor = roofline_seconds(flops, nbytes, ceil["matmul_torch_gflops"], ceil["memory_gbps"])
        tokens_out = batch * steps
        rows += [
            Row(name, "decode", f"tokens/s B={batch}", tokens_out / seconds, tokens_out / floor, "tok/s"),
            Row(name, "decode", f"GB/s read B={batch}", nbytes / seconds / GB, ceil["memory_gbps"], "GB/s"),
        ]
    return rows


def _decode_steps(model, cache, block_tables, first_token: int, prompt_len: int, steps: int) -> None:
    """Greedy decode steps for every sequence of block_tables [B, M], from position prompt_len."""
    import torch

    batch = block_tables.shape[0]
    token_ids = torch.full((batch,), first_token, dtype=torch.int64)
    for step in range(steps):
        positions = torch.full((batch,), prompt_len + step, dtype=torch.int64)
        logits = model.decode(token_ids, positions, block_tables, positions + 1, cache)  # [B, V]
        token_ids = logits.argmax(-1)




async def _transfer(layout, digest: str, num_tokens: int, repeats: int) -> tuple[float, float, int]:
    """(KV transfer seconds, raw grpcio loopback GB/s of the same bytes, bytes) in one event loop."""
    from pdserve.benchmarks.kv import push as kv_push
    from pdserve.kvcache.receiver import KvReceiver
    from pdserve.kvcache.grpc_sender import GrpcKvTransport
    from pdserve.server.decode.kv_cache import PagedKvCache

    rng = np.random.default_rng(0)
    shape = (layout.num_layers, num_tokens, layout.num_kv_heads, layout.head_dim)  # [L, T, Hkv, D]
    k = rng.standard_normal(shape, dtype=np.float32)
    v = rng.standard_normal(shape, dtype=np.float32)
    nbytes = k.nbytes + v.nbytes
    raw_gbps = await ceilings.grpc_loopback_gbps(nbytes, repeats)

    block_table = list(range(layout.num_blocks(num_tokens)))
    cache = PagedKvCache(layout, len(block_table))
    receiver = KvReceiver(layout, digest, kv_push.CacheSink(cache, block_table))
    server, address = await kv_push.serve_receiver(receiver)
    sender = GrpcKvTransport()
    best = float("inf")
    try:
        for attempt in range(repeats + 1):  # the first connects and warms up
            request_id, token = f"bench-{attempt}", os.urandom(16)
            transfer = receiver.expect(request_id, 0, token, num_tokens)
            header = kv_push.header(request_id, token, digest, layout, num_tokens)
            start = time.perf_counter()
            await sender.send(address, header, layout, k, v, first_token_id=7)
            await transfer.done
            if attempt:
                best = min(best, time.perf_counter() - start)
    finally:
        await sender.close()
        await server.stop(None)
    got_k, got_v = cache.read(block_table, num_tokens)
    if not (np.array_equal(got_k.numpy(), k) and np.array_equal(got_v.numpy(), v)):
        raise RuntimeError("the KV in the receiver's cache differs from the KV sent")
    return best, raw_gbps, nbytes


def bench_transfer(name: str, config: ModelConfig, digest: str, plan: Plan, ceil: dict) -> list[Row]:
    import uvloop  # what every pdserve process runs on

    from pdserve.kvcache.layout import KvLayout

    layout = KvLayout(config.num_layers, config.num_kv_heads, config.head_dim, block_size=16, dtype="float32")
    tokens = plan.transfer_tokens
    size = f"{tokens} tok {tokens * layout.bytes_per_token / 1e6:.1f} MB"
    log(f"{name}: KV transfer of {size}, then raw grpcio with the same bytes")
    seconds, raw_gbps, nbytes = uvloop.run(_transfer(layout, digest, tokens, plan.repeats))
    ceil[f"grpc_loopback_gbps_{name}"] = raw_gbps
    return [Row(name, "kv-transfer", f"GB/s {size}", nbytes / seconds / GB, raw_gbps, "GB/s")]


# ---- the run --------------------------------------------------------------------------------------


def measure_ceilings(plan: Plan) -> dict:
    mib = plan.memcpy_bytes // 2**20
    log(f"ceilings: memory copy ({mib} MiB float32, numpy and torch)")
    ceil = {
        "memcpy_numpy_gbps": ceilings.memcpy_numpy_gbps(plan.memcpy_bytes, plan.repeats),
        "memcpy_torch_gbps": ceilings.memcpy_torch_gbps(plan.memcpy_bytes, plan.repeats),
    }
    ceil["memory_gbps"] = max(ceil["memcpy_numpy_gbps"], ceil["memcpy_torch_gbps"])
    log(f"ceilings: fp32 matmul {plan.matmul_n}² (JAX and torch)")
    ceil["matmul_jax_gflops"] = ceilings.matmul_jax_gflops(plan.matmul_n, plan.repeats + 2)
    ceil["matmul_torch_gflops"] = ceilings.matmul_torch_gflops(plan.matmul_n, plan.repeats + 2)
    return ceil


def ceiling_rows(ceil: dict, plan: Plan) -> list[Row]:
    copy, n = f"{plan.memcpy_bytes // 2**20} MiB copy, read+write", plan.matmul_n
    return [
        Row("machine", "memory", f"numpy {copy}", ceil["memcpy_numpy_gbps"], unit="GB/s"),
        Row("machine", "memory", f"torch {copy}", ceil["memcpy_torch_gbps"], unit="GB/s"),
        Row("machine", "matmul", f"jax fp32 {n}²", ceil["matmul_jax_gflops"], unit="GFLOP/s"),
        Row("machine", "matmul", f"torch fp32 {n}²", ceil["matmul_torch_gflops"], unit="GFLOP/s"),
    ]


def bench_model(name: str, cache: Path, plan: Plan, ceil: dict) -> list[Row]:
    path = model_dir(name, cache)
    log(f"{name}: loading {path}")
    config = load_config(path)
    weights = load_weights(path)
    rows = bench_prefill(name, config, weights, plan, ceil)
    rows += bench_decode(name, config, weights, plan, ceil)
    del weights
    rows += bench_transfer(name, config, fingerprint(path, config), plan, ceil)
    return rows


def _fmt(x: float | None) -> str:
    if x is None:
        return ""
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def _fmt_ratio(x: float | None) -> str:
    return "" if x is None else f"{x:.2f}"


def table(rows: list[Row]) -> str:
    header = ("model", "tier", "measure", "value", "ceiling", "ratio")
    cells = [header] + [
        (r.model, r.tier, r.measure, _fmt(r.value), _fmt(r.ceiling), _fmt_ratio(r.ratio)) for r in rows
    ]
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]

    def line(row: tuple[str, ...]) -> str:  # text columns left, numbers right
        return "  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))

    lines = [line(row).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


CONVENTIONS = {
    "times": "best of a few timed runs after a warm-up (compile excluded)",
    "memory GB/s": "copy ceilings count read + write bytes; decode GB/s counts bytes read (weights + KV)",
    "memory ceiling": "max of the numpy and torch copy ceilings",
    "prefill FLOPs": "2 x matmul weights x tokens + lm head at the last position + causal attention "
    "4*L*Hq*D*S^2/2",
    "tokens/s ceiling": "roofline: tokens / max(flops / matmul ceiling, bytes read / memory ceiling)",
    "kv-transfer": "KvSender -> KvReceiver -> PagedKvCache, fp32 KV, vs raw grpcio loopback of the same "
    "bytes",
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pdserve.benchmarks.tiers", description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated: {', '.join(MODELS)}")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--quick", action="store_true", help="the tiny model only, fewer iterations")
    default_cache = cache_dir() / "bench"
    parser.add_argument("--cache-dir", type=Path, default=default_cache, help="where checkpoints are built")
    parser.add_argument("--max-load", type=float, default=2.0,
                        help="refuse to start when the 1-minute load average is above this (--quick: never)")
    parser.add_argument("--allow-noisy", action="store_true", help="run on a busy machine, marking the result noisy")
    args = parser.parse_args(argv)
    models = ["tiny"] if args.quick else [m for m in args.models.split(",") if m]
    unknown = set(models) - set(MODELS)
    if unknown:
        parser.error(f"unknown model(s) {', '.join(sorted(unknown))}; choose from {', '.join(MODELS)}")
    plan = QUICK if args.quick else FULL

    import jax
    import torch

    record = MachineRecord.take()
    gate(record, args.max_load, args.allow_noisy or args.quick)
    log(f"load average {record.load_before[0]:.2f} on {record.cores} CPUs: {record.status}")
    with LoadMonitor() as monitor:
        ceil = measure_ceilings(plan)
        rows = ceiling_rows(ceil, plan)
        for name in models:
            rows += bench_model(name, args.cache_dir, plan, ceil)
    record.finish(monitor)
    log("done")
    log(record.markdown())
    print(table(rows))
    if args.json:
        machine = {
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "jax_backend": jax.default_backend(),
            "jax": jax.__version__,
            "torch": torch.__version__,
            **record.as_dict(),
        }
        result = {
            "quick": args.quick,
            "models": models,
            "machine": machine,
            "conventions": CONVENTIONS,
            "ceilings": ceil,
            "rows": [asdict(r) | {"ratio": r.ratio} for r in rows],
        }
        args.json.write_text(json.dumps(result, indent=2))
        log(f"wrote {args.json}")


if __name__ == "__main__":
    main()
