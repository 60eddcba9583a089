"""Correctness before speed, for `benchmarks/gpu.py`: the paged-attention kernel against the reference
attention, the served engine's greedy tokens (CUDA graphs and eager) against transformers, the kernel path
against the reference inside the model, and received KV copied onto the device bit-exactly.

Each check returns a `Check` (name, passed, detail, worst error); none raises, so one failure leaves the
others and the timings to run.
"""

from __future__ import annotations

import asyncio
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch


@dataclass
class Check:
    name: str
    passed: bool
    detail: str
    error: float | None = None
    group: str = ""
    """What it vouches for ("kernel", "graphs", "eager", "kv", "fp8", "int8", "handoff", "served"): a row
    of `benchmarks/gpu.py` with a target needs its groups' checks passed to read met or MISSED."""


def _reference_attention(q, cache, layer: int, tables, lens):
    """The reference paged attention (`attention.paged_attention`, what CPU decode runs) of one new token per
    row at its context's last position: q [B, H, D] -> [B, H, D]."""
    from pdserve.server.decode.attention import PagedContext, paged_attention

    context = PagedContext.build((lens - 1)[:, None], tables, lens, cache.block_size, q.device, q.dtype,
                                 groups=q.shape[1] // cache.layout.num_kv_heads)
    return paged_attention(q[:, None], cache, layer, context)[:, 0]


def kernel_checks(device: torch.device, kv_dtypes: tuple[str, ...], large: bool) -> list[Check]:
    """The Triton kernel against the reference for each KV dtype, auto splits and one split; large: Llama-3-8B's
    heads (32 query / 8 kv, 128 dims, blocks of 16) and contexts up to 4000 tokens."""
    from pdserve.kvcache.layout import KvLayout
    from pdserve.server.decode.cuda_attention import paged_decode_attention
    from pdserve.server.decode.kv_cache import PagedKvCache

    H, Hkv, D, bs, lens = (32, 8, 128, 16, [1, 100, 4000]) if large else (4, 2, 32, 4, [1, 17, 40])
    num_blocks = sum(-(-n // bs) for n in lens) + 8
    checks = []
    for kv_dtype in kv_dtypes:
        q_dtype = torch.float32 if kv_dtype in ("float32",) or device.type == "cpu" else torch.bfloat16
        tol = 1e-4 if q_dtype == torch.float32 else 2e-2
        layout = KvLayout.of(1, Hkv, D, bs, kv_dtype)
        cache = PagedKvCache(layout, num_blocks, device=device)
        g = torch.Generator(device="cpu").manual_seed(0)
        n = num_blocks * bs
        cache.store(0, torch.arange(n, device=device), torch.randn(n, Hkv, D, generator=g).to(device),
                    torch.randn(n, Hkv, D, generator=g).to(device))
        order = torch.randperm(num_blocks, generator=g)
        width = max(-(-x // bs) for x in lens)
        tables = torch.stack([order[(torch.arange(width) + 37 * i) % num_blocks] for i in range(len(lens))]
                             ).to(device)  # [B, M] scattered blocks (rows may share some: only read)
        ctx = torch.tensor(lens, device=device)
        q = torch.randn(len(lens), H, D, generator=g).to(device, q_dtype)
        expected = _reference_attention(q, cache, 0, tables, ctx).float()
        scales = (None, None) if cache.k_scales is None else (cache.k_scales[0], cache.v_scales[0])
        for splits in (None, 1):
            name = f"paged kernel vs reference: {kv_dtype} KV, q {str(q_dtype)[6:]}, splits {splits or 'auto'}"
            try:
                got = paged_decode_attention(q, cache.k[0], cache.v[0], tables, ctx, *scales, splits=splits).float()
                err = (got - expected).abs().max().item()
                checks.append(Check(name, err < tol, f"max abs error {err:.2e} (tolerance {tol:g})", err, "kernel"))
            except Exception as e:  # noqa: BLE001 - reported, the run goes on
                checks.append(Check(name, False, f"raised {e!r}", group="kernel"))
    return checks


PARITY_PROMPTS = [list(range(3, 14)), list(range(40, 45)), list(range(100, 133))]
"""The prompts whose greedy tokens the correctness stage and the served stage check against transformers'."""


def tiny_llama(work: Path) -> Path:
    """The tiny random llama (fp32, `make_tiny_model`) the correctness and served stages check, made once in the
    run's folder of stage files (`work`) and found there by the stages after (each its own process)."""
    from pdserve.server.model.tiny import make_tiny_model

    path = Path(work) / "tiny-llama"
    if not path.is_dir():
        tmp = Path(tempfile.mkdtemp(prefix="tiny-llama-", dir=work))
        make_tiny_model(tmp, "llama")
        tmp.rename(path)  # whole or absent: a stage killed while making it leaves no half checkpoint
    return path


def hf_greedy(path: Path, prompts: list[list[int]], n: int, device=None) -> list[list[int]]:
    """transformers' greedy tokens (fp32, on `device`, the CPU by default), kept beside the checkpoint (one file
    per device type) so that a later stage asking the same of the same checkpoint reads them."""
    import json

    device = torch.device(device or "cpu")
    key = json.dumps([prompts, n])
    kept = path / f"greedy-{device.type}.json"
    known = json.loads(kept.read_text()) if kept.exists() else {}
    if key not in known:
        known[key] = _hf_greedy(path, prompts, n, device)
        kept.write_text(json.dumps(known))
    return known[key]


def _hf_greedy(path: Path, prompts: list[list[int]], n: int, device: torch.device) -> list[list[int]]:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    out = []
    for ids in prompts:
        with torch.no_grad():
            got = hf.generate(torch.tensor([ids], device=device), max_new_tokens=n, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
        out.append(got[0, len(ids):].tolist())
    return out


async def _engine_greedy(engine, prompts: list[list[int]], n: int) -> list[list[int]]:
    from pdserve.v1 import generation_pb2 as gen_pb
    from pdserve.v1 import worker_pb2 as pb

    async def one(i: int, ids: list[int]) -> list[int]:
        sampling = gen_pb.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        seq = engine.add(pb.DecodeRequest(request_id=f"parity-{i}", prompt_token_ids=ids, sampling=sampling,
                                          local_prefill=True))
        await seq.admitted
        first = await engine.prefill_locally(seq)
        engine.start(seq, first)
        got = [first]
        while (ids := await seq.events.get()) is not None:
            got.extend(ids)
        return got

    try:
        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
    finally:
        await engine.close()


def parity_checks(device: torch.device, cpu_kernel: bool, work: Path) -> list[Check]:
    """A tiny random llama (fp32, `tiny_llama(work)`): greedy tokens of the served engine on the device, 3 requests
    batched (a padded bucket of 4), with CUDA graphs and eager, equal transformers' on the CPU. Then the model's
    decode through the paged kernel against the reference path, fp32 and int8 KV.
    cpu_kernel: on the CPU, also run the engine through the kernel (Triton's interpreter)."""
    from pdserve.server.decode.config import DecodeConfig
    from pdserve.server.decode.startup import build_native_engine

    checks = []
    prompts = PARITY_PROMPTS
    n = 8
    path = tiny_llama(work)
    expected = hf_greedy(path, prompts, n)
    modes = [("CUDA graphs", False), ("eager", True)] if device.type == "cuda" else [("eager", True)]
    for label, eager in modes:
        group = "eager" if eager else "graphs"
        config = DecodeConfig(model_dir=path, device=str(device), kv_cache_tokens=1024, block_size=4,
                              max_running=8, enforce_eager=eager)
        name = f"greedy tokens = transformers' ({device.type}, {label}, 3 requests batched)"
        try:
            _, engine, _ = build_native_engine(config)
            if cpu_kernel and device.type == "cpu":
                engine.model.paged_kernel = True
                name += ", paged kernel (interpreter)"
            runner = engine.runner
            got = asyncio.run(_engine_greedy(engine, prompts, n))
            steps = dict(runner.steps)  # a bucket whose capture failed runs eagerly: the steps say which ran
            took = steps["eager"] == 0 if not eager else steps["graphs"] == 0
            checks.append(Check(name, got == expected and took,
                                f"{type(runner).__name__}, steps {steps}: got {got}, transformers {expected}",
                                group=group))
        except Exception as e:  # noqa: BLE001
            checks.append(Check(name, False, f"raised {e!r}", group=group))
    if device.type == "cuda":
        checks.append(_speculative_parity(path, device, prompts, n))
    if device.type == "cuda" or cpu_kernel:
        checks += _kernel_in_model(path, device)
    return checks


def _speculative_parity(path: Path, device: torch.device, prompts: list[list[int]], n: int) -> Check:
    """The served engine with n-gram speculation (k = 3) and CUDA graphs: verify steps through the paged kernel,
    replayed from their (bucket, new tokens) graphs; greedy tokens equal transformers'. Prompts that repeat
    themselves, so that proposals (and verify steps) come."""
    from pdserve.server.decode.config import DecodeConfig
    from pdserve.server.decode.startup import build_native_engine

    prompts = [p + p[:6] for p in prompts]
    name = "greedy tokens = transformers' (cuda, CUDA graphs, n-gram speculation k=3: verify graphs)"
    try:
        expected = hf_greedy(path, prompts, n)
        config = DecodeConfig(model_dir=path, device=str(device), kv_cache_tokens=1024, block_size=4, max_running=8,
                              speculative_config='{"method": "ngram", "num_speculative_tokens": 3}')
        _, engine, _ = build_native_engine(config)
        runner = engine.runner
        got = asyncio.run(_engine_greedy(engine, prompts, n))
        steps = dict(getattr(runner, "verify_steps", {}))
        return Check(name, got == expected, f"{type(runner).__name__}, verify steps {steps} "
                     f"({len(getattr(runner, 'verify_graphs', {}))} graphs): got {got}, transformers {expected}",
                     group="graphs")
    except Exception as e:  # noqa: BLE001
        return Check(name, False, f"raised {e!r}", group="graphs")


def _kernel_in_model(path: Path, device: torch.device) -> list[Check]:
    from pdserve.kvcache.layout import KvLayout
    from pdserve.server.decode.kv_cache import PagedKvCache
    from pdserve.server.decode.weights import build_model
    from pdserve.server.model.config import load_config
    from pdserve.server.model.weights import load_weights

    model = build_model(load_config(path), load_weights(path), device=device)
    c = model.config
    checks = []
    for kv_dtype in ("float32", "int8"):
        layout = KvLayout.of(c.num_layers, c.num_kv_heads, c.head_dim, 4, kv_dtype)
        tables = torch.tensor([[0, 1, 2, 3, 12, 12], [5, 6, 12, 12, 12, 12]])
        logits = {}
        for kernel in (False, True):
            cache = PagedKvCache(layout, 13, device=device)
            for ids, table in zip([list(range(3, 12)), list(range(40, 45))], tables.tolist()):
                model.prefill(torch.tensor(ids), table, cache)
            model.paged_kernel = kernel
            positions = torch.tensor([9, 5])
            logits[kernel] = torch.stack([model.decode(torch.tensor([100 + s, 7]), positions + s, tables,
                                                       positions + s + 1, cache) for s in range(3)]).cpu()
        model.paged_kernel = False
        err = (logits[True] - logits[False]).abs().max().item()
        checks.append(Check(f"model decode, paged kernel vs reference ({kv_dtype} KV, 3 steps)", err < 1e-3,
                            f"max abs logit error {err:.2e}", err, "kernel"))
    return checks


def received_kv_check(device: torch.device) -> Check:
    """engine.write (pinned staging + non-blocking copy on CUDA) puts the piece's bytes in the cache exactly,
    and the sequence's first step waits for it."""
    from pdserve.kvcache.codec import KvPiece
    from pdserve.kvcache.layout import KvLayout
    from pdserve.server.decode.kv_cache import PagedKvCache

    layout = KvLayout(4, 2, 64, 16, "bfloat16")
    cache = PagedKvCache(layout, 64, device=device)
    import ml_dtypes

    rng = np.random.default_rng(0)
    k = rng.standard_normal((4, 100, 2, 64), dtype=np.float32).astype(ml_dtypes.bfloat16)
    v = rng.standard_normal((4, 100, 2, 64), dtype=np.float32).astype(ml_dtypes.bfloat16)
    table = [9, 10, 11, 3, 40, 41, 42]
    piece = KvPiece(0, 0, k, v, None, None)
    copied = cache.write(table, piece.layer_start, piece.token_start, piece.k, piece.v)
    if copied is not None:
        torch.cuda.current_stream(device).wait_event(copied)
    got_k, got_v = cache.read(table, 100)
    same = np.array_equal(got_k.float().cpu().numpy(), k.astype(np.float32)) and \
        np.array_equal(got_v.float().cpu().numpy(), v.astype(np.float32))
    how = "pinned staging, non-blocking copy, event" if copied is not None else "CPU memcpy"
    return Check("received KV written bit-exactly (100 tokens, 7 scattered blocks)", same, how, group="kv")


def weight_kernel_checks(device: torch.device) -> list[Check]:
    """How int8/fp8 weights compute here, as `quant.quantize` decides it at load, and (where a kernel reads
    them) its output against x @ dequantized(w).T; on CUDA with triton, the fp8 activation-quantizing kernel's
    bytes against the torch ops'. A format without a kernel saves memory only: reported, not a failure."""
    from torch import nn

    from pdserve.server.decode import cuda_linear
    from pdserve.server.decode.cuda_attention import have_triton
    from pdserve.server.decode.quant import Linear, quantize

    out = []
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(4, 4096, generator=g).to(device, torch.bfloat16)
    for fmt in ("fp8", "int8"):
        name = f"{fmt} weights' matmul on {device.type}"
        try:
            holder = nn.Module()
            holder.linear = Linear(4096, 1024, False, torch.bfloat16, device)
            holder.linear.weight.normal_(0.0, 0.02)
            how = quantize(holder, fmt)
            if holder.linear.kernel is None:
                out.append(Check(name, True, how, group=fmt))
                continue
            with torch.no_grad():
                got = holder.linear(x).float()
                expected = x.float() @ holder.linear.dequantized().float().t()
            err = ((got - expected).abs().max() / expected.abs().max()).item()
            out.append(Check(name, err < 0.05, f"{how}: max error {err:.2e} of the largest output (tolerance 0.05)",
                             err, fmt))
        except Exception as e:  # noqa: BLE001
            out.append(Check(name, False, f"raised {e!r}", group=fmt))
    if device.type == "cuda" and have_triton():
        name = "fp8 activations quantized by the Triton kernel: the torch ops' scales and bytes"
        try:
            rows = (torch.randn(7, 14336, generator=g) * 3).to(device, torch.bfloat16)
            q, scale = cuda_linear.quantize_rows(rows)
            want_q, want_scale = cuda_linear.quantize_rows_torch(rows)
            same = torch.equal(scale, want_scale) and torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
            out.append(Check(name, same, "equal" if same else
                             f"{(q.view(torch.uint8) != want_q.view(torch.uint8)).sum().item()} bytes differ", group="fp8"))
        except Exception as e:  # noqa: BLE001
            out.append(Check(name, False, f"raised {e!r}", group="fp8"))
    return out
