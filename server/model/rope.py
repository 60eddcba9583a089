"""Rotary embedding frequencies, computed as transformers computes them (fp32)."""

from __future__ import annotations

import math

import numpy as np

from pdserve.server.model.config import ModelConfig, RopeConfig


def inv_freq(config: ModelConfig, rope: RopeConfig | None = None) -> np.ndarray:
    """[head_dim // 2] float32 inverse frequencies of `rope` (by default the model's), with linear or llama3
    scaling when configured."""
    dim = config.head_dim
    rope = config.rope if rope is None else rope
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    freqs = (np.float32(1.0) / (np.float32(rope.theta) ** exponents)).astype(np.float32)
    if rope.kind == "default":
        return freqs
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
