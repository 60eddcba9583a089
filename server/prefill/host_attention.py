"""Attention on the host, for the CPU backend's onednn-bf16 path: torch's CPU flash attention
(`scaled_dot_product_attention`, bf16 in, fp32 accumulation, oneDNN/AMX brgemm kernels), called from the jitted
layer through one call per layer (onednn_native.py's target, its C++ twin of `attend`; host_call.py's, running
`attend`, where that library is not built), with attention.py's rule unchanged:

query i reads key j iff seg[i] == seg[j] and 0 <= pos[i] - pos[j] < window.

On the host each row is cut by segment (a packed step's prompts, each with its context keys). A segment whose
keys are its queries' own, at the same strictly increasing positions, with no window that cuts, is plain causal
attention (`is_causal`, the kernel skipping the blocks above the diagonal); any other (context from earlier chunks
or cached blocks, a sliding window that cuts, gaps) passes the rule as a boolean mask, queries in chunks of
`MASK_QUERIES` so the mask stays small. Padding queries (segment < 0) read nothing here and get zeros: their rows
are never read (attention.py's kernels compute them, from padding keys, for nothing). A soft-capped model
(Gemma 2), or activations not in bf16, keep attention.py's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pdserve.server.prefill import host_call, onednn_native
from pdserve.server.prefill.attention import NO_WINDOW, attention

MASK_QUERIES = 512
"""Queries per call where the rule passes as a mask: its [512, K] bool bounds the memory at any context."""


def host_attention(q, k, v, q_pos, q_seg, k_pos, k_seg, window=None, *, own_keys_from: int | None = None,
                   scale: float | None = None, softcap: float | None = None):
    """An `Attention` (kernels.py): attention.py's `attention` result, computed on the host where it can be."""
    if softcap is not None or q.dtype != jnp.bfloat16 or jax.default_backend() != "cpu":
        return attention(q, k, v, q_pos, q_seg, k_pos, k_seg, window, own_keys_from=own_keys_from, scale=scale,
                         softcap=softcap)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    w = jnp.asarray(NO_WINDOW if window is None else window, jnp.int32)
    as32 = lambda a: jnp.asarray(a, jnp.int32)  # noqa: E731
    args = [q, k.astype(q.dtype), v.astype(q.dtype), as32(q_pos), as32(q_seg), as32(k_pos), as32(k_seg), w]
    out = jax.ShapeDtypeStruct(q.shape, q.dtype)
    if isinstance(onednn_native.load(), onednn_native.Native):  # the same rule in C++ (onednn_native.cc), no GIL
        return onednn_native.call("pdserve_host_attention", args, out, scale=float(scale),
                                  mask_queries=np.int64(MASK_QUERIES))
    return host_call.call("attention", repr(float(scale)), args, [out])[0]


def attend(inputs: list, outputs: list, scale: str) -> None:
    """On the host: q bf16 [B, S, Hq, D], k, v [B, K, Hkv, D], positions and segments int32 [B, S] / [B, K], window
    int32 [] -> out bf16 [B, S, Hq, D] by the rule above (torch tensors over the call's buffers)."""
    import torch

    sdpa = torch.nn.functional.scaled_dot_product_attention
    (qt, kt, vt, q_pos, q_seg, k_pos, k_seg, window), (out,) = inputs, outputs
    q_pos, q_seg, k_pos, k_seg = (a.numpy() for a in (q_pos, q_seg, k_pos, k_seg))
    window, scale = int(window), float(scale)
    out.zero_()
    for b in range(qt.shape[0]):
        for seg in np.unique(q_seg[b]):
            if seg < 0:
                continue
            qi, ki = _where(q_seg[b] == seg), _where(k_seg[b] == seg)
            qp, kp = q_pos[b, qi], k_pos[b, ki]
            qi, ki = (i if isinstance(i, slice) else torch.from_numpy(i) for i in (qi, ki))
            qs = qt[b, qi].transpose(0, 1)[None]  # [1, Hq, n, D]
            ks, vs = (x[b, ki].transpose(0, 1)[None] for x in (kt, vt))  # [1, Hkv, m, D]
            if _plain_causal(qp, kp, window):
                o = sdpa(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)  # [1, Hq, n, D]
            else:
                o = torch.cat([_masked(qs[:, :, i:i + MASK_QUERIES], ks, vs, qp[i:i + MASK_QUERIES], kp, window,
                                       scale) for i in range(0, len(qp), MASK_QUERIES)], dim=2)
            out[b, qi] = o[0].transpose(0, 1)


def _where(selected: np.ndarray) -> slice | np.ndarray:
    """The indexes of `selected`, as a slice where they are one run (a view, no gather)."""
    idx = np.flatnonzero(selected)
    return slice(int(idx[0]), int(idx[-1]) + 1) if idx[-1] - idx[0] + 1 == len(idx) else idx


def _plain_causal(qp: np.ndarray, kp: np.ndarray, window: int) -> bool:
    """Whether the rule is `is_causal`'s mask (key j visible to query i iff j <= i) for these positions."""
    return (len(qp) == len(kp) and np.array_equal(qp, kp) and bool(np.all(np.diff(qp) > 0))
            and int(qp[-1]) - int(kp[0]) < window)


def _masked(qs, ks, vs, qp: np.ndarray, kp: np.ndarray, window: int, scale: float):
    """qs [1, Hq, n, D] against ks, vs [1, Hkv, m, D] under the rule's mask [n, m]; a query reading nothing: zeros."""
    import torch

    behind = qp[:, None].astype(np.int64) - kp[None, :]  # [n, m]
    mask = (behind >= 0) & (behind < window)
    seen = mask.any(axis=1)
    o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=torch.from_numpy(mask | ~seen[:, None]),
                                                         scale=scale, enable_gqa=True)
    if not seen.all():
        o[:, :, torch.from_numpy(~seen)] = 0
    return o


host_call.register("attention", attend)
