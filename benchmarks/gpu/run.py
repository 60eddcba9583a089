"""pdserve on one GPU (the lent H200): every figure beside a ceiling measured in the same run, correctness first,
and a run that cannot lose its results.

    python benchmarks/gpu/boot.py download                               # here, once: the wheels to carry
    python3 benchmarks/gpu.py --out "$OUT"                                # there, carry=[".whl"]: no install
    python benchmarks/gpu.py --device cpu --dry-run --out /tmp/gpu        # tiny sizes, every stage, any machine

`benchmarks/gpu.py`, run as a file from a checkout, finds the `pdserve` package in the checkout itself and runs
this module (`python -m pdserve.benchmarks.gpu` where pdserve is installed), which first unpacks the wheels in
.whl/ (`boot.carry`: what the device image lacks, e.g. grpcio >= 1.85.1 for the generated stubs), then prints
the version and place of everything it imports.

Life of a run, inside one budget (--time-limit, 500 s for one 600 s device call):
1. Each stage runs in its own process (`--stage NAME`), under a deadline derived from what is left of the budget
   (its share of the stages still to run; `--stage-limit STAGE=SECONDS` caps one): a stage that overruns is
   killed with its process group, and its memory (torch's, JAX's) goes with it before the next starts.
2. A stage writes its rows, checks and notes to its own file as each one is made; when it ends (done, failed,
   killed), the parent merges what it wrote and rewrites gpu.json and gpu.md in --out; gpu.log there gets every
   line of every stage as it comes. A failure is recorded with its stage and its traceback's tail.
3. Stages, in order: `ceilings` (device copy and read bandwidth, bf16 matmul, host->device pinned and pageable);
   `correctness` (the Triton paged kernel against the reference, the served engine's greedy tokens, CUDA-graphed
   and eager, against transformers, the kernel path inside the model, received KV bit-exact, how int8/fp8
   weights compute); `decode` (the served engine, `startup.engine_for_model`, for a random Llama-3-8B-shape bf16
   model: batch 1 against the weight-streaming floor (target 0.85), batch 64 at 4k against the bandwidth
   roofline (target 0.7), each row naming the runner its steps took, graphs or eager; fp8 weights against bf16
   at batch 1, target faster); `kernels` (`gpu/kernels.py`: the paged kernel's verify form against the reference
   and the fused MoE kernels and torch's grouped matmul step against the grouped loop, then verify attention time
   vs k against the single-query kernel, and the fused MoE step of a Mixtral-shape layer vs batch against the
   read bandwidth, beside torch's grouped matmul; the LoRA BGMV kernels against the torch path, then a batch of
   16 mixing 4 adapters vs base only, `gpu/lora.py`); `mla` (`gpu/mla.py`: the absorbed-MLA decode kernel against
   expanded heads at DeepSeek-V2-Lite's attention shape, then its time per layer at batch 1/16/64 over 4k tokens
   against the gathered torch path and expanded attention, and its latent reads against the read bandwidth);
   `prefill` (`gpu/prefill.py`'s `run`: the served JAX path's MFU at 512 and 4k tokens; then `gpu/prefill_lora.py`:
   a packed step mixing the base and 2 adapters against merged-weight references, and a step of 8 x 512 tokens
   mixing 4 adapters against the base step), then `prefill-16k` on its own (only once the 512 and 4k rows are in);
   `handoff` (KvSender -> KvReceiver ->
   the decode cache on the device, against raw grpcio); `served` (`gpu/served.py`: a prefill worker, a decode
   worker and a coordinator as processes, greedy parity with transformers, TTFT/ITL through the gRPC API).
4. A row with a target reads met or MISSED only when the checks it rests on passed; else `unverified`.
Exit status: 0 when every check passed and every stage ended, else 1.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from pdserve.benchmarks.gpu import boot as gpu_boot

SCRIPT = Path(__file__).resolve().parents[1] / "gpu.py"
"""`benchmarks/gpu.py`, the file each stage's process runs (as the device runs the whole: no install needed)."""

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
    runner: str | None = None
    """Decode rows: how the timed steps ran, "graphs" (CUDA graphs replayed), "eager", or "mixed"."""
    needs: tuple[str, ...] = ()
    """Check groups the figure rests on: a failed (or absent) one makes a row with a target `unverified`."""

    @property
    def ratio(self) -> float | None:
        return None if not self.ceiling else self.value / self.ceiling

    def verdict(self, checks: list[dict]) -> str:
        """"" (no target), "met", "MISSED", or "unverified" (a check it needs failed or never ran)."""
        if self.target is None or self.ratio is None:
            return ""
        for group in self.needs:
            ran = [c for c in checks if c.get("group") == group]
            if not ran or not all(c["passed"] for c in ran):
                return "unverified"
        return "met" if self.ratio >= self.target else "MISSED"


def row_from(d: dict) -> Row:
    names = {f.name for f in fields(Row)}
    return Row(**{k: (tuple(v) if k == "needs" else v) for k, v in d.items() if k in names})


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


class Deadline:
    def __init__(self, seconds: float):
        self.end = time.perf_counter() + seconds

    def left(self) -> float:
        return self.end - time.perf_counter()


class StageResult:
    """What one stage measured, written to its file after every addition (a killed stage keeps what it had)."""

    def __init__(self, path: Path, deadline: Deadline, context: dict):
        self.path = path
        self.deadline = deadline
        self.context = context
        """The merged results of the stages before (their ceilings and checks)."""
        self.rows: list[Row] = []
        self.checks: list[dict] = []
        self.ceilings: dict = {}
        self.notes: list[str] = []
        self.error: dict | None = None

    def save(self) -> None:
        doc = {"rows": [asdict(r) for r in self.rows], "checks": self.checks, "ceilings": self.ceilings,
               "notes": self.notes, "error": self.error, "sys_path_first": sys.path[0]}
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=1, default=str))
        os.replace(tmp, self.path)

    def row(self, *rows: Row) -> None:
        self.rows += rows
        for r in rows:
            log(f"{r.section}: {r.measure}: {r.value:.4g} {r.unit}" + (f" (runner {r.runner})" if r.runner else ""))
        self.save()

    def check(self, *checks) -> None:
        for c in checks:
            d = asdict(c)
            self.checks.append(d)
            log(f"{'ok  ' if d['passed'] else 'FAIL'} [{d.get('group', '')}] {d['name']}: {d['detail']}")
        self.save()

    def note(self, text: str) -> None:
        log(text)
        self.notes.append(text)
        self.save()

    def ceiling(self, **values: float) -> None:
        self.ceilings.update(values)
        self.save()

    def allows(self, what: str, seconds: float) -> bool:
        """Whether `what` (~seconds) fits in the stage's deadline; a note says so when it does not."""
        if self.deadline.left() >= seconds:
            return True
        self.note(f"{what}: skipped, {self.deadline.left():.0f} s left of the stage's deadline and it needs "
                  f"~{seconds:.0f} s")
        return False

    def known_ceiling(self, name: str) -> float | None:
        return self.ceilings.get(name, self.context.get("ceilings", {}).get(name))


# ---- stages (each runs in its own process) ---------------------------------------------------------


def ceilings(plan: Plan, device, out: StageResult, dry_run: bool) -> None:
    import torch

    from pdserve.benchmarks.gpu.decode import _best

    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    src = torch.ones(plan.copy_bytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    copy_s = _best(lambda: dst.copy_(src), plan.repeats, sync)
    read_s = _best(lambda: src.sum(dtype=torch.float32), plan.repeats, sync)
    del dst
    out.ceiling(copy_gbps=2 * plan.copy_bytes / copy_s / GB, read_sum_gbps=plan.copy_bytes / read_s / GB)
    c = out.ceilings
    out.row(Row("ceiling", f"device copy {plan.copy_bytes / 2**30:.3g} GiB (read + write)", c["copy_gbps"],
                unit="GB/s"),
            Row("ceiling", f"device read (sum of {plan.copy_bytes / 2**30:.3g} GiB bf16)", c["read_sum_gbps"],
                unit="GB/s"))
    n = plan.matmul_n
    a = torch.randn(n, n, device=device).to(torch.bfloat16)
    b = torch.randn(n, n, device=device).to(torch.bfloat16)
    out.ceiling(matmul_bf16_tflops=2 * n**3 / _best(lambda: a @ b, plan.repeats, sync) / 1e12)
    out.row(Row("ceiling", f"bf16 matmul {n}^3", c["matmul_bf16_tflops"], unit="TFLOP/s"))
    if cuda:
        host = torch.ones(plan.h2d_bytes, dtype=torch.uint8)
        pinned = host.pin_memory()
        target = torch.empty(plan.h2d_bytes, dtype=torch.uint8, device=device)
        out.ceiling(h2d_pageable_gbps=plan.h2d_bytes / _best(lambda: target.copy_(host), plan.repeats, sync) / GB,
                    h2d_pinned_gbps=plan.h2d_bytes / _best(lambda: target.copy_(pinned, non_blocking=True),
                                                           plan.repeats, sync) / GB)
        out.row(Row("ceiling", f"host->device pageable {plan.h2d_bytes / 2**20:.0f} MiB", c["h2d_pageable_gbps"],
                    unit="GB/s"),
                Row("ceiling", f"host->device pinned {plan.h2d_bytes / 2**20:.0f} MiB", c["h2d_pinned_gbps"],
                    unit="GB/s"))


def correctness(plan: Plan, device, out: StageResult, dry_run: bool) -> None:
    from pdserve.benchmarks.gpu import checks as gpu_checks
    from pdserve.server.decode.cuda_attention import have_triton

    interpreted = device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
    if have_triton() and (device.type == "cuda" or interpreted):
        kv = ("bfloat16", "float32", "int8", "fp8_e4m3") if device.type == "cuda" else ("float32", "int8")
        out.check(*gpu_checks.kernel_checks(device, kv, plan.large_kernel_checks))
    else:
        out.note("paged kernel checks: skipped (triton missing, or CPU without TRITON_INTERPRET=1)")
    out.check(*gpu_checks.parity_checks(device, cpu_kernel=interpreted and have_triton(), work=out.path.parent))
    out.check(gpu_checks.received_kv_check(device))
    out.check(*gpu_checks.weight_kernel_checks(device))


async def _decode(plan: Plan, config, device, out: StageResult) -> None:
    import torch

    from pdserve.benchmarks.gpu import decode as gpu_decode
    from pdserve.server.decode.config import DecodeConfig
    from pdserve.server.decode.quant import quantize
    from pdserve.server.decode.startup import engine_for_model

    log("decode: a random bf16 model on the device")
    model = gpu_decode.random_model(config, torch.bfloat16, device)
    weights = gpu_decode.weight_bytes(model)
    floor_s = gpu_decode.streaming_floor(model, plan.repeats)
    bandwidth = max(weights / floor_s / GB, out.known_ceiling("read_sum_gbps") or 0.0)
    out.ceiling(weight_stream_floor_s=floor_s, weight_stream_gbps=weights / floor_s / GB, roofline_read_gbps=bandwidth)
    out.row(Row("ceiling", f"weight-streaming floor ({weights / 1e9:.2f} GB of matmul weights, batch-1 matmuls"
                f"{', CUDA graph' if device.type == 'cuda' else ''})", 1 / floor_s, unit="steps/s"),
            Row("ceiling", "read bandwidth for the roofline (best of the floor's and the sum's)", bandwidth,
                unit="GB/s"))
    base = DecodeConfig(model_dir=Path("random-llama-3-8b-shape"), device=str(device), max_running=plan.max_running,
                        gpu_memory_utilization=plan.gpu_memory_utilization if device.type == "cuda" else None,
                        enable_prefix_caching=False, kv_cache_memory="64MiB")
    t = time.perf_counter()
    engine, layout = engine_for_model(base, model)
    buckets = sorted(getattr(engine.runner, "graphs", {}))
    out.note(f"served engine ready in {time.perf_counter() - t:.1f} s: {engine.pool.num_total} blocks, "
             f"{type(engine.runner).__name__}" + (f", CUDA graphs captured for batches {buckets}"
                                                  if hasattr(engine.runner, "graphs") else ""))
    kv = gpu_decode.random_kv(config, max(c for _, c in plan.points), layout.dtype)
    bf16_floor_step = None
    for batch, ctx in plan.points:
        if not out.allows(f"decode B={batch} ctx={ctx}", 25):
            continue
        if batch * layout.num_blocks(ctx + plan.warmup + plan.steps + 2) > engine.pool.num_total:
            out.note(f"decode B={batch} ctx={ctx}: skipped, the cache holds {engine.pool.num_total} blocks")
            continue
        p = await _point(engine, batch, ctx, plan, kv)
        roofline_s = (p.weight_bytes + p.kv_bytes) / (bandwidth * GB)
        needs = ("kernel", "graphs" if p.runner == "graphs" else "eager")
        target = 0.7 if (batch, ctx) == plan.roofline_point else None
        rows = [Row("decode bf16", f"tokens/s B={batch} ctx={ctx} vs roofline", p.tokens_per_s, batch / roofline_s,
                    "tok/s", target, p.runner, needs),
                Row("decode bf16", f"ms/step B={batch} ctx={ctx}", p.step_s * 1e3, unit="ms", runner=p.runner),
                Row("decode bf16", f"KV in B={batch} ctx={ctx} (engine.write, pinned + copy)", p.ingest_gbps,
                    out.known_ceiling("h2d_pinned_gbps"), "GB/s")]
        if (batch, ctx) == plan.floor_point:
            bf16_floor_step = p.step_s
            rows.append(Row("decode bf16", f"steps/s B={batch} ctx={ctx} vs weight-streaming floor", 1 / p.step_s,
                            1 / floor_s, "steps/s", 0.85, p.runner, needs))
        out.row(*rows)
    await engine.close()
    if device.type == "cuda":
        try:
            count, ms = gpu_decode.kernels_per_step(engine)
            out.row(Row("decode bf16", f"CUDA kernels in one eager B=1 step ({ms:.2f} ms of device time)", count,
                        unit="kernels"))
        except Exception as e:  # noqa: BLE001 - a diagnostic
            out.note(f"kernel count: the profiler failed ({e!r})")
    gpu_decode.free(engine)
    del engine
    gc.collect()
    if bf16_floor_step is None or not out.allows("fp8 weights", 60):
        return
    how = quantize(model, "fp8")
    out.note(f"fp8: {how}")
    fp8_config = DecodeConfig(model_dir=base.model_dir, device=str(device), max_running=1, weight_dtype="fp8",
                              kv_cache_tokens=4 * (plan.floor_point[1] + plan.warmup + plan.steps + 64),
                              enable_prefix_caching=False)
    engine, _ = engine_for_model(fp8_config, model)
    batch, ctx = plan.floor_point
    p = await _point(engine, batch, ctx, plan, kv)
    needs = ("kernel", "graphs" if p.runner == "graphs" else "eager", "fp8")
    out.row(Row("decode fp8", f"steps/s B={batch} ctx={ctx} fp8 vs bf16 ({how})", 1 / p.step_s, 1 / bf16_floor_step,
                "steps/s", 1.0, p.runner, needs),
            Row("decode fp8", f"steps/s B={batch} ctx={ctx} fp8 vs the bf16 weight-streaming floor", 1 / p.step_s,
                1 / floor_s, "steps/s", runner=p.runner))
    await engine.close()
    gpu_decode.free(engine)


def decode(plan: Plan, device, out: StageResult, dry_run: bool) -> None:
    from pdserve.server.model.config import parse_config

    asyncio.run(_decode(plan, parse_config(plan.raw_config), device, out))


async def _point(engine, batch: int, ctx: int, plan: Plan, kv):
    from pdserve.benchmarks.gpu import decode as gpu_decode

    return await gpu_decode.run_point(engine, batch, ctx, plan.warmup, plan.steps, kv, seed=batch * 7919 + ctx, log=log)


def _prefill(out: StageResult, dry_run: bool, lengths: tuple[int, ...] | None) -> None:
    """benchmarks/gpu/prefill.py's served-path MFU (its `run`), its files beside the stage's."""
    from pdserve.benchmarks.gpu import prefill as gpu_prefill

    log(f"prefill: gpu_prefill.run at lengths {lengths or 'its own'}")
    result = gpu_prefill.run(out.path.parent, dry_run=dry_run, lengths=lengths,
                             on_row=lambda r: out.row(_prefill_row(r)))
    out.note(f"prefill: {result['model']} on {result['device']}, {result['shapes_compiled']} shapes compiled in "
             f"{result['compile_s']:.1f} s")


def _prefill_row(r: dict) -> Row:
    return Row("prefill", f"TFLOP/s S={r['tokens']} (served PrefillEngine, TTFT {r['ttft_median_s'] * 1e3:.1f} ms)",
               r["prefill_tflops"], r["matmul_tflops"], "TFLOP/s")


def prefill(plan: Plan, device, out: StageResult, dry_run: bool) -> None:
    from pdserve.benchmarks.gpu import prefill_lora
    from pdserve.benchmarks.gpu.checks import Check

    _prefill(out, dry_run, (32, 64) if dry_run else (512, 4096))
    gc.collect()
    if out.allows("prefill LoRA check", 1 if dry_run else 25):
        log("prefill: a step mixing the base and 2 adapters vs merged-weight references")
        out.check(*prefill_lora.lora_check(out.path.parent, dry_run, Check))
        gc.collect()
    if out.allows("prefill LoRA timing", 1 if dry_run else 20):
        log("prefill: a step mixing 4 adapters vs the base step")
        prefill_lora.lora_rows(out.path.parent, dry_run, out, Row, log)


def prefill_16k(plan: Plan, device, out: StageResult, dry_run: bool) -> None:
    _prefill(out, dry_run, (128,) if dry_run else (16384,))


async def _handoff(config, plan: Plan, device, out: StageResult) -> None:
    import numpy as np
    import torch

    from pdserve.benchmarks.kv import push as kv_push
    from pdserve.benchmarks.ceilings import grpc_loopback_gbps
    from pdserve.benchmarks.gpu.checks import Check
    from pdserve.benchmarks.gpu.decode import random_kv
    from pdserve.kvcache.layout import KvLayout
    from pdserve.kvcache.receiver import KvReceiver
    from pdserve.kvcache.grpc_sender import GrpcKvTransport
    from pdserve.server.decode.kv_cache import PagedKvCache

    layout = KvLayout(config.num_layers, config.num_kv_heads, config.head_dim, block_size=16, dtype="bfloat16")
    n = plan.transfer_tokens
    nbytes = n * layout.bytes_per_token
    raw = await grpc_loopback_gbps(nbytes, plan.repeats)
    out.ceiling(grpc_loopback_gbps=raw)
    out.row(Row("ceiling", f"raw grpcio loopback {nbytes / 1e6:.3g} MB", raw, unit="GB/s"))
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
    got_k, got_v = cache.read(table, n)
    same = np.array_equal(got_k.float().cpu().numpy(), k.astype(np.float32)) and \
        np.array_equal(got_v.float().cpu().numpy(), v.astype(np.float32))
    out.check(Check(f"KV handoff: the decode cache holds the {n} tokens sent, bit for bit", same,
                    "equal" if same else "the KV in the decode cache differs from what was sent", group="handoff"))
    out.row(Row("kv-handoff", f"GB/s {n} tok {nbytes / 1e6:.3g} MB host->wire->device", nbytes / best / GB, raw,
                "GB/s", needs=("handoff",)))


def handoff(plan: Plan, device, out: StageResult, dry_run: bool) -> None:
    from pdserve.server.model.config import parse_config

    asyncio.run(_handoff(parse_config(plan.raw_config), plan, device, out))


def kernels(plan: Plan, device, out: StageResult, dry_run: bool) -> None:
    from pdserve.benchmarks.gpu import kernels as gpu_kernels
    from pdserve.benchmarks.gpu.checks import Check

    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        out.note("kernels: skipped (a CPU without TRITON_INTERPRET=1)")
        return
    gpu_kernels.run(out, device, dry_run=dry_run, row_type=Row, check_type=Check, log=log)


def mla(plan: Plan, device, out: StageResult, dry_run: bool) -> None:
    from pdserve.benchmarks.gpu import mla as gpu_mla
    from pdserve.benchmarks.gpu.checks import Check

    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        out.note("mla: skipped (a CPU without TRITON_INTERPRET=1)")
        return
    gpu_mla.run(out, device, dry_run=dry_run, row_type=Row, check_type=Check, log=log)


def served(plan: Plan, device, out: StageResult, dry_run: bool) -> None:
    from pdserve.benchmarks.gpu import served as gpu_served

    gpu_served.run(out, device, dry_run=dry_run, row_type=Row, log=log)


@dataclass(frozen=True)
class Stage:
    name: str
    run: Callable
    share: float
    """Its part of the budget (of what is left, against the stages still to run)."""
    min_s: float
    """It is skipped when less than this is left for it (a dry run: never)."""


STAGES = (
    Stage("ceilings", ceilings, 0.05, 15),
    Stage("correctness", correctness, 0.14, 30),
    Stage("decode", decode, 0.24, 60),
    Stage("kernels", kernels, 0.10, 25),
    Stage("mla", mla, 0.06, 20),
    Stage("prefill", prefill, 0.19, 75),
    Stage("handoff", handoff, 0.05, 15),
    Stage("prefill-16k", prefill_16k, 0.10, 40),
    Stage("served", served, 0.23, 90),
)


def run_stage(args) -> int:
    """In the stage's own process: the stage, its results saved as they come, a failure with its traceback."""
    stage = next(s for s in STAGES if s.name == args.stage)
    context = json.loads(args.context.read_text()) if args.context and args.context.exists() else {}
    out = StageResult(args.stage_out, Deadline(args.deadline), context)
    out.save()
    try:
        if stage.name in dict(i.split("=", 1) for i in args.inject):  # tests: a stage made to fail or overrun
            how = dict(i.split("=", 1) for i in args.inject)[stage.name]  # (first: no import to wait for)
            if how == "hang":
                out.note("injected: this stage hangs")
                time.sleep(3600)
            raise RuntimeError(f"injected failure of stage {stage.name}")
        import torch

        from pdserve.server.decode.device import resolve_device

        device = resolve_device(args.device)
        plan = dry_plan() if args.dry_run else Plan(LLAMA3_8B)
        stage.run(plan, device, out, args.dry_run)
        if device.type == "cuda" and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # an asynchronous CUDA error surfaces here, in this stage
    except BaseException as e:  # noqa: BLE001 - recorded; the parent runs the next stage
        out.error = {"error": repr(e), "traceback": traceback.format_exc()[-3000:]}
        out.save()
        traceback.print_exc()
        return 1
    return 0


# ---- the run: stages in processes, results rewritten after each ----------------------------------


class Report:
    """Everything the run has so far, rewritten to gpu.json and gpu.md after each stage."""

    def __init__(self, out: Path, env: dict, args, carried: list[str]):
        self.out = out
        self.doc = {"environment": env, "carried_wheels": carried, "dry_run": args.dry_run, "device": args.device,
                    "time_limit_s": args.time_limit, "stages": [], "rows": [], "checks": [], "ceilings": {},
                    "notes": [], "seconds": 0.0}

    def merge(self, stage: str, part: dict, status: str, seconds: float, error: dict | None,
              cpu_s: float = 0.0) -> None:
        d = self.doc
        for r in part.get("rows", []):
            d["rows"].append(dict(r, stage=stage))
        d["checks"] += [dict(c, stage=stage) for c in part.get("checks", [])]
        d["ceilings"].update(part.get("ceilings", {}))
        d["notes"] += [f"{stage}: {n}" for n in part.get("notes", [])]
        d["stages"].append({"stage": stage, "status": status, "seconds": round(seconds, 1),
                            "cpu_s": round(cpu_s, 1), "sys_path_first": part.get("sys_path_first"), **(error or {})})
        self.write()

    def write(self) -> None:
        d = self.doc
        d["seconds"] = time.perf_counter() - _T0
        for r in d["rows"]:
            row = row_from(r)
            r["ratio"], r["verdict"] = row.ratio, row.verdict(d["checks"])
        tmp = self.out / "gpu.json.tmp"
        tmp.write_text(json.dumps(d, indent=1, default=str))
        os.replace(tmp, self.out / "gpu.json")
        (self.out / "gpu.md").write_text(markdown(d))

    @property
    def failed(self) -> bool:
        d = self.doc
        return any(not c["passed"] for c in d["checks"]) or any(s["status"] not in ("ok", "skipped")
                                                                 for s in d["stages"])


def _pump(stream, sink, prefix: str) -> None:
    for line in iter(stream.readline, ""):
        line = f"{prefix}{line}"
        sys.stderr.write(line)
        sys.stderr.flush()
        sink.write(line)
        sink.flush()


def _launch(stage: Stage, args, work: Path, report: Report, seconds: float, logfile) -> tuple[str, dict, dict | None]:
    """The stage in its own process group, killed with its children past `seconds` -> (status, its results, error)."""
    part_path = work / f"{stage.name}.json"
    context = work / "context.json"
    context.write_text(json.dumps({"ceilings": report.doc["ceilings"], "checks": report.doc["checks"]}))
    cmd = [sys.executable, *(["-S"] if sys.flags.no_site else []), str(SCRIPT), "--stage", stage.name,
           "--stage-out", str(part_path), "--context", str(context), "--deadline", f"{max(seconds - 10, 1):.1f}",
           "--device", args.device, *(["--dry-run"] if args.dry_run else []),
           *(a for i in args.inject for a in ("--inject", i))]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    pump = threading.Thread(target=_pump, args=(proc.stdout, logfile, f"[{stage.name}] "), daemon=True)
    pump.start()
    try:
        rc = proc.wait(timeout=seconds)
        status = "ok" if rc == 0 else "failed"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the stage and every process it started (the served pair's)
        proc.wait()
        rc, status = None, "overran"
    pump.join(5)
    try:
        part = json.loads(part_path.read_text())
    except (OSError, ValueError) as e:
        part = {"notes": [f"its results could not be read ({e!r})"]}
    error = part.get("error")
    if status == "overran":
        error = {"error": f"overran its deadline of {seconds:.0f} s: killed with its processes; what it had "
                          f"written is kept", **({"traceback": error["traceback"]} if error else {})}
    elif status == "failed" and not error:
        error = {"error": f"exited with status {rc} before recording a failure (killed? out of memory?)"}
    return status, part, error


def _children_cpu_s() -> float:
    """CPU seconds (user + system) of the finished processes this one waited for, and of those they waited for."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def orchestrate(args) -> int:
    site, carried = gpu_boot.carry(args.wheels)
    env = gpu_boot.versions()
    env["python"] = sys.version.split()[0]
    env["carried_site"] = str(site) if site else None
    log("versions: " + "; ".join(f"{k} {v}" for k, v in env.items()))
    args.out.mkdir(parents=True, exist_ok=True)
    report = Report(args.out, env, args, carried)
    missing = [m for m in gpu_boot.REQUIRED if str(env.get(m, "")).startswith("missing")]
    if missing:
        report.doc["notes"].append(f"cannot start: {', '.join(missing)} missing; carry them as wheels "
                                   f"(benchmarks/gpu/boot.py download, carry=['.whl'])")
        report.write()
        log(report.doc["notes"][-1])
        return 2
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # the kernel checks run under Triton's interpreter
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    budget = Deadline(args.time_limit)
    stages = [s for s in STAGES if s.name not in args.skip and (not args.only or s.name in args.only)]
    with tempfile.TemporaryDirectory(prefix="pdserve-gpu-stages-") as tmp, \
            open(args.out / "gpu.log", "a") as logfile:
        for i, stage in enumerate(stages):
            shares = sum(s.share for s in stages[i:])
            seconds = min(budget.left() * stage.share / shares, args.stage_limit.get(stage.name, float("inf")))
            if seconds < (1 if args.dry_run else stage.min_s):
                report.merge(stage.name, {}, "skipped", 0.0, {"error": f"{budget.left():.0f} s left of --time-limit, "
                                                               f"{seconds:.0f} s its share; it needs {stage.min_s:.0f} s"})
                continue
            log(f"stage {stage.name}: deadline {seconds:.0f} s ({budget.left():.0f} s left of the budget)")
            t, cpu = time.perf_counter(), _children_cpu_s()
            status, part, error = _launch(stage, args, Path(tmp), report, seconds, logfile)
            cpu = _children_cpu_s() - cpu
            report.merge(stage.name, part, status, time.perf_counter() - t, error, cpu)
            log(f"stage {stage.name}: {status} in {time.perf_counter() - t:.0f} s ({cpu:.0f} s of CPU)" +
                (f": {error['error']}" if error else ""))
    log(f"done; wrote {args.out / 'gpu.json'}, gpu.md and gpu.log")
    print(table([row_from(r) for r in report.doc["rows"]], report.doc["checks"]))
    return 1 if report.failed else 0


# ---- output ---------------------------------------------------------------------------------------


def _fmt(x: float | None) -> str:
    return "" if x is None else (f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}")


def _target(r: Row, checks: list[dict], bold: bool = False) -> str:
    if r.target is None:
        return ""
    verdict = r.verdict(checks)
    return f">= {r.target:g} " + (f"**{verdict}**" if bold and verdict != "met" else verdict)


def table(rows: list[Row], checks: list[dict]) -> str:
    cells = [("section", "measure", "value", "ceiling", "ratio", "target", "unit", "runner")]
    cells += [(r.section, r.measure, _fmt(r.value), _fmt(r.ceiling), "" if r.ratio is None else f"{r.ratio:.2f}",
               _target(r, checks), r.unit, r.runner or "") for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(8)]
    lines = ["  ".join(c.ljust(w) if i in (0, 1, 5, 6, 7) else c.rjust(w)
                       for i, (c, w) in enumerate(zip(row, widths))) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(line.rstrip() for line in lines)


def markdown(doc: dict) -> str:
    env = doc["environment"]
    header = (f"`benchmarks/gpu.py{' --dry-run' if doc['dry_run'] else ''}` on {doc['device']} (torch "
              f"{env.get('torch', '?').split()[0]}, triton {env.get('triton', '?').split()[0]}, jax "
              f"{env.get('jax', '?').split()[0]}), {doc['seconds']:.0f} s of --time-limit {doc['time_limit_s']:.0f}")
    rows = [row_from(r) for r in doc["rows"]]
    checks = doc["checks"]
    out = [header, "", "| stage | status | seconds | error |", "|---|---|---:|---|"]
    out += [f"| {s['stage']} | {s['status']} | {s['seconds']} | {s.get('error', '')} |" for s in doc["stages"]]
    out += ["", "| section | measure | value | ceiling | ratio | target | unit | runner |",
            "|---|---|---:|---:|---:|---|---|---|"]
    out += [f"| {r.section} | {r.measure} | {_fmt(r.value)} | {_fmt(r.ceiling)} | "
            f"{'' if r.ratio is None else f'{r.ratio:.2f}'} | {_target(r, checks, bold=True)} | {r.unit} | "
            f"{r.runner or ''} |" for r in rows]
    out += ["", "| check | group | result | detail |", "|---|---|---|---|"]
    out += [f"| {c['name']} | {c.get('group', '')} | {'ok' if c['passed'] else '**FAILED**'} | {c['detail']} |"
            for c in checks]
    out += [""] + [f"- {n}" for n in doc["notes"]]
    for s in doc["stages"]:
        if s.get("traceback"):
            out += ["", f"stage {s['stage']} ({s['status']}): traceback's tail", "```", s["traceback"].rstrip(), "```"]
    out += ["", "versions: " + "; ".join(f"{k} {v}" for k, v in env.items())]
    return "\n".join(out) + "\n"


def _stage_limit(text: str) -> tuple[str, float]:
    """--stage-limit STAGE=SECONDS -> (STAGE, SECONDS)."""
    name, _, seconds = text.partition("=")
    names = [s.name for s in STAGES]
    try:
        if name in names and float(seconds) > 0:
            return name, float(seconds)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"{text!r}: give STAGE=SECONDS, a stage of {', '.join(names)} and seconds > 0")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/gpu.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", help="auto (cuda when present), cpu, cuda, cuda:N")
    p.add_argument("--dry-run", "--tiny", action="store_true", help="a tiny Llama and small sizes (CPU: a minute)")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu-results"),
                   help="where gpu.json, gpu.md and gpu.log go (default: $OUT, else ./gpu-results)")
    p.add_argument("--time-limit", type=float, default=500.0,
                   help="seconds for the whole run; each stage's deadline is its share of what is left")
    p.add_argument("--wheels", type=Path, default=gpu_boot.ROOT / ".whl",
                   help="wheels to unpack first on sys.path (default: the checkout's .whl/, when present)")
    names = [s.name for s in STAGES]
    p.add_argument("--skip", action="append", default=[], choices=names, help="leave a stage out")
    p.add_argument("--only", action="append", default=[], choices=names, help="run only these stages")
    p.add_argument("--stage-limit", action="append", default=[], type=_stage_limit, metavar="STAGE=SECONDS",
                   help="a stage's deadline at most SECONDS (default: its share of what is left of --time-limit)")
    p.add_argument("--stage", choices=names, help=argparse.SUPPRESS)  # a stage's own process
    p.add_argument("--stage-out", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--context", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=60.0, help=argparse.SUPPRESS)
    p.add_argument("--inject", action="append", default=[], help=argparse.SUPPRESS)  # STAGE=fail|hang (tests)
    args = p.parse_args(argv)
    args.stage_limit = dict(args.stage_limit)
    if args.stage:
        return run_stage(args)
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
