"""One KV block as bytes, the unit every offload tier stores, and the fingerprint that keeps layouts apart.

A block's bytes are its K then its V, [L, block_size, Hkv, D] each in the layout's dtype, then (quantized dtypes)
its float32 K and V scales, [L, Hkv] each (an MLA latent's V and V scales are empty: its K alone): the same bytes
whichever tier wrote them, so a prefill worker reads what a decode worker stored. `layout_fingerprint` names what those bytes mean (the model's fingerprint, the
layout's shape, dtype and block size); the tiers key a block by it and the block's hash, so a worker of another
model, block size or KV quantization never reads them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from pdserve.kvcache.layout import QUANTIZED, KvLayout


@dataclass
class BlockKv:
    k: np.ndarray  # [L, bs, Hkv, D] in the layout's dtype
    v: np.ndarray  # [L, bs, Hkv, D] ([L, bs, 1, 0]: an MLA latent's)
    k_scales: np.ndarray | None = None  # [L, Hkv] float32, quantized dtypes only
    v_scales: np.ndarray | None = None  # [L, Hkv] ([L, 0]: a latent's)


def block_nbytes(layout: KvLayout) -> int:
    """Bytes of one block: K, V and (quantized dtypes) their scales."""
    heads = layout.num_kv_heads + layout.value_heads
    scales = layout.num_layers * heads * 4 if layout.dtype in QUANTIZED else 0
    return layout.bytes_per_token * layout.block_size + scales


def pack_block(layout: KvLayout, block: BlockKv) -> bytes:
    """The block's bytes; refuses arrays of another shape or dtype."""
    k_shape = (layout.num_layers, layout.block_size, layout.num_kv_heads, layout.head_dim)
    for name, a, shape in (("k", block.k, k_shape), ("v", block.v, (*k_shape[:3], layout.value_dim))):
        if a.shape != shape or a.dtype != layout.np_dtype:
            raise ValueError(f"block {name} is {a.dtype} {a.shape}; this layout holds {layout.dtype} {shape}")
    parts = [block.k, block.v]
    if layout.dtype in QUANTIZED:
        for name, s, heads in (("k_scales", block.k_scales, layout.num_kv_heads),
                               ("v_scales", block.v_scales, layout.value_heads)):
            scale_shape = (layout.num_layers, heads)
            if s is None or s.shape != scale_shape:
                raise ValueError(f"{layout.dtype} block needs {name} float32 {scale_shape}")
        parts += [block.k_scales.astype(np.float32), block.v_scales.astype(np.float32)]
    return b"".join(np.ascontiguousarray(a).tobytes() for a in parts)


def unpack_block(layout: KvLayout, data: bytes | memoryview) -> BlockKv:
    """The block the bytes hold (read-only views on them); ValueError when their length is not one block's."""
    if len(data) != block_nbytes(layout):
        raise ValueError(f"{len(data)} bytes are not one block of [{layout.describe()}] ({block_nbytes(layout)})")
    shape = (layout.num_layers, layout.block_size, layout.num_kv_heads, layout.head_dim)
    v_shape = (*shape[:3], layout.value_dim)
    k = np.frombuffer(data, layout.np_dtype, int(np.prod(shape))).reshape(shape)
    v = np.frombuffer(data, layout.np_dtype, int(np.prod(v_shape)), offset=k.nbytes).reshape(v_shape)
    if layout.dtype not in QUANTIZED:
        return BlockKv(k, v)
    at = k.nbytes + v.nbytes
    mk, mv = layout.num_layers * layout.num_kv_heads, layout.num_layers * layout.value_heads
    ks = np.frombuffer(data, np.float32, mk, offset=at).reshape(layout.num_layers, layout.num_kv_heads)
    vs = np.frombuffer(data, np.float32, mv, offset=at + 4 * mk).reshape(layout.num_layers, layout.value_heads)
    return BlockKv(k, v, ks, vs)


def layout_fingerprint(layout: KvLayout, model_fingerprint: str) -> str:
    """32 hex digits naming the model and what a block's bytes hold (layers, heads, head dim, block size,
    dtype, scales, an MLA latent's kind); sliding windows leave the bytes alone and the model's fingerprint covers them."""
    parts = (model_fingerprint, layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.block_size,
             layout.dtype, layout.scale_granularity) + ((layout.kind,) if layout.latent else ())
    text = "|".join(map(str, parts))
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
