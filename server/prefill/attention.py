"""Causal attention over packed, ragged prompts, without ever building the [S, S] score matrix.

Every query and key carries a position (in its prompt) and a segment id (which prompt of the packed
buffer it belongs to): query i reads key j iff seg[i] == seg[j] and pos[j] <= pos[i], and, in a layer with a
sliding window W, pos[i] - pos[j] < W (the window: a traced int32 scalar, so one compiled layer serves
windowed and global layers alike; None: no window). That one rule
covers right padding, several prompts packed into one token buffer, and a chunk attending to the KV
of the chunks before it (the context keys carry the earlier positions). Padding carries a segment id
that no real token has.

- `reference_attention`: the whole masked score matrix at once; the oracle for tests.
- `blockwise_attention`: flash-style online softmax over key blocks, one query block at a time; peak
  memory [B, Hkv, G, block_q, block_k] per step, so linear in the prompt length. Key blocks no query
  of the block may read are skipped (`lax.cond`), so a packed buffer costs about what its prompts
  would cost one by one. Used on the CPU.
- `scheduled_attention`: the same online softmax over a static schedule of (query block, key block)
  pairs (`block_schedule`: the context's blocks, then the queries' own up to the diagonal), one scan of
  a known trip count with no per-block conditional: on XLA:GPU a `lax.cond` inside the loop copies its
  predicate to the host every block. Used on GPUs.
- `pallas_attention`: the same algorithm as a Pallas kernel (one program per batch row, query head and
  query block, looping over key blocks in VMEM); compiled by Mosaic on TPU, run in interpret mode on CPU
  by the tests against the reference.
- `attention`: picks one by backend.

Shapes: B batch, S queries, K keys, Hq/Hkv query/kv heads, G = Hq // Hkv, D head dim.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

F32 = jnp.float32
NEG = -1e30
"""The masked score: finite, so a block whose keys are all masked leaves the running max unchanged."""


def _mask(q_pos: jax.Array, q_seg: jax.Array, k_pos: jax.Array, k_seg: jax.Array, window=None) -> jax.Array:
    """[..., S] and [..., K] -> bool [..., S, K]: who may read whom."""
    same = q_seg[..., :, None] == k_seg[..., None, :]
    behind = q_pos[..., :, None] - k_pos[..., None, :]  # [..., S, K]
    visible = same & (behind >= 0)
    return visible if window is None else visible & (behind < window)


def _scores(sc: jax.Array, softcap: float | None) -> jax.Array:
    """Scaled scores f32, soft-capped to cap * tanh(s / cap) when the model does (Gemma 2)."""
    return sc if softcap is None else softcap * jnp.tanh(sc / softcap)


def reference_attention(q, k, v, q_pos, q_seg, k_pos, k_seg, window=None, *, scale: float | None = None,
                        softcap: float | None = None):
    """q [B, S, Hq, D]; k, v [B, K, Hkv, D]; q_pos, q_seg int32 [B, S]; k_pos, k_seg [B, K] -> [B, S, Hq, D].
    scale: the scores' (None: D ** -0.5); softcap: their tanh cap (None: none)."""
    b, s, hq, d = q.shape
    hkv = k.shape[2]
    q = q.reshape(b, s, hkv, hq // hkv, d)  # [B, S, Hkv, G, D]: q head h reads kv head h // G
    scale = d**-0.5 if scale is None else scale
    scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k, preferred_element_type=F32) * scale  # [B, Hkv, G, S, K]
    scores = _scores(scores, softcap)
    mask = _mask(q_pos, q_seg, k_pos, k_seg, window)[:, None, None]  # [B, 1, 1, S, K]
    scores = jnp.where(mask, scores, NEG)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(mask, probs, 0.0).astype(v.dtype)  # a query reading nothing (padding) gets zeros
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v, preferred_element_type=F32)  # [B, S, Hkv, G, D]
    return out.astype(v.dtype).reshape(b, s, hq, d)


def _pad_to(x: jax.Array, axis: int, multiple: int, value) -> jax.Array:
    extra = -x.shape[axis] % multiple
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def _padded_to_blocks(q, k, v, q_pos, q_seg, k_pos, k_seg, bq: int, bk: int):
    """Queries padded to a multiple of bq, keys to a multiple of bk; padded queries get segment -1,
    padded keys -2 (matches no query, padding neither)."""
    q, k, v, q_pos, q_seg, k_pos, k_seg = map(jnp.asarray, (q, k, v, q_pos, q_seg, k_pos, k_seg))
    q, q_pos, q_seg = _pad_to(q, 1, bq, 0), _pad_to(q_pos, 1, bq, 0), _pad_to(q_seg, 1, bq, -1)
    k, v = _pad_to(k, 1, bk, 0), _pad_to(v, 1, bk, 0)
    k_pos, k_seg = _pad_to(k_pos, 1, bk, 0), _pad_to(k_seg, 1, bk, -2)
    return q, k, v, q_pos, q_seg, k_pos, k_seg


def _blocked(q, k, v, q_pos, q_seg, k_pos, k_seg, bq: int, bk: int, hkv: int):
    """The padded inputs cut into query and key blocks, block index first: q [nq, B, Hkv, G, bq, D],
    k and v [nk, B, Hkv, bk, D], positions and segments [nq, B, bq] and [nk, B, bk]."""
    b, s, hq, d = q.shape
    nq, nk, g = s // bq, k.shape[1] // bk, hq // hkv
    qb = q.reshape(b, nq, bq, hkv, g, d).transpose(1, 0, 3, 4, 2, 5)
    kb, vb = (x.reshape(b, nk, bk, hkv, d).transpose(1, 0, 3, 2, 4) for x in (k, v))
    qpb, qsb = (x.reshape(b, nq, bq).transpose(1, 0, 2) for x in (q_pos, q_seg))
    kpb, ksb = (x.reshape(b, nk, bk).transpose(1, 0, 2) for x in (k_pos, k_seg))
    return qb, kb, vb, qpb, qsb, kpb, ksb


def blockwise_attention(q, k, v, q_pos, q_seg, k_pos, k_seg, window=None, *, block_q: int = 256,
                        block_k: int = 256, scale: float | None = None, softcap: float | None = None):
    """`reference_attention`'s result with online softmax over key blocks (exact within fp32 rounding); key
    blocks wholly outside a query block's window are skipped like those past its diagonal."""
    b, s, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    bq, bk = min(block_q, s), min(block_k, k.shape[1])
    q, k, v, q_pos, q_seg, k_pos, k_seg = _padded_to_blocks(q, k, v, q_pos, q_seg, k_pos, k_seg, bq, bk)
    nq, nk = q.shape[1] // bq, k.shape[1] // bk
    qb, kb, vb, qpb, qsb, kpb, ksb = _blocked(q, k, v, q_pos, q_seg, k_pos, k_seg, bq, bk, hkv)
    scale = d**-0.5 if scale is None else scale

    def one_query_block(args):
        qi, qp, qs = args  # [B, Hkv, G, bq, D], [B, bq], [B, bq]

        def step(j, carry):
            mask = _mask(qp, qs, kpb[j], ksb[j], window)  # [B, bq, bk]

            def update(carry):
                m, l, acc = carry  # [B, Hkv, G, bq] x2, [B, Hkv, G, bq, D] f32
                sc = _scores(jnp.einsum("bkgqd,bksd->bkgqs", qi, kb[j], preferred_element_type=F32) * scale, softcap)
                sc = jnp.where(mask[:, None, None], sc, NEG)  # [B, Hkv, G, bq, bk]
                m_new = jnp.maximum(m, sc.max(-1))
                p = jnp.where(mask[:, None, None], jnp.exp(sc - m_new[..., None]), 0.0)
                corr = jnp.exp(m - m_new)
                pv = jnp.einsum("bkgqs,bksd->bkgqd", p.astype(v.dtype), vb[j], preferred_element_type=F32)
                return m_new, l * corr + p.sum(-1), acc * corr[..., None] + pv

            return jax.lax.cond(mask.any(), update, lambda c: c, carry)

        init = (jnp.full((b, hkv, g, bq), NEG, F32), jnp.zeros((b, hkv, g, bq), F32),
                jnp.zeros((b, hkv, g, bq, d), F32))
        _, l, acc = jax.lax.fori_loop(0, nk, step, init)
        return acc / jnp.where(l > 0, l, 1.0)[..., None]  # [B, Hkv, G, bq, D]

    out = jax.lax.map(one_query_block, (qb, qpb, qsb))  # [nq, B, Hkv, G, bq, D]
    out = out.transpose(1, 0, 4, 2, 3, 5).reshape(b, nq * bq, hq, d)[:, :s]
    return out.astype(v.dtype)


def block_schedule(nq: int, bq: int, nc: int, no: int, bk: int) -> tuple[np.ndarray, np.ndarray]:
    """The (query block, key block) pairs `scheduled_attention` visits, fixed by the shapes alone: for each
    query block (bq queries), every context key block (the first nc blocks of bk keys), then the queries'
    own key blocks (no of them, after the context) up to the one holding the block's last query; those
    past it hold only later keys of the same rows, which no query of the block may read.
    -> (query block, key block) int32 [P] each, query blocks in order."""
    pairs = [(i, j) for i in range(nq)
             for j in [*range(nc), *(nc + o for o in range(min(no, ((i + 1) * bq - 1) // bk + 1)))]]
    i, j = np.array(pairs, np.int32).reshape(-1, 2).T
    return i, j


def scheduled_attention(q, k, v, q_pos, q_seg, k_pos, k_seg, window=None, *, own_keys_from: int | None = None,
                        block_q: int = 512, block_k: int = 512, scale: float | None = None,
                        softcap: float | None = None):
    """`reference_attention`'s result with online softmax over a static schedule of (query block, key block)
    pairs (`block_schedule`): one `lax.scan` of a trip count known at compile time, no per-block
    conditional, so nothing goes back to the host between blocks (XLA:GPU copies a `lax.cond`'s predicate
    to the host each time). Blocks the rule masks whole inside the schedule are computed and masked (so are
    blocks behind a traced window: the schedule is fixed by the shapes alone).

    own_keys_from: k[:, own_keys_from:] are the queries' own keys, in the queries' order (the model's layout:
    context KV, then the new tokens'); then a query block visits no own key block past its last query (half
    the blocks of a long prompt). None: every key block for every query block.
    """
    b, s, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    context = k.shape[1] if own_keys_from is None else own_keys_from
    if own_keys_from is not None and k.shape[1] - own_keys_from != s:
        raise ValueError(f"own_keys_from={own_keys_from}: the {k.shape[1] - own_keys_from} keys after it are "
                         f"not the {s} queries' own")
    bq = min(block_q, s)
    bk = min(block_k, max(context, s if own_keys_from is not None else 0, 1))
    q, q_pos, q_seg = map(jnp.asarray, (q, q_pos, q_seg))
    q, q_pos, q_seg = _pad_to(q, 1, bq, 0), _pad_to(q_pos, 1, bq, 0), _pad_to(q_seg, 1, bq, -1)
    parts = [(0, context), (context, k.shape[1])] if own_keys_from is not None else [(0, k.shape[1])]
    pads = []  # each part (context, own) padded to whole key blocks: own blocks then start on a block
    for lo, hi in parts:
        kk, vv, kp, ks = (jnp.asarray(a)[:, lo:hi] for a in (k, v, k_pos, k_seg))
        pads.append((_pad_to(kk, 1, bk, 0), _pad_to(vv, 1, bk, 0), _pad_to(kp, 1, bk, 0), _pad_to(ks, 1, bk, -2)))
    k, v, k_pos, k_seg = (jnp.concatenate(xs, axis=1) for xs in zip(*pads))
    nq, nk = q.shape[1] // bq, k.shape[1] // bk
    nc = pads[0][0].shape[1] // bk if own_keys_from is not None else nk
    qi_of, kj_of = block_schedule(nq, bq, nc, nk - nc, bk) if own_keys_from is not None else \
        block_schedule(nq, bq, nk, 0, bk)
    qb, kb, vb, qpb, qsb, kpb, ksb = _blocked(q, k, v, q_pos, q_seg, k_pos, k_seg, bq, bk, hkv)
    scale = d**-0.5 if scale is None else scale

    def step(carry, pair):
        m, l, acc = carry  # [nq, B, Hkv, G, bq] x2, [nq, B, Hkv, G, bq, D] f32: every query block's running state
        i, j = pair
        mask = _mask(qpb[i], qsb[i], kpb[j], ksb[j], window)[:, None, None]  # [B, 1, 1, bq, bk]
        sc = _scores(jnp.einsum("bkgqd,bksd->bkgqs", qb[i], kb[j], preferred_element_type=F32) * scale, softcap)
        sc = jnp.where(mask, sc, NEG)  # [B, Hkv, G, bq, bk]
        m_new = jnp.maximum(m[i], sc.max(-1))
        p = jnp.where(mask, jnp.exp(sc - m_new[..., None]), 0.0)
        corr = jnp.exp(m[i] - m_new)
        pv = jnp.einsum("bkgqs,bksd->bkgqd", p.astype(vb.dtype), vb[j], preferred_element_type=F32)
        carry = (m.at[i].set(m_new), l.at[i].set(l[i] * corr + p.sum(-1)), acc.at[i].set(acc[i] * corr[..., None] + pv))
        return carry, None

    init = (jnp.full((nq, b, hkv, g, bq), NEG, F32), jnp.zeros((nq, b, hkv, g, bq), F32),
            jnp.zeros((nq, b, hkv, g, bq, d), F32))
    (_, l, acc), _ = jax.lax.scan(step, init, (jnp.asarray(qi_of), jnp.asarray(kj_of)))
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]  # [nq, B, Hkv, G, bq, D]; a query reading nothing: zeros
    out = out.transpose(1, 0, 4, 2, 3, 5).reshape(b, nq * bq, hq, d)[:, :s]
    return out.astype(vb.dtype)


def _flash_kernel(w_ref, qp_ref, qs_ref, kp_ref, ks_ref, q_ref, k_ref, v_ref, o_ref, *, block_k: int, scale: float,
                  softcap: float | None):
    """One (row, query head, query block): q [bq, D] against every key block of its kv head [K, D]."""
    from jax.experimental import pallas as pl

    q = q_ref[...].astype(F32)  # [bq, D]
    qp, qs = qp_ref[...], qs_ref[...]  # [bq]
    bq, d = q.shape
    nk = k_ref.shape[0] // block_k

    def step(j, carry):
        m, l, acc = carry  # [bq], [bq], [bq, D]
        keys = pl.ds(j * block_k, block_k)
        kj, vj = k_ref[keys, :].astype(F32), v_ref[keys, :].astype(F32)  # [bk, D]
        behind = qp[:, None] - kp_ref[keys][None, :]  # [bq, bk]
        mask = (qs[:, None] == ks_ref[keys][None, :]) & (behind >= 0) & (behind < w_ref[0])  # [bq, bk]
        sc = jnp.where(mask, _scores(jnp.dot(q, kj.T, preferred_element_type=F32) * scale, softcap), NEG)
        m_new = jnp.maximum(m, sc.max(-1))
        p = jnp.where(mask, jnp.exp(sc - m_new[:, None]), 0.0)
        corr = jnp.exp(m - m_new)
        return m_new, l * corr + p.sum(-1), acc * corr[:, None] + jnp.dot(p, vj, preferred_element_type=F32)

    init = (jnp.full((bq,), NEG, F32), jnp.zeros((bq,), F32), jnp.zeros((bq, d), F32))
    _, l, acc = jax.lax.fori_loop(0, nk, step, init)
    o_ref[...] = (acc / jnp.where(l > 0, l, 1.0)[:, None]).astype(o_ref.dtype)


def pallas_attention(q, k, v, q_pos, q_seg, k_pos, k_seg, window=None, *, block_q: int = 128, block_k: int = 128,
                     interpret: bool = False, scale: float | None = None, softcap: float | None = None):
    """`reference_attention` as a Pallas kernel; interpret=True runs it on any backend (tests)."""
    from jax.experimental import pallas as pl

    b, s, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    bq, bk = min(block_q, s), min(block_k, k.shape[1])
    q, k, v, q_pos, q_seg, k_pos, k_seg = _padded_to_blocks(q, k, v, q_pos, q_seg, k_pos, k_seg, bq, bk)
    sp, kp = q.shape[1], k.shape[1]
    qt = q.transpose(0, 2, 1, 3)  # [B, Hq, S, D]
    kt, vt = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, Hkv, K, D]
    out = pl.pallas_call(
        partial(_flash_kernel, block_k=bk, scale=d**-0.5 if scale is None else scale, softcap=softcap),
        grid=(b, hq, sp // bq),
        in_specs=[
            pl.BlockSpec((1,), lambda i, h, j: (0,)),  # the window
            pl.BlockSpec((None, bq), lambda i, h, j: (i, j)),  # q_pos
            pl.BlockSpec((None, bq), lambda i, h, j: (i, j)),  # q_seg
            pl.BlockSpec((None, kp), lambda i, h, j: (i, 0)),  # k_pos
            pl.BlockSpec((None, kp), lambda i, h, j: (i, 0)),  # k_seg
            pl.BlockSpec((None, None, bq, d), lambda i, h, j: (i, h, j, 0)),  # q
            pl.BlockSpec((None, None, kp, d), lambda i, h, j: (i, h // g, 0, 0)),  # k of this head's group
            pl.BlockSpec((None, None, kp, d), lambda i, h, j: (i, h // g, 0, 0)),  # v
        ],
        out_specs=pl.BlockSpec((None, None, bq, d), lambda i, h, j: (i, h, j, 0)),
        out_shape=jax.ShapeDtypeStruct((b, hq, sp, d), q.dtype),
        interpret=interpret,
    )(_window_array(window), q_pos, q_seg, k_pos, k_seg, qt, kt, vt)
    return out.transpose(0, 2, 1, 3)[:, :s]  # [B, S, Hq, D]


NO_WINDOW = 2**30
"""The window of a layer that has none, where a window must be a number (longer than any sequence)."""


def _window_array(window) -> jax.Array:
    """int32 [1]: the kernel's window (NO_WINDOW for None)."""
    return jnp.full((1,), NO_WINDOW if window is None else window, jnp.int32)


GPU_BLOCK = 1024
"""`scheduled_attention`'s query and key block on GPUs: few, large blocks (each pair is one loop iteration,
a handful of kernel launches; 136 pairs a layer at 16k tokens), [B, Hq, 1024, 1024] f32 scores a step."""


def attention(q, k, v, q_pos, q_seg, k_pos, k_seg, window=None, *, own_keys_from: int | None = None,
              scale: float | None = None, softcap: float | None = None):
    """The backend's memory-bounded attention: the Pallas kernel on TPU; on the CPU blockwise, skipping key
    blocks with `lax.cond` (a branch on the host costs nothing there: as fast as the static schedule on one
    2k-token prompt, 3x faster on 8 prompts of 256 packed, whose cross-prompt blocks it skips); on GPUs the
    static schedule, no host round-trip per block (packed prompts' cross-prompt blocks below the diagonal
    are computed and masked there). own_keys_from: where the queries' own keys start in k; window: the layer's
    sliding window (a traced int32 scalar), None for full attention; scale, softcap: the scores' (see
    `reference_attention`)."""
    backend = jax.default_backend()
    how = dict(scale=scale, softcap=softcap)
    if backend == "tpu":
        return pallas_attention(q, k, v, q_pos, q_seg, k_pos, k_seg, window, **how)
    if backend == "cpu":
        return blockwise_attention(q, k, v, q_pos, q_seg, k_pos, k_seg, window, **how)
    return scheduled_attention(q, k, v, q_pos, q_seg, k_pos, k_seg, window, own_keys_from=own_keys_from,
                               block_q=GPU_BLOCK, block_k=GPU_BLOCK, **how)
