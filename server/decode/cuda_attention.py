"""Paged attention for decode and speculative verify on CUDA: a Triton kernel that reads only the blocks each
sequence's context holds, straight out of the paged cache.

One program per (sequence, kv head, split of the context): it loads the query rows that share the kv head
(the G query heads of each of the sequence's S new tokens: S = 1 for decode, k + 1 for a verify step), walks
its share of the context in tiles of TILE tokens (each token's block found through the block table,
dequantized in registers when the cache is int8/fp8), and keeps an online softmax per row. Each row is masked
at its own position p: it reads keys [0, min(p + 1, context_len)), causal over the new tokens. With one split
the program writes the output; with several (flash-decoding, for few sequences and long contexts) each
writes its partial max, sum and weighted values, and a second kernel merges them. The number of splits
depends only on the batch and the table's width, never on the lengths, so a step holds no host
synchronisation and replays inside a CUDA graph. With a sliding window W a row at position p reads only keys
p - W < j <= p: the programs walk only the tiles from the one holding the row's first query's window on (the
splits share those out), and mask the rest.

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
MAX_QUERY_ROWS = 128
"""At most this many query rows (new tokens x query heads per kv head) per program: a verify step with more
attends through the reference path (`attention.paged_attention`)."""


def have_triton() -> bool:
    """Whether triton is installed (without importing it: TRITON_INTERPRET is read at its import)."""
    return importlib.util.find_spec("triton") is not None


def takes(new_tokens: int, groups: int) -> bool:
    """Whether the kernel attends `new_tokens` per sequence for `groups` query heads per kv head."""
    return new_tokens * groups <= MAX_QUERY_ROWS


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
    def paged_attention(
        Q, K, V, KS, VS, TABLES, LENS, POS, OUT, M_OUT, L_OUT,
        stride_qb, stride_qs, stride_qh,
        stride_kn, stride_kt, stride_kh,
        stride_sn,
        stride_tb, stride_lb, stride_pb, stride_ps,
        stride_ob, stride_os, stride_oh, stride_osplit,
        stride_mb, stride_ms, stride_mh,
        sm_scale, tiles_per_split, window, softcap,
        G: tl.constexpr, S: tl.constexpr, R_PAD: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
        TILE_N: tl.constexpr, QUANT: tl.constexpr, IEEE: tl.constexpr, PARTIAL: tl.constexpr,
        SOFTCAP: tl.constexpr, HAS_POS: tl.constexpr,
    ):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        ctx = tl.load(LENS + b * stride_lb).to(tl.int32)
        r = tl.arange(0, R_PAD)  # [R_PAD] query rows: new token r // G, query head r % G of the kv head's
        row_ok = r < S * G
        s_of = r // G
        heads = kvh * G + r % G
        d = tl.arange(0, D)
        q = tl.load(Q + b * stride_qb + s_of[:, None] * stride_qs + heads[:, None] * stride_qh + d[None, :],
                    mask=row_ok[:, None], other=0.0)  # [R_PAD, D]
        if HAS_POS:
            pos = tl.load(POS + b * stride_pb + s_of * stride_ps, mask=row_ok, other=0).to(tl.int32)
            pos = tl.where(row_ok, pos, ctx - 1)
        else:  # decode: one new token, the context's last
            pos = tl.zeros([R_PAD], tl.int32) + (ctx - 1)
        end = tl.minimum(pos + 1, ctx)  # [R_PAD] each row reads keys [start, end)
        start = tl.maximum(pos + 1 - window, 0)  # (window: 2^30 when none)
        lo = tl.min(start, 0)
        hi = tl.max(end, 0)
        m = tl.full([R_PAD], float("-inf"), tl.float32)
        l = tl.zeros([R_PAD], tl.float32)
        acc = tl.zeros([R_PAD, D], tl.float32)
        first = lo // TILE_N + split * tiles_per_split
        last = tl.minimum(first + tiles_per_split, tl.cdiv(hi, TILE_N))
        for tile in range(first, last):
            t = tile * TILE_N + tl.arange(0, TILE_N)  # [TILE_N] token positions
            live = (t < hi) & (t >= lo)
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
                s = tl.dot(q, tl.trans(k), input_precision="ieee")  # [R_PAD, TILE_N] f32
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * sm_scale
            if SOFTCAP:  # cap * tanh(s / cap), tanh from exp: 1 - 2 / (e^2x + 1)
                s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
            visible = (t[None, :] < end[:, None]) & (t[None, :] >= start[:, None])  # [R_PAD, TILE_N]
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet stays 0, not NaN
            alpha = tl.exp(m - m_ref)
            p = tl.exp(s - m_ref[:, None])  # [R_PAD, TILE_N]
            l = l * alpha + tl.sum(p, 1)
            if IEEE:
                pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m = m_new
        row = b * stride_ob + s_of[:, None] * stride_os + heads[:, None] * stride_oh + d[None, :]  # [R_PAD, D]
        if PARTIAL:
            tl.store(OUT + row + split * stride_osplit, acc, mask=row_ok[:, None])
            stat = b * stride_mb + s_of * stride_ms + heads * stride_mh + split
            tl.store(M_OUT + stat, m, mask=row_ok)
            tl.store(L_OUT + stat, l, mask=row_ok)
        else:
            tl.store(OUT + row, (acc / l[:, None]).to(OUT.dtype.element_ty), mask=row_ok[:, None])

    @triton.jit
    def combine(ACC, M_IN, L_IN, OUT, S: tl.constexpr, S_PAD: tl.constexpr, D: tl.constexpr):
        """One (sequence, new token, head) row: the splits' partial results, softmax-weighted, into OUT [rows, D]."""
        row = tl.program_id(0)
        s = tl.arange(0, S_PAD)
        d = tl.arange(0, D)
        m = tl.load(M_IN + row * S + s, mask=s < S, other=float("-inf"))  # [S_PAD]
        l = tl.load(L_IN + row * S + s, mask=s < S, other=0.0)
        acc = tl.load(ACC + row * S * D + s[:, None] * D + d[None, :], mask=(s < S)[:, None], other=0.0)
        w = tl.exp(m - tl.max(m, 0))  # splits that held none of the row's keys (m = -inf) weigh 0
        out = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)  # [D]
        tl.store(OUT + row * D + d, out.to(OUT.dtype.element_ty))

    return paged_attention, combine


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
    return _attend(q[:, None], k_cache, v_cache, block_tables, context_lens, None, k_scales, v_scales, splits,
                   window, scale, softcap)[:, 0]


def paged_verify_attention(
    q: torch.Tensor,  # [B, S, H, D] the new tokens' queries (post-RoPE): the last token and its k proposals
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,  # [N, bs, Hkv, D]
    block_tables: torch.Tensor,  # [B, M] int; rows may be strided, columns contiguous
    context_lens: torch.Tensor,  # [B] int, tokens each sequence holds (its new ones included); any stride
    positions: torch.Tensor,  # [B, S] int, each new token's position (< context_lens); any strides
    k_scales: torch.Tensor | None = None,  # [N, Hkv] float32 for int8/fp8 caches
    v_scales: torch.Tensor | None = None,
    splits: int | None = None,
    window: int = 0,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Each new token at position p attends keys [0, min(p + 1, context_len)) (with a window W: only those
    after p - W) -> [B, S, H, D] in q's dtype. A row's tokens lie within S - 1 positions of its first (verify:
    consecutive, pad entries repeating the last): a windowed layer's programs walk only that span's tiles."""
    if positions.shape != q.shape[:2]:
        raise ValueError(f"the paged kernel takes a position per new token: q {tuple(q.shape)}, positions "
                         f"{tuple(positions.shape)}")
    return _attend(q, k_cache, v_cache, block_tables, context_lens, positions, k_scales, v_scales, splits, window,
                   scale, softcap)


def _attend(q, k_cache, v_cache, block_tables, context_lens, positions, k_scales, v_scales, splits, window, scale,
            softcap) -> torch.Tensor:
    """q [B, S, H, D] -> [B, S, H, D]; positions [B, S] or None (S = 1 at each context's last position)."""
    import triton

    B, S, H, D = q.shape
    N, bs, Hkv, _ = k_cache.shape
    G = H // Hkv
    if H % Hkv or D & (D - 1) or D < 16 or bs & (bs - 1):
        raise ValueError(f"the paged kernel takes H a multiple of Hkv, D and block size powers of two (D >= 16); "
                         f"got H={H}, Hkv={Hkv}, D={D}, block size {bs}")
    if not takes(S, G):
        raise ValueError(f"the paged kernel takes at most {MAX_QUERY_ROWS} query rows per kv head; {S} new tokens x "
                         f"{G} heads are more: attend through attention.paged_attention")
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
    if window:  # a row's keys span at most window + S - 1 positions: at most this many tiles
        tiles = min(tiles, -(-(window + S - 2) // tile) + 1)
    splits = splits or num_splits(B, Hkv, tiles * tile // bs, bs)
    tiles_per_split = -(-tiles // splits)
    rows = max(16, triton.next_power_of_2(S * G))
    scales = k_scales if quant else q  # any pointer when unused
    partial = splits > 1
    if partial:
        out = torch.empty(B, S, H, splits, D, dtype=torch.float32, device=q.device)
        m = torch.empty(B, S, H, splits, dtype=torch.float32, device=q.device)
        l = torch.empty(B, S, H, splits, dtype=torch.float32, device=q.device)
        strides = (*out.stride()[:4], *m.stride()[:3])
    else:
        out = torch.empty(B, S, H, D, dtype=q.dtype, device=q.device)
        m = l = out
        strides = (*out.stride()[:3], 0, 0, 0, 0)
    pos = positions if positions is not None else context_lens  # any pointer when unused
    pos_strides = positions.stride() if positions is not None else (0, 0)
    paged_attention, combine = _kernel()
    paged_attention[(B, Hkv, splits)](
        q, k_cache, v_cache, scales, v_scales if quant else scales, block_tables, context_lens, pos, out, m, l,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_scales.stride(0) if quant else 0,
        block_tables.stride(0), context_lens.stride(0), *pos_strides,
        *strides,
        1.0 / math.sqrt(D) if scale is None else scale, tiles_per_split, window or 2**30, softcap or 1.0,
        G=G, S=S, R_PAD=rows, D=D, BS=bs, TILE_N=tile,
        QUANT=quant, IEEE=q.dtype == torch.float32, PARTIAL=partial, SOFTCAP=softcap is not None,
        HAS_POS=positions is not None,
    )
    if not partial:
        return out
    merged = torch.empty(B, S, H, D, dtype=q.dtype, device=q.device)
    combine[(B * S * H,)](out, m, l, merged, S=splits, S_PAD=triton.next_power_of_2(splits), D=D)
    return merged


def cache_attention(
    q: torch.Tensor,  # [B, S, H, D]
    cache,  # PagedKvCache
    layer: int,
    block_tables: torch.Tensor,  # [B, M]
    context_lens: torch.Tensor,  # [B]
    positions: torch.Tensor | None = None,  # [B, S]; None: decode (S = 1, each context's last position)
    window: int = 0,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """One layer's paged attention over the cache, for decode or a verify step (a windowed layer's: over its
    window) -> [B, S, H, D]."""
    scales = (None, None) if cache.k_scales is None else (cache.k_scales[layer], cache.v_scales[layer])
    return _attend(q, cache.k[layer], cache.v[layer], block_tables, context_lens, positions, *scales, None, window,
                   scale, softcap)
