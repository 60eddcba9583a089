"""Paged attention for decode (one new token per sequence) on CUDA: a Triton kernel that reads only the
blocks each sequence's context holds, straight out of the paged cache.

One program per (sequence, kv head, split of the context): it loads the G query heads that share the kv
head, walks its share of the context in tiles of TILE tokens (each token's block found through the
block table, dequantized in registers when the cache is int8/fp8), and keeps an online softmax. With one
split the program writes the output; with several (flash-decoding, for few sequences and long
contexts) each writes its partial max, sum and weighted values, and a second kernel merges them.
The number of splits depends only on the batch and the table's width, never on the lengths, so a step
holds no host synchronisation and replays inside a CUDA graph. With a sliding window W the programs walk
only the tiles from the one holding position context_len - W on (the splits share those out), and mask
the keys before it.

On the CPU the same kernels run under Triton's interpreter (TRITON_INTERPRET=1) in the tests.
"""

from __future__ import annotations

import functools
import importlib.util
import math

import torch

TILE = 64
"""Tokens one kernel iteration reads (a multiple of the block size, or the block size when larger)."""
TARGET_PROGRAMS = 256
"""Splits are added until the grid has about this many programs (the H200 has 132 SMs)."""
MAX_SPLITS = 64
"""At most this many (the combining kernel holds every split's partial row in registers)."""


def have_triton() -> bool:
    """Whether triton is installed (without importing it: TRITON_INTERPRET is read at its import)."""
    return importlib.util.find_spec("triton") is not None


def num_splits(batch: int, num_kv_heads: int, max_blocks: int, block_size: int) -> int:
    """Context splits per (sequence, kv head): enough programs to fill the device, at least one tile each.
    A function of the shapes alone (not of the lengths): no host sync, and fixed per CUDA-graph bucket."""
    tiles = max(1, -(-max_blocks * block_size // max(TILE, block_size)))
    wanted = -(-TARGET_PROGRAMS // (batch * num_kv_heads))
    return max(1, min(tiles, wanted, MAX_SPLITS))


@functools.cache
def _kernel():
    """The Triton kernel, made on first use (so a test can choose the interpreter before it is)."""
    import triton
    import triton.language as tl

    @triton.jit
    def paged_decode(
        Q, K, V, KS, VS, TABLES, LENS, OUT, M_OUT, L_OUT,
        stride_qb, stride_qh,
        stride_kn, stride_kt, stride_kh,
        stride_sn,
        stride_tb, stride_lb,
        stride_ob, stride_oh, stride_os,
        stride_mb, stride_mh,
        sm_scale, tiles_per_split, window, softcap,
        G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, TILE_N: tl.constexpr,
        QUANT: tl.constexpr, IEEE: tl.constexpr, PARTIAL: tl.constexpr, SOFTCAP: tl.constexpr,
    ):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        ctx = tl.load(LENS + b * stride_lb).to(tl.int32)
        heads = kvh * G + tl.arange(0, G_PAD)  # [G_PAD]
        head_ok = tl.arange(0, G_PAD) < G
        d = tl.arange(0, D)
        q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=head_ok[:, None], other=0.0)
        m = tl.full([G_PAD], float("-inf"), tl.float32)
        l = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D], tl.float32)
        oldest = tl.maximum(ctx - window, 0)  # the first key the query sees (window: 2^30 when none)
        first = oldest // TILE_N + split * tiles_per_split
        last = tl.minimum(first + tiles_per_split, tl.cdiv(ctx, TILE_N))
        for tile in range(first, last):
            t = tile * TILE_N + tl.arange(0, TILE_N)  # [TILE_N] token positions
            live = (t < ctx) & (t >= oldest)
            block = tl.load(TABLES + b * stride_tb + t // BS, mask=live, other=0)  # [TILE_N]
            base = block.to(tl.int64) * stride_kn + (t % BS) * stride_kt + kvh * stride_kh  # [TILE_N]
            k = tl.load(K + base[:, None] + d[None, :], mask=live[:, None], other=0.0)  # [TILE_N, D]
            v = tl.load(V + base[:, None] + d[None, :], mask=live[:, None], other=0.0)
            if QUANT:
                k_scale = tl.load(KS + block.to(tl.int64) * stride_sn + kvh, mask=live, other=0.0)  # [TILE_N]
                v_scale = tl.load(VS + block.to(tl.int64) * stride_sn + kvh, mask=live, other=0.0)
                k = (k.to(tl.float32) * k_scale[:, None]).to(q.dtype)
                v = (v.to(tl.float32) * v_scale[:, None]).to(q.dtype)
            else:
                k = k.to(q.dtype)
                v = v.to(q.dtype)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")  # [G_PAD, TILE_N] f32
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * sm_scale
            if SOFTCAP:  # cap * tanh(s / cap), tanh from exp: 1 - 2 / (e^2x + 1)
                s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
            s = tl.where(live[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])  # [G_PAD, TILE_N]
            l = l * alpha + tl.sum(p, 1)
            if IEEE:
                pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m = m_new
        if PARTIAL:
            out = OUT + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :]
            tl.store(out, acc, mask=head_ok[:, None])
            stat = b * stride_mb + heads * stride_mh + split
            tl.store(M_OUT + stat, m, mask=head_ok)
            tl.store(L_OUT + stat, l, mask=head_ok)
        else:
            out = OUT + b * stride_ob + heads[:, None] * stride_oh + d[None, :]
            tl.store(out, (acc / l[:, None]).to(OUT.dtype.element_ty), mask=head_ok[:, None])

    @triton.jit
    def combine(ACC, M_IN, L_IN, OUT, S: tl.constexpr, S_PAD: tl.constexpr, D: tl.constexpr):
        """One (sequence, head) row: the splits' partial results, softmax-weighted, into OUT [B H, D]."""
        row = tl.program_id(0)
        s = tl.arange(0, S_PAD)
        d = tl.arange(0, D)
        m = tl.load(M_IN + row * S + s, mask=s < S, other=float("-inf"))  # [S_PAD]
        l = tl.load(L_IN + row * S + s, mask=s < S, other=0.0)
        acc = tl.load(ACC + row * S * D + s[:, None] * D + d[None, :], mask=(s < S)[:, None], other=0.0)
        w = tl.exp(m - tl.max(m, 0))  # empty splits (m = -inf) weigh 0; split 0 always holds a token
        out = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)  # [D]
        tl.store(OUT + row * D + d, out.to(OUT.dtype.element_ty))

    return paged_decode, combine


def paged_decode_attention(
    q: torch.Tensor,  # [B, H, D] the new token's queries (post-RoPE)
    k_cache: torch.Tensor,  # [N, bs, Hkv, D] one layer of the paged cache
    v_cache: torch.Tensor,  # [N, bs, Hkv, D]
    block_tables: torch.Tensor,  # [B, M] int, on q's device; rows may be strided, columns contiguous
    context_lens: torch.Tensor,  # [B] int, tokens each sequence attends to (the new one included), >= 1; any stride
    k_scales: torch.Tensor | None = None,  # [N, Hkv] float32 for int8/fp8 caches
    v_scales: torch.Tensor | None = None,
    splits: int | None = None,
    window: int = 0,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """softmax(q K^T scale) V over each sequence's first context_lens tokens -> [B, H, D] in q's dtype;
    with a sliding window (0: none), over only the last `window` of them. scale None: D ** -0.5; softcap:
    the scores capped to cap * tanh(s / cap) (Gemma 2)."""
    import triton

    B, H, D = q.shape
    N, bs, Hkv, _ = k_cache.shape
    G = H // Hkv
    if H % Hkv or D & (D - 1) or D < 16 or bs & (bs - 1):
        raise ValueError(f"the paged kernel takes H a multiple of Hkv, D and block size powers of two (D >= 16); "
                         f"got H={H}, Hkv={Hkv}, D={D}, block size {bs}")
    if not (k_cache.stride(-1) == 1 and k_cache.stride() == v_cache.stride() and q.stride(-1) == 1):
        raise ValueError("the paged kernel needs the cache's head dim and q's contiguous, K and V alike")
    if block_tables.dim() != 2 or block_tables.stride(1) != 1 or context_lens.dim() != 1:
        # (the CUDA-graph runner hands column views of one [rows, 3 + M] buffer: the lengths are strided, the
        # kernel reads them through their stride; a table row must be contiguous, as it reads `row + t // BS`)
        raise ValueError(f"the paged kernel reads block tables [B, M] with contiguous rows and lengths [B]; got "
                         f"tables of shape {tuple(block_tables.shape)}, strides {block_tables.stride()}, lengths "
                         f"of shape {tuple(context_lens.shape)}")
    if k_scales is not None and not (k_scales.stride(-1) == 1 and k_scales.stride() == v_scales.stride()):
        raise ValueError("the paged kernel needs the scales' head dim contiguous, K's and V's alike")
    quant = k_scales is not None
    tile = max(TILE, bs)
    M = block_tables.shape[1]
    tiles = -(-M * bs // tile)
    if window:  # the last `window` tokens lie in at most this many tiles
        tiles = min(tiles, -(-(window - 1) // tile) + 1)
    splits = splits or num_splits(B, Hkv, tiles * tile // bs, bs)
    tiles_per_split = -(-tiles // splits)
    g_pad = max(16, triton.next_power_of_2(G))
    scales = k_scales if quant else q  # any pointer when unused
    partial = splits > 1
    if partial:
        out = torch.empty(B, H, splits, D, dtype=torch.float32, device=q.device)
        m = torch.empty(B, H, splits, dtype=torch.float32, device=q.device)
        l = torch.empty(B, H, splits, dtype=torch.float32, device=q.device)
        strides = (*out.stride()[:3], *m.stride()[:2])
    else:
        out = torch.empty(B, H, D, dtype=q.dtype, device=q.device)
        m = l = out
        strides = (*out.stride()[:2], D, 0, 0)
    paged_decode, combine = _kernel()
    paged_decode[(B, Hkv, splits)](
        q, k_cache, v_cache, scales, v_scales if quant else scales, block_tables, context_lens, out, m, l,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_scales.stride(0) if quant else 0,
        block_tables.stride(0), context_lens.stride(0),
        *strides,
        1.0 / math.sqrt(D) if scale is None else scale, tiles_per_split, window or 2**30, softcap or 1.0,
        G=G, G_PAD=g_pad, D=D, BS=bs, TILE_N=tile,
        QUANT=quant, IEEE=q.dtype == torch.float32, PARTIAL=partial, SOFTCAP=softcap is not None,
    )
    if not partial:
        return out
    merged = torch.empty(B, H, D, dtype=q.dtype, device=q.device)
    combine[(B * H,)](out, m, l, merged, S=splits, S_PAD=triton.next_power_of_2(splits), D=D)
    return merged


def decode_attention(
    q: torch.Tensor,  # [B, H, D]
    cache,  # PagedKvCache
    layer: int,
    block_tables: torch.Tensor,  # [B, M]
    context_lens: torch.Tensor,  # [B]
    window: int = 0,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """One layer's paged decode attention over the cache (a windowed layer's: over its window) -> [B, H, D]."""
    scales = (None, None) if cache.k_scales is None else (cache.k_scales[layer], cache.v_scales[layer])
    return paged_decode_attention(q, cache.k[layer], cache.v[layer], block_tables, context_lens, *scales,
                                  window=window, scale=scale, softcap=softcap)
