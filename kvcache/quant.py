"""Reference KV quantization in numpy: fp8_e4m3 (absmax / 448) and int8 (absmax / 127), per block, per kv head.

One float32 scale covers the `block_size` tokens x `head_dim` values of one kv head in one block of one
layer: `x ≈ q * scale`. The tiers quantize on their devices (JAX on prefill, torch on decode) the same
way; these functions are the definition the tests hold them to.

Error bounds (|x - dequantize(quantize(x))| per element, s = the element's scale = absmax / qmax):
- int8: round to nearest, so at most s / 2 = absmax / 254.
- fp8_e4m3: 3 mantissa bits, so at most 2**-4 relative to |x| for normal values, and at most
  2**-10 * s (half the subnormal step 2**-9 in units of s) near zero.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from pdserve.kvcache.layout import NUMPY_DTYPES, QUANTIZED

QMAX: dict[str, float] = {"fp8_e4m3": float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max), "int8": 127.0}


def block_scales(x: np.ndarray, block_size: int, dtype: str) -> np.ndarray:
    """x [L, T, Hkv, D] -> float32 scales [L, ceil(T / block_size), Hkv]: absmax / qmax (0 for an all-zero block)."""
    _check(dtype)
    L, T, H, D = x.shape
    nb = -(-T // block_size)
    padded = np.zeros((L, nb * block_size, H, D), dtype=np.float32)
    padded[:, :T] = x
    absmax = np.abs(padded.reshape(L, nb, block_size, H, D)).max(axis=(2, 4))  # [L, nb, Hkv]
    return (absmax / np.float32(QMAX[dtype])).astype(np.float32)


def quantize(x: np.ndarray, block_size: int, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """x [L, T, Hkv, D] float -> (q [L, T, Hkv, D] in dtype, scales float32 [L, ceil(T / block_size), Hkv])."""
    scales = block_scales(x, block_size, dtype)
    per_token = _per_token(scales, x.shape[1], block_size)  # [L, T, Hkv, 1]
    safe = np.where(per_token > 0, per_token, np.float32(1))
    y = np.clip(x.astype(np.float32) / safe, -QMAX[dtype], QMAX[dtype])
    if dtype == "int8":
        return np.rint(y).astype(np.int8), scales
    return y.astype(NUMPY_DTYPES[dtype]), scales


def dequantize(q: np.ndarray, scales: np.ndarray, block_size: int, out_dtype=np.float32) -> np.ndarray:
    """(q [L, T, Hkv, D], scales [L, nb, Hkv]) -> x [L, T, Hkv, D] in out_dtype."""
    per_token = _per_token(scales, q.shape[1], block_size)
    return (q.astype(np.float32) * per_token).astype(out_dtype)


def error_bound(x: np.ndarray, scales: np.ndarray, block_size: int, dtype: str) -> np.ndarray:
    """The largest |x - dequantize(quantize(x))| the format allows, element-wise (the module docstring's bounds)."""
    _check(dtype)
    s = _per_token(scales, x.shape[1], block_size)
    if dtype == "int8":
        return np.broadcast_to(s / 2, x.shape) * (1 + 1e-6)
    return np.maximum(np.abs(x) * 2.0**-4, s * 2.0**-10) * (1 + 1e-6)


def _per_token(scales: np.ndarray, num_tokens: int, block_size: int) -> np.ndarray:
    """scales [L, nb, Hkv] -> [L, T, Hkv, 1]."""
    return np.repeat(scales, block_size, axis=1)[:, :num_tokens, :, None]


def _check(dtype: str) -> None:
    if dtype not in QUANTIZED:
        raise ValueError(f"{dtype} is not a quantized KV dtype ({', '.join(sorted(QUANTIZED))})")
