"""The decode tier on one GPU (the lent H200), each figure beside a ceiling measured in the same run.

    python3 benchmarks/gpu.py --out "$OUT"              # on the device: no install, runs from the checkout
    python -m pdserve.benchmarks.gpu --device cpu --dry-run --out /tmp/gpu   # tiny sizes, every stage, any machine

Run from a checkout as a file, it finds the `pdserve` package in the checkout itself (no pip: the device
has no registry). It needs torch, triton, numpy, ml_dtypes, protobuf >= the generated code's 7.35.1,
grpcio, prometheus-client, transformers (and JAX for the prefill section); a missing one is
named at the start with what to carry (a wheel, see /work/.library/device/README.md).

In order, inside --time-limit (540 s: one ~9-minute device call; a section that would not fit is
skipped and says so):
1. Ceilings: device copy (read + write) and read bandwidth, bf16 matmul, pinned and pageable host->device.
2. Correctness first: the Triton paged-attention kernel against the reference attention (bf16, fp32,
   int8, fp8 KV; Llama-3-8B heads; split and unsplit); the served engine's greedy tokens on the device,
   CUDA-graphed and eager, against transformers; the kernel path against the reference inside the model;
   received KV copied bit-exactly. A failed check fails the run (exit 1) after the timings.
3. Decode through the served engine (`startup.engine_for_model`, the worker's own start-up: KV cache from
   --gpu-memory-utilization after a profiling step, CUDA graphs per bucket) for a random Llama-3-8B-shape
   bf16 model: batch 1 against the weight-streaming floor measured here (target >= 0.85), batch 64 with
   4k-token contexts against the bandwidth roofline (target >= 0.7), and 1/8/32 beside them.
4. fp8 weights (torch._scaled_mm where the device has it) against bf16 at batch 1 (target: faster).
5. Prefill: `benchmarks/gpu_prefill.py`'s served-path MFU (`gpu_prefill.run(out, dry_run=...)`, which also
   writes gpu_prefill.json/.md), when that module exists.
6. KV handoff: `KvSender` -> `KvReceiver` on 127.0.0.1 -> the decode cache on the device, against raw
   grpcio moving the same bytes.
Writes gpu.json and gpu.md to --out; prints the table last.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file from a checkout: the package is the checkout itself
    _here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _here]  # benchmarks/datasets.py etc.
    if importlib.util.find_spec("pdserve") is None:
        _root = _here.parent
        _spec = importlib.util.spec_from_file_location(
            "pdserve", _root / "proto/pdserve/__init__.py",
            submodule_search_locations=[str(_root / "proto/pdserve"), str(_root)])
        _module = importlib.util.module_from_spec(_spec)
        sys.modules["pdserve"] = _module
        _spec.loader.exec_module(_module)

import argparse  # noqa: E402
import asyncio  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict, dataclass, field  # noqa: E402

import numpy as np  # noqa: E402

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
TINY = dict(LLAMA3_8B, vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256)


@dataclass
class Plan:
    raw_config: dict
    points: tuple[tuple[int, int], ...] = ((1, 128), (1, 4096), (8, 4096), (32, 4096), (64, 4096))
    """(batch, context tokens) decoded through the served engine."""
    floor_point: tuple[int, int] = (1, 128)
    """Checked against the weight-streaming floor (target 0.85)."""
    roofline_point: tuple[int, int] = (64, 4096)
    """Checked against the bandwidth roofline (target 0.7)."""
    warmup: int = 8
    steps: int = 64
    max_running: int = 64
    gpu_memory_utilization: float = 0.9
    copy_bytes: int = 4 * 2**30
    h2d_bytes: int = 512 * 2**20
    matmul_n: int = 8192
    transfer_tokens: int = 4096
    repeats: int = 5
    large_kernel_checks: bool = True


def dry_plan() -> Plan:
    return Plan(TINY, points=((1, 16), (4, 48)), floor_point=(1, 16), roofline_point=(4, 48), warmup=2, steps=4,
                max_running=4, copy_bytes=16 * 2**20, h2d_bytes=2**20, matmul_n=256,
                transfer_tokens=64, repeats=2, large_kernel_checks=False)


@dataclass
class Row:
    section: str
    measure: str
    value: float
    ceiling: float | None = None
    unit: str = ""
    target: float | None = None
    """The ratio value / ceiling must reach (None: reported only)."""

    @property
    def ratio(self) -> float | None:
        return None if not self.ceiling else self.value / self.ceiling

    @property
    def met(self) -> bool | None:
        return None if self.target is None or self.ratio is None else self.ratio >= self.target


@dataclass
class Run:
    rows: list[Row] = field(default_factory=list)
    checks: list = field(default_factory=list)
    ceilings: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


class Deadline:
    def __init__(self, seconds: float):
        self.end = time.perf_counter() + seconds

    def left(self) -> float:
        return self.end - time.perf_counter()

    def allows(self, section: str, seconds: float, run: Run) -> bool:
        if self.left() >= seconds:
            return True
        note = f"{section}: skipped, {self.left():.0f} s left of the time limit and it needs ~{seconds:.0f} s"
        log(note)
        run.notes.append(note)
        return False


# ---- 1. ceilings ----------------------------------------------------------------------------------


def ceilings(plan: Plan, device, run: Run) -> None:
    import torch

    from pdserve.benchmarks.gpu_decode import _best

    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    src = torch.ones(plan.copy_bytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    copy_s = _best(lambda: dst.copy_(src), plan.repeats, sync)
    read_s = _best(lambda: src.sum(dtype=torch.float32), plan.repeats, sync)
    dst = None  # the copy ceiling's buffer, freed
    n = plan.matmul_n
    a = torch.randn(n, n, device=device).to(torch.bfloat16)
    b = torch.randn(n, n, device=device).to(torch.bfloat16)
    mm_s = _best(lambda: a @ b, plan.repeats, sync)
    c = run.ceilings
    c["copy_gbps"] = 2 * plan.copy_bytes / copy_s / GB
    c["read_sum_gbps"] = plan.copy_bytes / read_s / GB
    c["matmul_bf16_tflops"] = 2 * n**3 / mm_s / 1e12
    rows = [Row("ceiling", f"device copy {plan.copy_bytes / 2**30:.3g} GiB (read + write)", c["copy_gbps"], unit="GB/s"),
            Row("ceiling", f"device read (sum of {plan.copy_bytes / 2**30:.3g} GiB bf16)", c["read_sum_gbps"],
                unit="GB/s"),
            Row("ceiling", f"bf16 matmul {n}^3", c["matmul_bf16_tflops"], unit="TFLOP/s")]
    if cuda:
        host = torch.ones(plan.h2d_bytes, dtype=torch.uint8)
        pinned = host.pin_memory()
        target = torch.empty(plan.h2d_bytes, dtype=torch.uint8, device=device)
        c["h2d_pageable_gbps"] = plan.h2d_bytes / _best(lambda: target.copy_(host), plan.repeats, sync) / GB
        c["h2d_pinned_gbps"] = plan.h2d_bytes / _best(lambda: target.copy_(pinned, non_blocking=True),
                                                      plan.repeats, sync) / GB
        rows += [Row("ceiling", f"host->device pageable {plan.h2d_bytes / 2**20:.0f} MiB", c["h2d_pageable_gbps"],
                     unit="GB/s"),
                 Row("ceiling", f"host->device pinned {plan.h2d_bytes / 2**20:.0f} MiB", c["h2d_pinned_gbps"],
                     unit="GB/s")]
    run.rows += rows
    for r in rows:
        log(f"{r.measure}: {r.value:.4g} {r.unit}")


# ---- 2. correctness -------------------------------------------------------------------------------


def correctness(plan: Plan, device, run: Run) -> None:
    from pdserve.benchmarks import gpu_checks
    from pdserve.server.decode.cuda_attention import have_triton

    checks = []
    if have_triton() and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"):
        kv = ("bfloat16", "float32", "int8", "fp8_e4m3") if device.type == "cuda" else ("float32", "int8")
        checks += gpu_checks.kernel_checks(device, kv, plan.large_kernel_checks)
    else:
        run.notes.append("paged kernel checks: skipped (triton missing, or CPU without TRITON_INTERPRET=1)")
    checks += gpu_checks.parity_checks(device, cpu_kernel=device.type == "cpu" and have_triton()
                                       and os.environ.get("TRITON_INTERPRET") == "1")
    checks.append(gpu_checks.received_kv_check(device))
    checks += gpu_checks.weight_kernel_checks(device)
    for c in checks:
        log(f"{'ok  ' if c.passed else 'FAIL'} {c.name}: {c.detail}")
    run.checks += checks


# ---- 3, 4. decode through the served engine -------------------------------------------------------


async def decode(plan: Plan, config, device, run: Run, deadline: Deadline) -> None:
    import torch

    from pdserve.benchmarks import gpu_decode
    from pdserve.server.decode.config import DecodeConfig
    from pdserve.server.decode.quant import quantize
    from pdserve.server.decode.startup import engine_for_model

    log("decode: a random bf16 model on the device")
    model = gpu_decode.random_model(config, torch.bfloat16, device)
    weights = gpu_decode.weight_bytes(model)
    floor_s = gpu_decode.streaming_floor(model, plan.repeats)
    read_gbps = weights / floor_s / GB
    run.ceilings["weight_stream_floor_s"] = floor_s
    run.ceilings["weight_stream_gbps"] = read_gbps
    bandwidth = max(read_gbps, run.ceilings.get("read_sum_gbps", 0.0))
    run.ceilings["roofline_read_gbps"] = bandwidth
    run.rows += [Row("ceiling", f"weight-streaming floor ({weights / 1e9:.2f} GB of matmul weights, batch-1 "
                     f"matmuls{', CUDA graph' if device.type == 'cuda' else ''})", 1 / floor_s, unit="steps/s"),
                 Row("ceiling", "read bandwidth for the roofline (best of the floor's and the sum's)", bandwidth,
                     unit="GB/s")]
    log(f"weight-streaming floor: {floor_s * 1e3:.2f} ms ({read_gbps:.0f} GB/s); roofline bandwidth "
        f"{bandwidth:.0f} GB/s")
    base = DecodeConfig(model_dir=Path("random-llama-3-8b-shape"), device=str(device), max_running=plan.max_running,
                        gpu_memory_utilization=plan.gpu_memory_utilization if device.type == "cuda" else None,
                        enable_prefix_caching=False, kv_cache_memory="64MiB")
    t = time.perf_counter()
    engine, layout = engine_for_model(base, model)
    log(f"served engine ready in {time.perf_counter() - t:.1f} s: {engine.pool.num_total} blocks, "
        f"{type(engine.runner).__name__}")
    max_ctx = max(c for _, c in plan.points)
    kv = gpu_decode.random_kv(config, max_ctx, layout.dtype)
    points = {}
    bf16_floor_step = None
    for batch, ctx in plan.points:
        if not deadline.allows(f"decode B={batch} ctx={ctx}", 25, run):
            continue
        if batch * layout.num_blocks(ctx + plan.warmup + plan.steps + 2) > engine.pool.num_total:
            run.notes.append(f"decode B={batch} ctx={ctx}: skipped, the cache holds {engine.pool.num_total} blocks")
            continue
        p = await _point(engine, batch, ctx, plan, kv)
        points[(batch, ctx)] = p
        roofline_s = (p.weight_bytes + p.kv_bytes) / (bandwidth * GB)
        target = 0.7 if (batch, ctx) == plan.roofline_point else None
        run.rows += [
            Row("decode bf16", f"tokens/s B={batch} ctx={ctx} vs roofline", p.tokens_per_s, batch / roofline_s,
                "tok/s", target),
            Row("decode bf16", f"ms/step B={batch} ctx={ctx}", p.step_s * 1e3, unit="ms"),
            Row("decode bf16", f"KV in B={batch} ctx={ctx} (engine.write, pinned + copy)", p.ingest_gbps,
                run.ceilings.get("h2d_pinned_gbps"), "GB/s"),
        ]
        if (batch, ctx) == plan.floor_point:
            bf16_floor_step = p.step_s
            run.rows.append(Row("decode bf16", f"steps/s B={batch} ctx={ctx} vs weight-streaming floor",
                                1 / p.step_s, 1 / floor_s, "steps/s", 0.85))
    await engine.close()
    if device.type == "cuda":
        try:
            count, ms = gpu_decode.kernels_per_step(engine)
            run.rows.append(Row("decode bf16", f"CUDA kernels in one eager B=1 step ({ms:.2f} ms of device time)",
                                count, unit="kernels"))
            log(f"one eager batch-1 step: {count} CUDA kernels, {ms:.2f} ms on the device")
        except Exception as e:  # noqa: BLE001 - a diagnostic
            run.notes.append(f"kernel count: the profiler failed ({e!r})")
    gpu_decode.free(engine)
    del engine
    gc.collect()
    if bf16_floor_step is None or not deadline.allows("fp8 weights", 60, run):
        return
    note = quantize(model, "fp8")
    log(f"fp8: {note}")
    fp8_config = DecodeConfig(model_dir=base.model_dir, device=str(device), max_running=1, weight_dtype="fp8",
                              kv_cache_tokens=4 * (plan.floor_point[1] + plan.warmup + plan.steps + 64),
                              enable_prefix_caching=False)
    engine, _ = engine_for_model(fp8_config, model)
    batch, ctx = plan.floor_point
    p = await _point(engine, batch, ctx, plan, kv)
    run.rows.append(Row("decode fp8", f"steps/s B={batch} ctx={ctx} fp8 vs bf16 ({note})", 1 / p.step_s,
                        1 / bf16_floor_step, "steps/s", 1.0))
    run.rows.append(Row("decode fp8", f"steps/s B={batch} ctx={ctx} fp8 vs the bf16 weight-streaming floor",
                        1 / p.step_s, 1 / floor_s, "steps/s"))
    await engine.close()
    gpu_decode.free(engine)


async def _point(engine, batch: int, ctx: int, plan: Plan, kv):
    from pdserve.benchmarks import gpu_decode

    return await gpu_decode.run_point(engine, batch, ctx, plan.warmup, plan.steps, kv, seed=batch * 7919 + ctx, log=log)


# ---- 5. prefill -----------------------------------------------------------------------------------


def prefill(plan: Plan, config, device, run: Run, deadline: Deadline, dry_run: bool, out: Path) -> None:
    """The prefill section (the hook): benchmarks/gpu_prefill.py's served-path MFU, `gpu_prefill.run`."""
    try:
        from pdserve.benchmarks import gpu_prefill
    except ImportError:
        run.notes.append("prefill: benchmarks/gpu_prefill.py is absent; no prefill figures")
        return
    lengths = None if dry_run or deadline.left() > 240 else (512, 4096)
    if not deadline.allows("prefill (benchmarks/gpu_prefill.py)", 90, run):
        return
    log(f"prefill: benchmarks/gpu_prefill.py's run() (lengths {lengths or 'its own'})")
    result = gpu_prefill.run(out, dry_run=dry_run, lengths=lengths)
    for r in result["rows"]:
        run.rows.append(Row("prefill", f"TFLOP/s S={r['tokens']} (served PrefillEngine, TTFT "
                            f"{r['ttft_median_s'] * 1e3:.1f} ms)", r["prefill_tflops"], r["matmul_tflops"], "TFLOP/s"))
    run.notes.append(f"prefill: {result['model']} on {result['device']}, {result['shapes_compiled']} shapes "
                     f"compiled in {result['compile_s']:.1f} s; also gpu_prefill.json / gpu_prefill.md")


# ---- 6. KV handoff --------------------------------------------------------------------------------


async def _handoff(config, plan: Plan, device) -> tuple[float, float, int]:
    """(best seconds host KV -> KvSender -> KvReceiver -> the decode cache on the device, raw grpcio GB/s, bytes)."""
    import torch

    from pdserve.benchmarks import kv_push
    from pdserve.benchmarks.ceilings import grpc_loopback_gbps
    from pdserve.benchmarks.gpu_decode import random_kv
    from pdserve.kvcache.layout import KvLayout
    from pdserve.kvcache.receiver import KvReceiver
    from pdserve.kvcache.grpc_sender import GrpcKvTransport
    from pdserve.server.decode.kv_cache import PagedKvCache

    layout = KvLayout(config.num_layers, config.num_kv_heads, config.head_dim, block_size=16, dtype="bfloat16")
    n = plan.transfer_tokens
    nbytes = n * layout.bytes_per_token
    raw = await grpc_loopback_gbps(nbytes, plan.repeats)
    table = list(range(layout.num_blocks(n)))
    cache = PagedKvCache(layout, len(table), device=device)
    k, v = random_kv(config, n, "bfloat16")
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
            await sender.send(address, header, layout, k, v, first_token_id=7)
            await transfer.done
            if device.type == "cuda":
                torch.cuda.synchronize()
            if attempt:
                best = min(best, time.perf_counter() - t)
    finally:
        await sender.close()
        await server.stop(None)
    got_k, _ = cache.read(table, n)
    if not np.array_equal(got_k.float().cpu().numpy(), k.astype(np.float32)):
        raise RuntimeError("the KV in the decode cache differs from what was sent")
    return best, raw, nbytes


def handoff(plan: Plan, config, device, run: Run, deadline: Deadline) -> None:
    if not deadline.allows("KV handoff", 30, run):
        return
    seconds, raw, nbytes = asyncio.run(_handoff(config, plan, device))
    run.ceilings["grpc_loopback_gbps"] = raw
    run.rows += [Row("ceiling", f"raw grpcio loopback {nbytes / 1e6:.3g} MB", raw, unit="GB/s"),
                 Row("kv-handoff", f"GB/s {plan.transfer_tokens} tok {nbytes / 1e6:.3g} MB host->wire->device",
                     nbytes / seconds / GB, raw, "GB/s")]
    log(f"KV handoff: {nbytes / seconds / GB:.2f} GB/s (raw grpcio {raw:.2f})")


def gpu_checks_failure(section: str, error: Exception):
    """A failed section as a failed check: the run exits 1 and says where."""
    from pdserve.benchmarks.gpu_checks import Check

    return Check(f"section {section} ran to the end", False, f"raised {error!r}")


# ---- output ---------------------------------------------------------------------------------------


def _fmt(x: float | None) -> str:
    return "" if x is None else (f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}")


def table(rows: list[Row]) -> str:
    cells = [("section", "measure", "value", "ceiling", "ratio", "target", "unit")]
    cells += [(r.section, r.measure, _fmt(r.value), _fmt(r.ceiling), "" if r.ratio is None else f"{r.ratio:.2f}",
               "" if r.target is None else f">= {r.target:g} {'met' if r.met else 'MISSED'}", r.unit) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(7)]
    lines = ["  ".join(c.ljust(w) if i in (0, 1, 5, 6) else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(line.rstrip() for line in lines)


def markdown(run: Run, header: str) -> str:
    out = [header, "", "| section | measure | value | ceiling | ratio | target | unit |", "|---|---|---:|---:|---:|---|---|"]
    for r in run.rows:
        target = "" if r.target is None else f">= {r.target:g} {'met' if r.met else '**missed**'}"
        out.append(f"| {r.section} | {r.measure} | {_fmt(r.value)} | {_fmt(r.ceiling)} | "
                   f"{'' if r.ratio is None else f'{r.ratio:.2f}'} | {target} | {r.unit} |")
    out += ["", "| check | result | detail |", "|---|---|---|"]
    out += [f"| {c.name} | {'ok' if c.passed else '**FAILED**'} | {c.detail} |" for c in run.checks]
    out += [""] + [f"- {n}" for n in run.notes]
    return "\n".join(out) + "\n"


def _environment(device) -> dict:
    import torch

    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name(device) if device.type == "cuda"
           else "CPU", "python": sys.version.split()[0]}
    for name in ("triton", "google.protobuf", "jax", "transformers"):
        try:
            env[name] = importlib.import_module(name).__version__
        except Exception as e:  # noqa: BLE001
            env[name] = f"missing ({type(e).__name__})"
    return env


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/gpu.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", help="auto (cuda when present), cpu, cuda, cuda:N")
    p.add_argument("--dry-run", "--tiny", action="store_true", help="a tiny Llama and small sizes (CPU: seconds)")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu-results"),
                   help="where gpu.json and gpu.md go (default: $OUT, else ./gpu-results)")
    p.add_argument("--time-limit", type=float, default=540.0, help="seconds for the whole run (sections that "
                   "would not fit are skipped and named in the notes)")
    p.add_argument("--skip", action="append", default=[],
                   choices=["ceilings", "correctness", "decode", "prefill", "handoff"],
                   help="leave a section out")
    args = p.parse_args(argv)
    deadline = Deadline(args.time_limit)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # the kernel checks run under Triton's interpreter
    try:
        import torch

        from pdserve.server.decode.device import resolve_device
        from pdserve.server.decode.engine import DecodeEngine  # noqa: F401 - the wire's protobuf, checked here
        from pdserve.server.model.config import parse_config
    except Exception as e:  # noqa: BLE001
        print(f"benchmarks/gpu.py cannot start: {e!r}. Carry the missing package as a wheel (pip download --no-deps "
              f"--only-binary=:all: --python-version 3.12 ... -d .whl NAME==VERSION; see the device README) and "
              f"install it with --no-deps --target before this script.", file=sys.stderr)
        return 2
    device = resolve_device(args.device)
    plan = dry_plan() if args.dry_run else Plan(LLAMA3_8B)
    config = parse_config(plan.raw_config)
    env = _environment(device)
    log(f"{config.describe()} on {env['device']}; {env}")
    run = Run()
    sections = [("ceilings", lambda: ceilings(plan, device, run)),
                ("correctness", lambda: correctness(plan, device, run)),
                ("decode", lambda: asyncio.run(decode(plan, config, device, run, deadline))),
                ("prefill", lambda: prefill(plan, config, device, run, deadline, args.dry_run, args.out)),
                ("handoff", lambda: handoff(plan, config, device, run, deadline))]
    for name, section in sections:
        if name in args.skip:
            continue
        try:  # unattended: a failing section is reported and the others still run
            section()
        except Exception as e:  # noqa: BLE001
            import traceback

            run.notes.append(f"{name}: failed with {e!r} (traceback on stderr)")
            run.checks.append(gpu_checks_failure(name, e))
            log(run.notes[-1])
            traceback.print_exc()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()  # each section's memory goes before the next allocates (JAX included)
    failed = [c.name for c in run.checks if not c.passed]
    doc = {"environment": env, "model": config.describe(), "plan": asdict(plan), "ceilings": run.ceilings,
           "rows": [asdict(r) | {"ratio": r.ratio, "met": r.met} for r in run.rows],
           "checks": [asdict(c) for c in run.checks], "notes": run.notes,
           "seconds": time.perf_counter() - _T0}
    (args.out / "gpu.json").write_text(json.dumps(doc, indent=1, default=str))
    header = (f"`benchmarks/gpu.py{' --dry-run' if args.dry_run else ''}` on {env['device']} (torch {env['torch']}, "
              f"triton {env['triton']}), {config.describe()}, {time.perf_counter() - _T0:.0f} s")
    (args.out / "gpu.md").write_text(markdown(run, header))
    log(f"done; wrote {args.out / 'gpu.json'} and gpu.md" + (f"; FAILED checks: {failed}" if failed else ""))
    print(table(run.rows))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
