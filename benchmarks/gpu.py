"""The tiers on one GPU (the lent H200), each beside a ceiling measured in the same run.

    python -m pdserve.benchmarks.gpu                 # Llama-3-8B shape, bf16, random weights (~8 minutes)
    python -m pdserve.benchmarks.gpu --tiny          # a tiny Llama on whatever device there is (CPU in tests)

1. Ceilings: device memory copy (read + write bytes/s, torch), bf16 matmul (torch and JAX), raw grpcio
   loopback (benchmarks.ceilings).
2. Decode (torch `DecoderModel.decode` over a `PagedKvCache` on the device) at batch 1, 8, 32, 64 with
   --context-token contexts: tokens/s and bytes/s read per step (every matmul weight once + each
   sequence's KV), against the copy bandwidth; tokens/s against the roofline.
3. Prefill (JAX `make_prefill_fn`, batch 1) at 512, 2048, 8192 tokens: FLOP/s against the JAX matmul rate.
4. KV handoff: a prefill's KV from the JAX device to host, `KvSender` -> `KvReceiver` on 127.0.0.1,
   written into the decode tier's device cache: GB/s against raw grpcio moving the same bytes.

Weights are random and made in memory (no checkpoint on disk): one random tensor per distinct shape,
copied per layer onto the device, so every layer's weights are distinct device memory. Decode runs
first and is freed before JAX allocates (JAX gets --jax-mem-fraction of the device). Times are the
best of --repeats runs after a warm-up; compile is excluded. The table is printed last.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

GB = 1e9
_T0 = time.perf_counter()

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}
TINY = dict(
    LLAMA3_8B,
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
)


@dataclass
class Plan:
    raw_config: dict
    decode_batches: tuple[int, ...] = (1, 8, 32, 64)
    context_tokens: int = 1024
    decode_steps: int = 16
    prefill_lengths: tuple[int, ...] = (512, 2048, 8192)
    transfer_tokens: int = 4096
    copy_bytes: int = 2 * 2**30
    matmul_n: int = 8192
    repeats: int = 3


def tiny_plan() -> Plan:
    return Plan(
        TINY,
        decode_batches=(1, 8, 32, 64),
        context_tokens=64,
        decode_steps=4,
        prefill_lengths=(32, 64, 128),
        transfer_tokens=128,
        copy_bytes=16 * 2**20,
        matmul_n=256,
        repeats=2,
    )


@dataclass
class Row:
    tier: str
    measure: str
    value: float
    ceiling: float | None = None
    unit: str = ""

    @property
    def ratio(self) -> float | None:
        return None if not self.ceiling else self.value / self.ceiling


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def best_of(fn, repeats: int, sync=lambda: None) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t)
    return best


def random_weights(config) -> dict[str, np.ndarray]:
    """HF-named bf16 weights; layers share one random array per shape on the host (copied per layer on device)."""
    import ml_dtypes

    rng = np.random.default_rng(0)
    h, d, inter = config.hidden_size, config.head_dim, config.intermediate_size
    hq, hkv = config.num_heads * d, config.num_kv_heads * d

    def rand(*shape: int, scale: float = 0.02) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(ml_dtypes.bfloat16)

    shared = {
        "q_proj": rand(hq, h),
        "k_proj": rand(hkv, h),
        "v_proj": rand(hkv, h),
        "o_proj": rand(h, hq),
        "gate_proj": rand(inter, h),
        "up_proj": rand(inter, h),
        "down_proj": rand(h, inter),
    }
    ones = np.ones(h, dtype=ml_dtypes.bfloat16)
    w = {
        "model.embed_tokens.weight": rand(config.vocab_size, h),
        "model.norm.weight": ones,
        "lm_head.weight": rand(config.vocab_size, h),
    }
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        w.update({p + "input_layernorm.weight": ones, p + "post_attention_layernorm.weight": ones})
        w.update({p + f"self_attn.{n}.weight": shared[n] for n in ("q_proj", "k_proj", "v_proj", "o_proj")})
        w.update({p + f"mlp.{n}.weight": shared[n] for n in ("gate_proj", "up_proj", "down_proj")})
    return w


def matmul_weight_count(config) -> int:
    h, d = config.hidden_size, config.head_dim
    per_layer = h * d * (2 * config.num_heads + 2 * config.num_kv_heads) + 3 * h * config.intermediate_size
    return config.num_layers * per_layer + config.vocab_size * h  # + the lm head


def prefill_flops(config, length: int) -> float:
    """2 per weight per token (lm head at the last position only) + causal attention 4*L*Hq*D*S^2/2."""
    layers = matmul_weight_count(config) - config.vocab_size * config.hidden_size
    attention = 4 * config.num_layers * config.num_heads * config.head_dim * length**2 / 2
    return 2 * layers * length + 2 * config.vocab_size * config.hidden_size + attention


# ---- ceilings -------------------------------------------------------------------------------------


def torch_ceilings(plan: Plan, device: str) -> dict:
    import torch

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    src = torch.ones(plan.copy_bytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    copy_s = best_of(lambda: dst.copy_(src), plan.repeats + 2, sync)
    n = plan.matmul_n
    a = torch.randn(n, n, device=device).to(torch.bfloat16)
    b = torch.randn(n, n, device=device).to(torch.bfloat16)
    mm_s = best_of(lambda: a @ b, plan.repeats + 2, sync)
    return {
        "copy_gbps": 2 * plan.copy_bytes / copy_s / GB,
        "matmul_torch_bf16_tflops": 2 * n**3 / mm_s / 1e12,
    }


def jax_matmul_tflops(n: int, repeats: int) -> float:
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (n, n), dtype=jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), dtype=jnp.bfloat16)
    dot = jax.jit(jnp.dot)
    return 2 * n**3 / best_of(lambda: dot(a, b).block_until_ready(), repeats + 2) / 1e12


# ---- tiers ----------------------------------------------------------------------------------------


def bench_decode(config, weights, plan: Plan, device: str, ceil: dict) -> list[Row]:
    import torch

    from pdserve.kvcache.layout import KvLayout
    from pdserve.server.decode.kv_cache import PagedKvCache
    from pdserve.server.decode.weights import build_model

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    log("decode: building the model on the device")
    model = build_model(config, weights, dtype=torch.bfloat16, device=device)
    layout = KvLayout(
        config.num_layers, config.num_kv_heads, config.head_dim, block_size=16, dtype="bfloat16"
    )
    ctx, steps, max_b = plan.context_tokens, plan.decode_steps, max(plan.decode_batches)
    per_seq = layout.num_blocks(ctx + steps + 1)
    cache = PagedKvCache(layout, max_b * per_seq, device=device)
    cache.k.normal_(0, 0.5)  # contexts hold arbitrary KV: the values do not change a step's cost
    cache.v.normal_(0, 0.5)
    tables = torch.arange(max_b * per_seq, device=device).view(max_b, per_seq)  # [B, M]
    weight_bytes = 2 * matmul_weight_count(config)
    rows = []
    for batch in plan.decode_batches:
        tokens = torch.full((batch,), 7, dtype=torch.int64, device=device)

        def run():
            for step in range(steps):
                pos = torch.full((batch,), ctx + step, dtype=torch.int64, device=device)
                model.decode(tokens, pos, tables[:batch], pos + 1, cache)

        seconds = best_of(run, plan.repeats, sync)
        kv_bytes = sum(batch * (ctx + s + 1) * layout.bytes_per_token for s in range(steps))
        nbytes = steps * weight_bytes + kv_bytes
        floor_s = max(
            nbytes / (ceil["copy_gbps"] * GB),
            steps * batch * 2 * matmul_weight_count(config) / (ceil["matmul_torch_bf16_tflops"] * 1e12),
        )
        log(f"decode B={batch}: {batch * steps / seconds:.1f} tok/s, {nbytes / seconds / GB:.1f} GB/s")
        rows += [
            Row(
                "decode",
                f"tokens/s B={batch} ctx={ctx}",
                batch * steps / seconds,
                batch * steps / floor_s,
                "tok/s",
            ),
            Row("decode", f"GB/s read B={batch}", nbytes / seconds / GB, ceil["copy_gbps"], "GB/s"),
        ]
    return rows


def bench_prefill(config, weights, plan: Plan, ceil: dict) -> tuple[list[Row], dict]:
    import jax
    import jax.numpy as jnp

    from pdserve.server.prefill.model import load_params, make_prefill_fn

    log(f"prefill: params onto {jax.default_backend()}")
    params = load_params(config, weights, dtype="bfloat16")
    fn = make_prefill_fn(config)
    rows, kv = [], {}
    for length in plan.prefill_lengths:
        tokens = jnp.asarray(
            np.random.default_rng(length).integers(0, config.vocab_size, (1, length)), jnp.int32
        )
        lengths = jnp.asarray([length], jnp.int32)
        out = {}

        def run():
            out["r"] = jax.block_until_ready(fn(params, tokens, lengths))

        seconds = best_of(run, plan.repeats)
        tflops = prefill_flops(config, length) / seconds / 1e12
        log(f"prefill S={length}: {length / seconds:.0f} tok/s, {tflops:.1f} TFLOP/s")
        rows += [
            Row("prefill", f"TFLOP/s S={length}", tflops, ceil["matmul_jax_bf16_tflops"], "TFLOP/s"),
            Row("prefill", f"tokens/s S={length}", length / seconds, None, "tok/s"),
        ]
        if length >= plan.transfer_tokens and not kv:
            _, k, v = out["r"]  # [L, 1, S, Hkv, D]
            kv = {"k": k[:, 0, : plan.transfer_tokens], "v": v[:, 0, : plan.transfer_tokens]}
    if not kv:
        raise ValueError("--transfer-tokens must not exceed the longest prefill length")
    return rows, kv




async def _handoff(config, kv: dict, plan: Plan, device: str) -> tuple[float, float, int]:
    """(best seconds device KV -> host -> KvSender -> KvReceiver -> device cache, raw grpcio GB/s, bytes)."""
    import jax
    import torch

    from pdserve.benchmarks import kv_push
    from pdserve.benchmarks.ceilings import grpc_loopback_gbps
    from pdserve.kvcache.layout import KvLayout
    from pdserve.kvcache.receiver import KvReceiver
    from pdserve.kvcache.sender import GrpcKvTransport
    from pdserve.server.decode.kv_cache import PagedKvCache

    layout = KvLayout(
        config.num_layers, config.num_kv_heads, config.head_dim, block_size=16, dtype="bfloat16"
    )
    n = plan.transfer_tokens
    nbytes = n * layout.bytes_per_token
    raw = await grpc_loopback_gbps(nbytes, plan.repeats)
    table = list(range(layout.num_blocks(n)))
    cache = PagedKvCache(layout, len(table), device=device)
    digest = "gpu-bench"
    receiver = KvReceiver(layout, digest, kv_push.CacheSink(cache, table))
    server, address = await kv_push.serve_receiver(receiver)
    sender = GrpcKvTransport()
    best = float("inf")
    try:
        for attempt in range(plan.repeats + 1):
            rid, token = f"gpu-{attempt}", os.urandom(16)
            transfer = receiver.expect(rid, 0, token, n)
            header = kv_push.header(rid, token, digest, layout, n)
            t = time.perf_counter()
            k, v = jax.device_get(kv["k"]), jax.device_get(kv["v"])  # [L, T, Hkv, D] bf16 on the host
            await sender.send(
                address, header, layout, np.ascontiguousarray(k), np.ascontiguousarray(v), first_token_id=7
            )
            await transfer.done
            if device == "cuda":
                torch.cuda.synchronize()
            if attempt:
                best = min(best, time.perf_counter() - t)
    finally:
        await sender.close()
        await server.stop(None)
    got_k, _ = cache.read(table, n)
    if not np.array_equal(got_k.float().cpu().numpy(), np.asarray(kv["k"], dtype=np.float32)):
        raise RuntimeError("the KV in the decode cache differs from the prefill's")
    return best, raw, nbytes


def table(rows: list[Row]) -> str:
    def fmt(x):
        return "" if x is None else (f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}")

    cells = [("tier", "measure", "value", "ceiling", "ratio", "unit")]
    cells += [
        (r.tier, r.measure, fmt(r.value), fmt(r.ceiling), "" if r.ratio is None else f"{r.ratio:.2f}", r.unit)
        for r in rows
    ]
    widths = [max(len(c[i]) for c in cells) for i in range(6)]
    lines = [
        "  ".join(c.ljust(w) if i in (0, 1, 5) else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
        for row in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(line.rstrip() for line in lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m pdserve.benchmarks.gpu",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--tiny", action="store_true", help="a tiny Llama and small sizes (runs on CPU in seconds)"
    )
    p.add_argument("--json", type=Path, help="also write the rows and ceilings here")
    p.add_argument(
        "--jax-mem-fraction", default="0.45", help="XLA_PYTHON_CLIENT_MEM_FRACTION for the prefill"
    )
    args = p.parse_args(argv)
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", args.jax_mem_fraction)
    plan = tiny_plan() if args.tiny else Plan(LLAMA3_8B)

    import torch
    import uvloop

    from pdserve.server.model.config import parse_config

    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = parse_config(plan.raw_config)
    gpu = torch.cuda.get_device_name() if device == "cuda" else "none (CPU)"
    log(f"{config.describe()} on {gpu}; making random weights")
    weights = random_weights(config)
    log("ceilings: device copy, torch bf16 matmul")
    ceil = torch_ceilings(plan, device)
    rows = [
        Row(
            "ceiling",
            f"copy {plan.copy_bytes / 2**30:.3g} GiB bf16 (read+write)",
            ceil["copy_gbps"],
            unit="GB/s",
        ),
        Row(
            "ceiling",
            f"torch bf16 matmul {plan.matmul_n}^2",
            ceil["matmul_torch_bf16_tflops"],
            unit="TFLOP/s",
        ),
    ]
    rows += bench_decode(config, weights, plan, device, ceil)
    gc.collect()  # the decode model and cache go before JAX allocates
    if device == "cuda":
        torch.cuda.empty_cache()
    import jax

    log(f"ceilings: JAX bf16 matmul on {jax.default_backend()}")
    ceil["matmul_jax_bf16_tflops"] = jax_matmul_tflops(plan.matmul_n, plan.repeats)
    rows.append(
        Row("ceiling", f"jax bf16 matmul {plan.matmul_n}^2", ceil["matmul_jax_bf16_tflops"], unit="TFLOP/s")
    )
    prefill_rows, kv = bench_prefill(config, weights, plan, ceil)
    rows += prefill_rows
    del weights
    log(f"KV handoff: {plan.transfer_tokens} tokens, then raw grpcio with the same bytes")
    seconds, raw, nbytes = uvloop.run(_handoff(config, kv, plan, device))
    ceil["grpc_loopback_gbps"] = raw
    rows += [
        Row("ceiling", f"raw grpcio loopback {nbytes / 1e6:.3g} MB", raw, unit="GB/s"),
        Row(
            "kv-handoff",
            f"GB/s {plan.transfer_tokens} tok {nbytes / 1e6:.3g} MB device->device",
            nbytes / seconds / GB,
            raw,
            "GB/s",
        ),
    ]
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "device": gpu,
                    "model": config.describe(),
                    "plan": asdict(plan),
                    "ceilings": ceil,
                    "rows": [asdict(r) | {"ratio": r.ratio} for r in rows],
                },
                indent=1,
            )
        )
    log("done")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
