"""The decode tier's newer Triton kernels for `benchmarks/gpu.py` (its `kernels` stage), correctness before speed:

1. checks: the paged kernel's verify form (k + 1 new tokens per sequence, `cuda_attention.paged_verify_attention`)
   against the reference attention for each KV dtype, windowed and not; the fused MoE kernels (`cuda_moe`)
   against the grouped loop for bf16/fp32, int8 and fp8 expert weights, batches 1 and 5, and for plain weights
   the step through torch's grouped matmul (`cpu_moe.grouped_experts`, the CPU's grouped path) against it too;
2. verify attention time vs k (1, 3, 7) against the single-query decode kernel on the same cache (Llama-3-8B's
   heads: 32 query / 8 kv, 128 dims, blocks of 16, bf16 KV), and the KV bytes it reads per second against the
   read bandwidth measured in the `ceilings` stage;
3. the fused MoE step of one Mixtral-8x7B-shape layer (d 4096, 8 experts of 14336, top 2, bf16) vs batch (1, 4,
   16, 64): the chosen experts' weight bytes read per second against the read bandwidth, and its time against
   the grouped loop's and torch's grouped matmul's (`grouped moe` rows);
4. the LoRA BGMV kernels (`gpu/lora.py`): checked against the torch path, then a batch of 16 mixing 4 adapters
   against the base-only batch on one Llama-3-8B-shape layer's fused matmuls (`lora bgmv` rows).
Every row rests on its checks (`needs`): a row with a target reads unverified until they passed on the device.
"""

from __future__ import annotations

import time

import torch

VERIFY_SHAPE = dict(H=32, Hkv=8, D=128, bs=16)
MOE_SHAPE = dict(d=4096, I=14336, E=8, k=2)
TINY_VERIFY = dict(H=4, Hkv=2, D=32, bs=4)
TINY_MOE = dict(d=128, I=64, E=8, k=2)


def _timed(fn, reps: int, sync, runs: int = 3) -> float:
    """Seconds per call: `reps` calls back to back after one warm-up (compiles), best of `runs` such runs."""
    fn()
    sync()
    best = float("inf")
    for _ in range(runs):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t) / reps)
    return best


def _filled_cache(kv_dtype: str, shape: dict, tokens: int, device):
    from pdserve.kvcache.layout import KvLayout
    from pdserve.server.decode.kv_cache import PagedKvCache

    bs = shape["bs"]
    blocks = -(-tokens // bs) + 8
    cache = PagedKvCache(KvLayout.of(1, shape["Hkv"], shape["D"], bs, kv_dtype), blocks, device=device)
    g = torch.Generator(device="cpu").manual_seed(0)
    n = blocks * bs
    for start in range(0, n, 65536):  # stored in pieces: the random fp32 source stays small
        slots = torch.arange(start, min(n, start + 65536))
        cache.store(0, slots.to(device), torch.randn(len(slots), shape["Hkv"], shape["D"], generator=g).to(device),
                    torch.randn(len(slots), shape["Hkv"], shape["D"], generator=g).to(device))
    return cache


def _rows(new: int, lens: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions [B, new] as the speculator lays them out, each row's k proposals in full; context lengths [B])."""
    steps = torch.arange(new)
    positions = torch.stack([n - new + steps for n in lens])
    return positions.to(device), torch.tensor(lens, device=device)


def verify_checks(device, kv_dtypes: tuple[str, ...], large: bool, check_type) -> list:
    from pdserve.server.decode.attention import PagedContext, paged_attention
    from pdserve.server.decode.cuda_attention import paged_verify_attention

    shape = VERIFY_SHAPE if large else TINY_VERIFY
    H, bs = shape["H"], shape["bs"]
    lens = [4, 100, 4000] if large else [4, 17, 40]
    checks = []
    width = max(-(-n // bs) for n in lens)
    for kv_dtype in kv_dtypes:
        cache = _filled_cache(kv_dtype, shape, len(lens) * width * bs, device)
        q_dtype = torch.float32 if kv_dtype == "float32" or device.type == "cpu" else torch.bfloat16
        tol = 1e-4 if q_dtype == torch.float32 else 2e-2
        g = torch.Generator(device="cpu").manual_seed(1)
        tables = torch.randperm(cache.num_blocks, generator=g)[: len(lens) * width].view(len(lens), width).to(device)
        scales = (None, None) if cache.k_scales is None else (cache.k_scales[0], cache.v_scales[0])
        for new, window in ((2, 0), (4, 0), (4, 13 if not large else 1000)):
            name = f"verify kernel vs reference: {kv_dtype} KV, q {str(q_dtype)[6:]}, {new} new tokens" + \
                (f", window {window}" if window else "")
            try:
                positions, ctx = _rows(new, lens, device)
                q = torch.randn(len(lens), new, H, shape["D"], generator=g).to(device, q_dtype)
                context = PagedContext.build(positions, tables, ctx, bs, device, q_dtype, groups=H // shape["Hkv"],
                                             window=window or None)
                want = paged_attention(q, cache, 0, context if not window else context.local).float()
                got = paged_verify_attention(q, cache.k[0], cache.v[0], tables, ctx, positions, *scales,
                                             window=window).float()
                err = (got - want).abs().max().item()
                checks.append(check_type(name, err < tol, f"max abs error {err:.2e} (tolerance {tol:g})", err,
                                         "verify-kernel"))
            except Exception as e:  # noqa: BLE001 - reported, the run goes on
                checks.append(check_type(name, False, f"raised {e!r}", group="verify-kernel"))
        del cache
    return checks


def _random_moe(shape: dict, dtype: torch.dtype, weight_format: str | None, device):
    from pdserve.server.decode.moe import MoeMlp
    from pdserve.server.decode.quant import quantize
    from pdserve.server.model.config import MoeConfig

    mlp = MoeMlp(MoeConfig(shape["E"], shape["k"], shape["I"], renormalize=True), shape["d"], "silu", dtype, device)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for buffer in mlp.buffers():
            buffer.normal_(0.0, 0.02, generator=g)
    if weight_format is not None:
        quantize(mlp, weight_format)  # type: ignore[arg-type]
    return mlp


def moe_checks(device, formats: tuple[tuple[str | None, torch.dtype], ...], check_type) -> list:
    shape = dict(d=1024, I=2048, E=8, k=2) if device.type == "cuda" else TINY_MOE
    checks = []
    for fmt, dtype in formats:
        mlp = _random_moe(shape, dtype, fmt, device)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        for batch in (1, 5):
            name = f"fused MoE vs the grouped loop: {fmt or str(dtype)[6:]} weights, {str(dtype)[6:]}, batch {batch}"
            try:
                x = torch.randn(1, batch, shape["d"], generator=torch.Generator().manual_seed(batch)).to(device, dtype)
                with torch.inference_mode():
                    stacked, mlp.fused = mlp.fused, None
                    want = mlp(x).float()
                    if stacked is None:
                        mlp.fuse()
                    else:
                        mlp.fused = stacked
                    got = mlp(x).float()
                err = ((got - want).abs().max() / want.abs().max()).item()
                checks.append(check_type(name, err < tol, f"max error {err:.2e} of the largest output (tolerance "
                                         f"{tol:g})", err, "moe-kernel"))
            except Exception as e:  # noqa: BLE001
                checks.append(check_type(name, False, f"raised {e!r}", group="moe-kernel"))
                continue
            if fmt is None:  # torch's grouped matmul reads plain float weights only
                checks.append(grouped_check(mlp, x, want, tol, check_type,
                                            f"torch grouped matmul vs the grouped loop: {str(dtype)[6:]}, batch {batch}"))
    return checks


def grouped_check(mlp, x: torch.Tensor, want: torch.Tensor, tol: float, check_type, name: str):
    """The layer's step through torch's grouped matmul (`cpu_moe.grouped_experts`, the CPU's grouped path, on the
    device as it is) against the loop's output `want`; the layer left on the path it was on."""
    fused = mlp.fused
    try:
        with torch.inference_mode():
            mlp.group()  # over the fused kernels' stack where there is one
            mlp.fused = None
            got = mlp(x).float()
        err = ((got - want).abs().max() / want.abs().max()).item()
        return check_type(name, err < tol, f"max error {err:.2e} of the largest output (tolerance {tol:g})", err,
                          "moe-grouped")
    except Exception as e:  # noqa: BLE001 - e.g. a device or dtype torch's grouped matmul does not take
        return check_type(name, False, f"raised {e!r}", group="moe-grouped")
    finally:
        mlp.grouped, mlp.fused = False, fused


def verify_rows(device, out, dry_run: bool, row_type, read_gbps: float | None) -> None:
    """Verify attention (k = 1, 3, 7) against the single-query kernel, one layer of a Llama-3-8B-shape bf16 cache."""
    from pdserve.server.decode.cuda_attention import paged_decode_attention, paged_verify_attention

    shape = TINY_VERIFY if dry_run else VERIFY_SHAPE
    H, Hkv, D, bs = shape["H"], shape["Hkv"], shape["D"], shape["bs"]
    kv_dtype = "float32" if device.type == "cpu" else "bfloat16"
    q_dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    reps, runs = (1, 1) if dry_run else (50, 3)  # the dry run's interpreter: ~0.5 s a launch, its times mean nothing
    for batch, ctx in (((2, 40),) if dry_run else ((1, 4096), (8, 4096), (32, 4096))):
        if not out.allows(f"verify attention B={batch} ctx={ctx}", 1 if dry_run else 10):
            return
        cache = _filled_cache(kv_dtype, shape, batch * ctx, device)
        width = -(-ctx // bs)
        tables = torch.arange(batch * width, device=device).view(batch, width)
        lens = torch.full((batch,), ctx, device=device)
        g = torch.Generator(device="cpu").manual_seed(2)
        q1 = torch.randn(batch, H, D, generator=g).to(device, q_dtype)
        single = _timed(lambda: paged_decode_attention(q1, cache.k[0], cache.v[0], tables, lens), reps, sync, runs)
        kv_bytes = 2 * batch * ctx * Hkv * D * cache.k.element_size()
        out.row(row_type("verify attention", f"single-query (decode) kernel B={batch} ctx={ctx}: us per layer",
                         single * 1e6, unit="us"),
                row_type("verify attention", f"single-query kernel B={batch} ctx={ctx}: KV read vs bandwidth",
                         kv_bytes / single / 1e9, read_gbps, "GB/s", needs=("kernel",)))
        for k in (1, 3, 7):
            new = k + 1
            positions, ctx_t = _rows(new, [ctx] * batch, device)
            q = torch.randn(batch, new, H, D, generator=g).to(device, q_dtype)
            t = _timed(lambda: paged_verify_attention(q, cache.k[0], cache.v[0], tables, ctx_t, positions), reps,
                       sync, runs)
            out.row(row_type("verify attention", f"verify k={k} B={batch} ctx={ctx}: us per layer vs the "
                             f"single-query step", t * 1e6, single * 1e6, "us"),
                    row_type("verify attention", f"verify k={k} B={batch} ctx={ctx}: single-query time / verify "
                             f"time (target: k + 1 tokens for <= 1.5x one token's attention)", single / t, 1.0,
                             "x", target=1 / 1.5 if k == 3 else None, needs=("verify-kernel",)))
        del cache


def moe_rows(device, out, dry_run: bool, row_type, read_gbps: float | None) -> None:
    """The fused MoE step of one Mixtral-shape layer vs batch, against the read bandwidth and the grouped loop."""
    shape = TINY_MOE if dry_run else MOE_SHAPE
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    reps, runs = (1, 1) if dry_run else (20, 3)
    if not out.allows("fused MoE", 1 if dry_run else 20):
        return
    mlp = _random_moe(shape, dtype, None, device)
    mlp.fuse()
    stacked = mlp.fused
    expert_bytes = 3 * shape["d"] * shape["I"] * torch.finfo(dtype).bits // 8
    for batch in ((1, 5) if dry_run else (1, 4, 16, 64)):
        if not out.allows(f"fused MoE batch {batch}", 1 if dry_run else 8):
            return
        x = torch.randn(1, batch, shape["d"], generator=torch.Generator().manual_seed(batch)).to(device, dtype)
        with torch.inference_mode():
            from pdserve.server.decode.moe import route

            _, experts = route(torch.nn.functional.linear(x[0], mlp.router), mlp.moe)
            chosen = len(set(experts.flatten().tolist()))
            mlp.fused = None
            loop = _timed(lambda: mlp(x), reps, sync, runs)
            try:
                mlp.stacked = stacked
                mlp.group()
                grouped = _timed(lambda: mlp(x), reps, sync, runs)
            except Exception as e:  # noqa: BLE001 - its check says why
                grouped = None
                out.note(f"grouped moe batch {batch}: torch's grouped matmul raised {e!r}")
            mlp.grouped = False
            mlp.fused = stacked
            fused = _timed(lambda: mlp(x), reps, sync, runs)
        if grouped is not None:
            out.row(row_type("grouped moe", f"batch {batch}: us per layer, torch grouped matmul vs the fused Triton "
                             f"kernels", grouped * 1e6, fused * 1e6, "us"),
                    row_type("grouped moe", f"batch {batch}: grouped-loop time / torch grouped matmul time", loop / grouped,
                             1.0, "x", needs=("moe-grouped",)))
        needs = ("moe-kernel",)
        out.row(row_type("fused moe", f"batch {batch} ({chosen} of {shape['E']} experts chosen): chosen weights read "
                         f"vs bandwidth", chosen * expert_bytes / fused / 1e9, read_gbps, "GB/s",
                         target=0.6 if batch == 1 and read_gbps else None, needs=needs),
                row_type("fused moe", f"batch {batch}: us per layer, fused vs the grouped loop", fused * 1e6,
                         loop * 1e6, "us"),
                row_type("fused moe", f"batch {batch}: grouped-loop time / fused time", loop / fused, 1.0, "x",
                         target=1.0, needs=needs))


def run(out, device, dry_run: bool, row_type, check_type, log) -> None:
    from pdserve.benchmarks.gpu import lora as gpu_lora
    from pdserve.server.decode.cuda_attention import have_triton

    cuda = device.type == "cuda"
    if not have_triton():
        out.note("kernels: skipped, triton is not installed")
        return
    kv = ("bfloat16", "float32", "int8", "fp8_e4m3") if cuda else ("float32", "int8")
    out.check(*verify_checks(device, kv, large=cuda and not dry_run, check_type=check_type))
    formats = ((None, torch.bfloat16), (None, torch.float32), ("int8", torch.bfloat16), ("fp8", torch.bfloat16)) \
        if cuda else ((None, torch.float32), ("int8", torch.float32))
    out.check(*moe_checks(device, formats, check_type))
    out.check(*gpu_lora.lora_checks(device, (torch.bfloat16, torch.float16, torch.float32) if cuda
                                    else (torch.float32,), check_type))
    read = out.known_ceiling("read_sum_gbps")
    log(f"kernels: timing (read bandwidth {read or 0:.0f} GB/s from the ceilings stage)")
    verify_rows(device, out, dry_run, row_type, read)
    moe_rows(device, out, dry_run, row_type, read)
    gpu_lora.lora_rows(device, out, dry_run, row_type, _timed,
                       torch.cuda.synchronize if cuda else (lambda: None))
