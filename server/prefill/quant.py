"""Quantization on the prefill tier, in JAX: weight-only int8/fp8 linear weights, and the KV for the wire.

Weights: each layer matmul weight `w` is stored as `w` (int8 or float8_e4m3fn) beside `w_scale`
(float32, the same rank with the contracted axes kept as 1), quantized once at load: scale = absmax over
the input dims / qmax per output channel. Inside the jitted model `dequantize` computes
`w.astype(f32) * w_scale` in the compute dtype, which XLA fuses into the matmul's operand.

KV: `quantize_kv` turns the model's K/V into the decode worker's format on the device, with one float32
scale per block per kv head computed over each row's true length only (padding never widens a scale),
matching `kvcache.quant`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from pdserve.kvcache.quant import QMAX

F32 = jnp.float32
WEIGHT_FORMATS: dict[str, tuple[np.dtype, float]] = {
    "int8": (np.dtype(np.int8), QMAX["int8"]),
    "fp8": (np.dtype(ml_dtypes.float8_e4m3fn), QMAX["fp8_e4m3"]),
}
KV_FORMATS: dict[str, tuple[jnp.dtype, float]] = {
    "int8": (jnp.int8, QMAX["int8"]),
    "fp8_e4m3": (jnp.float8_e4m3fn, QMAX["fp8_e4m3"]),
}
# Per layer weight (stacked [L, ...]) -> the axes its matmul contracts (the input dims).
CONTRACTED: dict[str, tuple[int, ...]] = {
    "wq": (1,),  # [L, H, Hq, D]
    "wk": (1,),  # [L, H, Hkv, D]
    "wv": (1,),  # [L, H, Hkv, D]
    "wo": (1, 2),  # [L, Hq, D, H]
    "w_gate": (1,),  # [L, H, I]
    "w_up": (1,),  # [L, H, I]
    "w_down": (1,),  # [L, I, H]
    "e_gate": (2,),  # [L, E, H, I]: per expert and output channel
    "e_up": (2,),  # [L, E, H, I]
    "e_down": (2,),  # [L, E, I, H]
}
"""(An MoE model has the experts' e_* instead of w_*; its router stays in the compute dtype.)"""


def quantize_weight(w: np.ndarray, contracted: tuple[int, ...], fmt: str) -> tuple[np.ndarray, np.ndarray]:
    """w float -> (q in fmt, scale float32 with the contracted axes kept as 1), per output channel."""
    dtype, qmax = WEIGHT_FORMATS[fmt]
    w = np.asarray(w, dtype=np.float32)
    scale = (np.abs(w).max(axis=contracted, keepdims=True) / np.float32(qmax)).astype(np.float32)
    y = np.clip(w / np.where(scale > 0, scale, np.float32(1)), -qmax, qmax)
    return (np.rint(y) if fmt == "int8" else y).astype(dtype), scale


def quantize_layers(layers: dict[str, np.ndarray], fmt: str) -> dict[str, np.ndarray]:
    """Replaces each matmul weight by its quantized form and adds `<name>_scale`."""
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"weight format {fmt!r} is not one of {', '.join(WEIGHT_FORMATS)}")
    out = dict(layers)
    for name, axes in CONTRACTED.items():
        if name in layers:
            out[name], out[f"{name}_scale"] = quantize_weight(layers[name], axes, fmt)
    return out


def dequantize(p: dict, name: str, dtype) -> jax.Array:
    """The matmul weight `name` of one layer's params in the compute dtype (inside jit: fused)."""
    w = p[name]
    scale = p.get(f"{name}_scale")
    if scale is None:
        return w
    return (w.astype(F32) * scale).astype(dtype)


def quantize_kv(x: jax.Array, lengths: jax.Array, block_size: int, fmt: str) -> tuple[jax.Array, jax.Array]:
    """x [L, B, S, Hkv, D], lengths int32[B] -> (q [L, B, S', Hkv, D] in fmt, scales f32 [L, B, S' / bs, Hkv]).

    S' is S rounded up to whole blocks. Positions at or after a row's length are zeroed first, so a
    block's scale is the absmax of its true tokens / qmax (0 for a block of zeros), as kvcache.quant.
    """
    valid = jnp.arange(x.shape[2])[None, :] < lengths[:, None]  # [B, S]
    return quantize_kv_masked(x, valid, block_size, fmt)


def quantize_kv_masked(x: jax.Array, valid: jax.Array, block_size: int, fmt: str) -> tuple[jax.Array, jax.Array]:
    """`quantize_kv` over the tokens where valid bool [B, S] holds (a packed buffer's real tokens)."""
    dtype, qmax = KV_FORMATS[fmt]
    L, B, S, H, D = x.shape
    nb = -(-S // block_size)
    x = x.astype(F32)
    x = jnp.where(valid[None, :, :, None, None], x, 0.0)
    x = jnp.pad(x, ((0, 0), (0, 0), (0, nb * block_size - S), (0, 0), (0, 0)))
    blocks = x.reshape(L, B, nb, block_size, H, D)
    scales = jnp.max(jnp.abs(blocks), axis=(3, 5)) / qmax  # [L, B, nb, Hkv]
    safe = jnp.where(scales > 0, scales, 1.0)[:, :, :, None, :, None]
    y = jnp.clip(blocks / safe, -qmax, qmax)
    q = (jnp.round(y) if fmt == "int8" else y).astype(dtype)
    return q.reshape(L, B, nb * block_size, H, D), scales


def param_bytes(params) -> int:
    """Bytes the params hold on their devices."""
    return sum(x.nbytes for x in jax.tree.leaves(params))
