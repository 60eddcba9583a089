"""Absorbed multi-head latent attention (DeepSeek-V2/V3) for decode on CUDA: a Triton kernel that reads each
sequence's cached latents straight out of the paged cache, once for all its heads.

The cache holds one entry per token and layer, the latent [C] then the rotated key [R] (`mla.py`). A decode
query is, per head, the absorbed latent query q_nope W_UK [C] and the rotated query [R]; every head attends the
same entries, so one program per (sequence, split of the context) loads all H query rows and walks its share of
the context in tiles of TILE tokens (each token's block found through the block table, dequantized in registers
when the cache is int8/fp8): scores q_latent . latent + q_rope . key, an online softmax per head, and the
attended latent sum_t p_t latent_t [H, C]. W_UV is applied by the caller, after. The entries are read once per
sequence, not once per head: the bandwidth-optimal decode form, which expanded heads (H x (nope + R) keys and
H x V values per token) cannot be. With several splits (flash-decoding: few sequences, long contexts) each
writes its partial max, sum and weighted latents and a second kernel merges them; the number of splits depends
on the shapes alone (`cuda_attention.num_splits`), so a step holds no host synchronisation.

On the CPU the same kernels run under Triton's interpreter (TRITON_INTERPRET=1) in the tests; on CUDA the
worker runs `self_check` at start on the model's shape and attends through the reference path when it fails.
"""

from __future__ import annotations

import functools

import torch

from pdserve.server.decode.cuda_attention import num_splits

TILE = 32
"""Tokens one kernel iteration reads (or the block size when larger)."""
MAX_HEADS = 128
"""At most this many query heads per program (DeepSeek-V3 has 128)."""


@functools.cache
def _kernels():
    """The Triton kernels, made on first use (so a test can choose the interpreter before)."""
    import triton
    import triton.language as tl

    @triton.jit
    def mla_decode(
        QL, QR, KV, KS, TABLES, LENS, OUT, M_OUT, L_OUT,
        stride_qlb, stride_qlh, stride_qrb, stride_qrh,
        stride_kn, stride_kt, stride_sn, stride_tb, stride_lb,
        stride_ob, stride_oh, stride_osplit, stride_mb, stride_mh,
        sm_scale, tiles_per_split,
        H: tl.constexpr, H_PAD: tl.constexpr, C: tl.constexpr, C_PAD: tl.constexpr, R: tl.constexpr,
        R_PAD: tl.constexpr, BS: tl.constexpr, TILE_N: tl.constexpr, QUANT: tl.constexpr, IEEE: tl.constexpr,
        PARTIAL: tl.constexpr,
    ):
        b = tl.program_id(0)
        split = tl.program_id(1)
        ctx = tl.load(LENS + b * stride_lb).to(tl.int32)
        h = tl.arange(0, H_PAD)
        c = tl.arange(0, C_PAD)
        r = tl.arange(0, R_PAD)
        h_ok, c_ok, r_ok = h < H, c < C, r < R
        ql = tl.load(QL + b * stride_qlb + h[:, None] * stride_qlh + c[None, :],
                     mask=h_ok[:, None] & c_ok[None, :], other=0.0)  # [H_PAD, C_PAD]
        qr = tl.load(QR + b * stride_qrb + h[:, None] * stride_qrh + r[None, :],
                     mask=h_ok[:, None] & r_ok[None, :], other=0.0)  # [H_PAD, R_PAD]
        m = tl.full([H_PAD], float("-inf"), tl.float32)
        l = tl.zeros([H_PAD], tl.float32)
        acc = tl.zeros([H_PAD, C_PAD], tl.float32)
        first = split * tiles_per_split
        last = tl.minimum(first + tiles_per_split, tl.cdiv(ctx, TILE_N))
        for tile in range(first, last):
            t = tile * TILE_N + tl.arange(0, TILE_N)  # [TILE_N] token positions
            live = t < ctx
            block = tl.load(TABLES + b * stride_tb + t // BS, mask=live, other=0)  # [TILE_N]
            base = block.to(tl.int64) * stride_kn + (t % BS) * stride_kt  # [TILE_N]
            lat = tl.load(KV + base[:, None] + c[None, :], mask=live[:, None] & c_ok[None, :], other=0.0)
            rot = tl.load(KV + base[:, None] + C + r[None, :], mask=live[:, None] & r_ok[None, :], other=0.0)
            if QUANT:
                scale = tl.load(KS + block.to(tl.int64) * stride_sn, mask=live, other=0.0)  # [TILE_N]
                lat = (lat.to(tl.float32) * scale[:, None]).to(ql.dtype)
                rot = (rot.to(tl.float32) * scale[:, None]).to(ql.dtype)
            else:
                lat = lat.to(ql.dtype)
                rot = rot.to(ql.dtype)
            if IEEE:
                s = tl.dot(ql, tl.trans(lat), input_precision="ieee") + tl.dot(qr, tl.trans(rot),
                                                                             input_precision="ieee")
            else:
                s = tl.dot(ql, tl.trans(lat)) + tl.dot(qr, tl.trans(rot))  # [H_PAD, TILE_N] f32
            s = tl.where(live[None, :], s * sm_scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - m_ref)
            p = tl.exp(s - m_ref[:, None])  # [H_PAD, TILE_N]
            l = l * alpha + tl.sum(p, 1)
            if IEEE:
                pv = tl.dot(p.to(lat.dtype), lat, input_precision="ieee")
            else:
                pv = tl.dot(p.to(lat.dtype), lat)  # [H_PAD, C_PAD]
            acc = acc * alpha[:, None] + pv
            m = m_new
        row = b * stride_ob + h[:, None] * stride_oh + c[None, :]
        ok = h_ok[:, None] & c_ok[None, :]
        if PARTIAL:
            tl.store(OUT + row + split * stride_osplit, acc, mask=ok)
            stat = b * stride_mb + h * stride_mh + split
            tl.store(M_OUT + stat, m, mask=h_ok)
            tl.store(L_OUT + stat, l, mask=h_ok)
        else:
            tl.store(OUT + row, (acc / l[:, None]).to(OUT.dtype.element_ty), mask=ok)

    @triton.jit
    def combine(ACC, M_IN, L_IN, OUT, S: tl.constexpr, S_PAD: tl.constexpr, C: tl.constexpr, C_PAD: tl.constexpr):
        """One (sequence, head) row: the splits' partial latents, softmax-weighted, into OUT [rows, C]."""
        row = tl.program_id(0)
        s = tl.arange(0, S_PAD)
        c = tl.arange(0, C_PAD)
        m = tl.load(M_IN + row * S + s, mask=s < S, other=float("-inf"))  # [S_PAD]
        l = tl.load(L_IN + row * S + s, mask=s < S, other=0.0)
        acc = tl.load(ACC + row * S * C + s[:, None] * C + c[None, :], mask=(s < S)[:, None] & (c < C)[None, :],
                      other=0.0)
        w = tl.exp(m - tl.max(m, 0))  # splits that held none of the row's keys (m = -inf) weigh 0
        out = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)  # [C_PAD]
        tl.store(OUT + row * C + c, out.to(OUT.dtype.element_ty), mask=c < C)

    return mla_decode, combine


def paged_mla_decode(
    q_latent: torch.Tensor,  # [B, H, C] absorbed queries (q_nope W_UK)
    q_rope: torch.Tensor,  # [B, H, R] rotated queries
    entries: torch.Tensor,  # [N, bs, 1, C + R] one layer of the paged cache of latents
    block_tables: torch.Tensor,  # [B, M] int, rows contiguous
    context_lens: torch.Tensor,  # [B] int, tokens each sequence attends (the new one included), >= 1
    scale: float,
    entry_scales: torch.Tensor | None = None,  # [N, 1] float32 for int8/fp8 caches
    splits: int | None = None,
) -> torch.Tensor:
    """softmax((q_latent . latent + q_rope . key) scale) latent over each sequence's context -> [B, H, C] in
    q_latent's dtype."""
    import triton

    B, H, C = q_latent.shape
    N, bs, one, CR = entries.shape
    R = q_rope.shape[-1]
    if one != 1 or CR != C + R or H > MAX_HEADS or bs & (bs - 1):
        raise ValueError(f"the MLA kernel takes one latent entry of C + R values per token, at most {MAX_HEADS} "
                         f"heads and a power-of-two block size; got entries {tuple(entries.shape)}, C={C}, R={R}, "
                         f"H={H}, block size {bs}")
    if not (entries.stride(-1) == 1 and q_latent.stride(-1) == 1 and q_rope.stride(-1) == 1):
        raise ValueError("the MLA kernel needs the entries' and queries' last dim contiguous")
    if block_tables.dim() != 2 or block_tables.stride(1) != 1 or context_lens.dim() != 1:
        raise ValueError(f"the MLA kernel reads block tables [B, M] with contiguous rows and lengths [B]; got "
                         f"{tuple(block_tables.shape)} (strides {block_tables.stride()}), {tuple(context_lens.shape)}")
    quant = entry_scales is not None
    tile = max(TILE, bs)
    tiles = -(-block_tables.shape[1] * bs // tile)
    splits = splits or num_splits(B, 1, tiles * tile // bs, bs)
    tiles_per_split = -(-tiles // splits)
    h_pad, c_pad, r_pad = (max(16, triton.next_power_of_2(n)) for n in (H, C, R))
    partial = splits > 1
    if partial:
        out = torch.empty(B, H, splits, C, dtype=torch.float32, device=q_latent.device)
        m = torch.empty(B, H, splits, dtype=torch.float32, device=q_latent.device)
        l = torch.empty(B, H, splits, dtype=torch.float32, device=q_latent.device)
        strides = (out.stride(0), out.stride(1), out.stride(2), m.stride(0), m.stride(1))
    else:
        out = torch.empty(B, H, C, dtype=q_latent.dtype, device=q_latent.device)
        m = l = out
        strides = (out.stride(0), out.stride(1), 0, 0, 0)
    mla_decode, combine = _kernels()
    mla_decode[(B, splits)](
        q_latent, q_rope, entries, entry_scales if quant else entries, block_tables, context_lens, out, m, l,
        q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1),
        entries.stride(0), entries.stride(1), entry_scales.stride(0) if quant else 0,
        block_tables.stride(0), context_lens.stride(0), *strides,
        scale, tiles_per_split,
        H=H, H_PAD=h_pad, C=C, C_PAD=c_pad, R=R, R_PAD=r_pad, BS=bs, TILE_N=tile, QUANT=quant,
        IEEE=q_latent.dtype == torch.float32, PARTIAL=partial,
        num_warps=8 if h_pad * c_pad >= 16384 else 4,  # the [H, C] f32 accumulator spread over more registers
    )
    if not partial:
        return out
    merged = torch.empty(B, H, C, dtype=q_latent.dtype, device=q_latent.device)
    combine[(B * H,)](out, m, l, merged, S=splits, S_PAD=triton.next_power_of_2(splits), C=C, C_PAD=c_pad)
    return merged


def reference_mla_decode(q_latent: torch.Tensor, q_rope: torch.Tensor, entries: torch.Tensor,
                         block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                         entry_scales: torch.Tensor | None = None) -> torch.Tensor:
    """The same attention in float32 torch ops, one sequence at a time (what the kernel is checked against)."""
    B, H, C = q_latent.shape
    bs = entries.shape[1]
    out = []
    for b in range(B):
        n = int(context_lens[b])
        blocks = block_tables[b, : -(-n // bs)].long()
        e = entries[blocks, :, 0].float()  # [blocks, bs, C + R]
        if entry_scales is not None:
            e = e * entry_scales[blocks, 0].float()[:, None, None]
        e = e.reshape(-1, e.shape[-1])[:n]  # [n, C + R]
        q = torch.cat((q_latent[b], q_rope[b]), -1).float()  # [H, C + R]
        p = torch.softmax(q @ e.T * scale, -1)  # [H, n]
        out.append(p @ e[:, :C])
    return torch.stack(out).to(q_latent.dtype)


def self_check(heads: int, rank: int, rope: int, block_size: int, dtype: torch.dtype, kv_dtype: torch.dtype,
               device: torch.device) -> str | None:
    """Runs the kernel once on the model's shape (a small random cache: batch 2, 40 tokens, split and not) against
    `reference_mla_decode`; None when it agrees, else why not (the worker then attends through the reference)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    blocks = 2 * -(-40 // block_size) + 2
    try:
        stored = torch.randn(blocks, block_size, 1, rank + rope, generator=g)
        scales = None
        if kv_dtype in (torch.int8, torch.float8_e4m3fn):
            scales = torch.rand(blocks, 1, generator=g) / 100 + 0.005
            stored = (stored / scales[:, None, None]).clamp(-100, 100)
            stored = stored.round() if kv_dtype == torch.int8 else stored
            scales = scales.to(device)
        entries = stored.to(device, kv_dtype)
        q_latent = (torch.randn(2, heads, rank, generator=g) / rank**0.5).to(device, dtype)
        q_rope = (torch.randn(2, heads, rope, generator=g) / rope**0.5).to(device, dtype)
        tables = torch.randperm(blocks, generator=g)[: 2 * (blocks // 2)].view(2, -1).to(device)
        lens = torch.tensor([40, 7], device=device)
        want = reference_mla_decode(q_latent, q_rope, entries, tables, lens, 0.1, scales).float()
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        for splits in (1, 2):
            got = paged_mla_decode(q_latent, q_rope, entries, tables, lens, 0.1, scales, splits).float()
            err = ((got - want).abs().max() / want.abs().max()).item()
            if not err < tol:
                return f"the MLA kernel's output is {err:.1e} off the reference's (of the largest; tolerance {tol:g})"
    except Exception as e:  # noqa: BLE001 - any failure means: do not use it
        return f"the MLA kernel failed on this device: {e!r}"
    return None
