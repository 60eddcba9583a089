"""Rotary embedding frequencies, computed as transformers computes them (fp32)."""

from __future__ import annotations

import math

import numpy as np

from pdserve.server.model.config import ModelConfig, RopeConfig


def inv_freq(config: ModelConfig, rope: RopeConfig | None = None) -> np.ndarray:
    """[rope_dim // 2] float32 inverse frequencies of `rope` (by default the model's), with linear, llama3 or
    yarn scaling when configured."""
    dim = config.rope_dim
    rope = config.rope if rope is None else rope
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    freqs = (np.float32(1.0) / (np.float32(rope.theta) ** exponents)).astype(np.float32)
    if rope.kind == "default":
        return freqs
    if rope.kind == "yarn":
        return _yarn(rope, dim, exponents)
    if rope.kind == "linear":
        return (freqs / np.float32(rope.factor)).astype(np.float32)
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = np.float32(2 * math.pi) / freqs
    scaled = np.where(wavelen > low_wavelen, freqs / np.float32(rope.factor), freqs)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / np.float32(rope.factor) + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn(rope: RopeConfig, dim: int, exponents: np.ndarray) -> np.ndarray:
    """YaRN's frequencies, as transformers' _compute_yarn_parameters: interpolated (divided by factor) below
    the correction range, kept above it, blended linearly across it."""
    pos_freqs = (np.float32(rope.theta) ** exponents).astype(np.float32)
    extrapolated = (np.float32(1.0) / pos_freqs).astype(np.float32)
    interpolated = (np.float32(1.0) / (np.float32(rope.factor) * pos_freqs)).astype(np.float32)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
            2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    keep = (np.float32(1) - ramp.astype(np.float32)).astype(np.float32)
    return (interpolated * (np.float32(1) - keep) + extrapolated * keep).astype(np.float32)
