"""Absorbed multi-head latent attention on CUDA for `benchmarks/gpu.py` (its `mla` stage), correctness before speed:

1. checks: the decode kernel (`server/decode/cuda_mla.py`: W_UK folded into the query, the cached latents read once
   for all heads, W_UV applied after) against attention with the heads expanded (transformers' form: each head's
   nope key and value projected out of the latent by kv_b_proj), on DeepSeek-V2-Lite's attention shape (16 heads,
   kv_lora_rank 512, rope 64, nope 128, v 128), bf16 and fp8 latents (float32 and int8 on the dry run's CPU),
   contexts of 1, part of a block, and several thousand tokens, with and without splits;
2. timing per layer at batch 1, 16 and 64 over 4k-token contexts: the kernel against the gathered torch path the
   worker falls back to (`mla.latent_attention`: the context's blocks gathered, then SDPA) and against expanded
   attention over a dense [B, H, T, 192 | 128] K/V (what a non-absorbed decode reads), and the latent bytes read
   per second against the read bandwidth of the `ceilings` stage.
"""

from __future__ import annotations

import time

import torch

V2_LITE = dict(H=16, C=512, R=64, nope=128, V=128, bs=16)
TINY = dict(H=4, C=32, R=16, nope=16, V=24, bs=4)


def _timed(fn, reps: int, sync, runs: int = 3) -> float:
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


def _cache(shape: dict, kv_dtype: str, blocks: int, device):
    from pdserve.kvcache.layout import KvLayout
    from pdserve.server.decode.kv_cache import PagedKvCache

    C, R, bs = shape["C"], shape["R"], shape["bs"]
    cache = PagedKvCache(KvLayout.of(1, 1, C + R, bs, kv_dtype, kind="mla_latent"), blocks, device=device)
    g = torch.Generator(device="cpu").manual_seed(0)
    n = blocks * bs
    for start in range(0, n, 32768):
        slots = torch.arange(start, min(n, start + 32768))
        entries = torch.randn(len(slots), 1, C + R, generator=g).to(device)
        cache.store(0, slots.to(device), entries, entries[..., :0])
    return cache


def _weights(shape: dict, device, dtype):
    g = torch.Generator(device="cpu").manual_seed(1)
    H, C = shape["H"], shape["C"]
    w_uk = torch.randn(H, shape["nope"], C, generator=g) / C**0.5
    w_uv = torch.randn(H, shape["V"], C, generator=g) / C**0.5
    return w_uk.to(device, dtype), w_uv.to(device, dtype)


def _expanded(q_nope, q_rope, stored, w_uk, w_uv, scale, C):
    """One sequence with heads expanded, float32: q_nope [H, nope], q_rope [H, R], stored [T, C + R] -> [H, V]."""
    latents, keys = stored[:, :C], stored[:, C:]
    k_nope = torch.einsum("tc,hnc->htn", latents, w_uk.float())
    v = torch.einsum("tc,hvc->htv", latents, w_uv.float())
    scores = torch.einsum("hn,htn->ht", q_nope.float(), k_nope) + q_rope.float() @ keys.T
    return torch.einsum("ht,htv->hv", torch.softmax(scores * scale, -1), v)


def checks(device, dry_run: bool, check_type) -> list:
    from pdserve.server.decode.cuda_mla import paged_mla_decode

    shape = TINY if dry_run or device.type == "cpu" else V2_LITE
    H, C, R, bs = shape["H"], shape["C"], shape["R"], shape["bs"]
    lens = [1, 7, 40] if dry_run or device.type == "cpu" else [1, 100, 4000]
    width = max(-(-n // bs) for n in lens)
    cuda = device.type == "cuda"
    kinds = (("bfloat16", torch.bfloat16), ("fp8_e4m3", torch.bfloat16), ("float32", torch.float32)) if cuda else \
        (("float32", torch.float32), ("int8", torch.float32))
    scale = (shape["nope"] + R) ** -0.5
    out = []
    for kv_dtype, q_dtype in kinds:
        cache = _cache(shape, kv_dtype, len(lens) * width + 2, device)
        g = torch.Generator(device="cpu").manual_seed(2)
        tables = torch.randperm(cache.num_blocks, generator=g)[: len(lens) * width].view(len(lens), width).to(device)
        ctx = torch.tensor(lens, device=device)
        w_uk, w_uv = _weights(shape, device, q_dtype)
        q_nope = torch.randn(len(lens), H, shape["nope"], generator=g).to(device, q_dtype)
        q_rope = torch.randn(len(lens), H, R, generator=g).to(device, q_dtype)
        q_latent = torch.einsum("bhn,hnc->bhc", q_nope, w_uk)
        scales = None if cache.k_scales is None else cache.k_scales[0]
        tol = 1e-4 if q_dtype == torch.float32 else 3e-2
        for splits in (1, 4):
            name = f"MLA decode kernel vs expanded heads: {kv_dtype} latents, q {str(q_dtype)[6:]}, splits {splits}"
            try:
                got = torch.einsum("bhc,hvc->bhv", paged_mla_decode(q_latent, q_rope, cache.k[0], tables, ctx, scale,
                                                                    scales, splits=splits).float(), w_uv.float())
                err = 0.0
                for b, n in enumerate(lens):
                    blocks = tables[b, : -(-n // bs)]
                    stored = cache.k[0, blocks, :, 0].float()
                    if scales is not None:
                        stored = stored * scales[blocks].float()[:, :, None]
                    want = _expanded(q_nope[b], q_rope[b], stored.reshape(-1, C + R)[:n], w_uk, w_uv, scale, C)
                    err = max(err, ((got[b] - want).abs().max() / want.abs().max()).item())
                out.append(check_type(name, err < tol, f"max error {err:.2e} of the largest output (tolerance "
                                      f"{tol:g})", err, "mla-kernel"))
            except Exception as e:  # noqa: BLE001 - reported, the run goes on
                out.append(check_type(name, False, f"raised {e!r}", group="mla-kernel"))
        del cache
    return out


def _point(shape: dict, batch: int, ctx: int, kv_dtype: str, dtype: torch.dtype, device, timed
           ) -> tuple[float, float, float, int]:
    """Seconds per layer of (the absorbed kernel, the gathered torch path, expanded heads) at one point, and the
    latent bytes the kernel reads; every tensor freed on return."""
    from pdserve.server.decode.attention import PagedContext
    from pdserve.server.decode.cuda_mla import paged_mla_decode
    from pdserve.server.decode.mla import latent_attention

    H, C, R, bs = shape["H"], shape["C"], shape["R"], shape["bs"]
    scale = (shape["nope"] + R) ** -0.5
    width = -(-ctx // bs)
    cache = _cache(shape, kv_dtype, batch * width, device)
    tables = torch.arange(batch * width, device=device).view(batch, width)
    lens = torch.full((batch,), ctx, device=device)
    g = torch.Generator(device="cpu").manual_seed(3)
    q = torch.randn(batch, 1, H, C + R, generator=g).to(device, dtype)
    q_latent, q_rope = q[:, 0, :, :C], q[:, 0, :, C:]
    kernel = timed(lambda: paged_mla_decode(q_latent, q_rope, cache.k[0], tables, lens, scale))
    context = PagedContext.build(lens[:, None] - 1, tables, lens, bs, device, dtype, groups=H)
    gathered = timed(lambda: latent_attention(q, cache, 0, context, scale, C))
    k = torch.randn(batch, H, ctx, shape["nope"] + R, generator=g).to(device, dtype)  # [B, H, T, nope + R]
    v = torch.randn(batch, H, ctx, shape["V"], generator=g).to(device, dtype)  # [B, H, T, V]
    qe = torch.randn(batch, H, 1, shape["nope"] + R, generator=g).to(device, dtype)
    expanded = timed(lambda: torch.nn.functional.scaled_dot_product_attention(qe, k, v, scale=scale))
    return kernel, gathered, expanded, batch * ctx * (C + R) * cache.k.element_size()


def rows(device, out, dry_run: bool, row_type, read_gbps: float | None) -> None:
    """Per-layer decode attention times at V2-Lite's shape: the kernel, the gathered torch path, expanded heads."""
    shape = TINY if dry_run else V2_LITE
    cuda = device.type == "cuda"
    kv_dtype, dtype = ("bfloat16", torch.bfloat16) if cuda else ("float32", torch.float32)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    reps, runs = (1, 1) if dry_run else (50, 3)
    section = "mla decode"
    for batch, ctx in (((2, 40),) if dry_run else ((1, 4096), (16, 4096), (64, 4096))):
        if not out.allows(f"MLA decode B={batch} ctx={ctx}", 1 if dry_run else 15):
            return
        kernel, gathered, expanded, latent_bytes = _point(shape, batch, ctx, kv_dtype, dtype, device,
                                                          lambda fn: _timed(fn, reps, sync, runs))
        out.row(row_type(section, f"absorbed MLA kernel B={batch} ctx={ctx}: us per layer vs the gathered torch path",
                         kernel * 1e6, gathered * 1e6, "us", needs=("mla-kernel",)),
                row_type(section, f"expanded heads (SDPA over dense K/V) B={batch} ctx={ctx}: us per layer vs the "
                         f"absorbed kernel", expanded * 1e6, kernel * 1e6, "us"),
                row_type(section, f"absorbed MLA kernel B={batch} ctx={ctx}: latent read vs bandwidth", latent_bytes
                         / kernel / 1e9, read_gbps, "GB/s", needs=("mla-kernel",)))


def run(out, device, dry_run: bool, row_type, check_type, log) -> None:
    from pdserve.server.decode.cuda_attention import have_triton

    if not have_triton():
        out.note("mla: skipped, triton is not installed")
        return
    out.check(*checks(device, dry_run, check_type))
    read = out.known_ceiling("read_sum_gbps")
    log(f"mla: timing at {'a tiny' if dry_run else 'the V2-Lite'} shape (read bandwidth {read or 0:.0f} GB/s)")
    rows(device, out, dry_run, row_type, read)
