"""The packed token mask both tiers apply: int32 [B, ceil(V / 32)], bit i of word w allows token 32w + i.

An unconstrained row is all ones (-1), so a batch keeps one static shape whichever rows are constrained;
the tiers unpack it on the device (prefill/sampler.py, decode/sampler.py)."""

from __future__ import annotations

import numpy as np

ALL = -1
"""A word that allows all its 32 tokens."""


def words(vocab_size: int) -> int:
    """int32 words per row for a vocabulary (the logits' width) of vocab_size."""
    return (vocab_size + 31) // 32


def unconstrained(rows: int, vocab_size: int) -> np.ndarray:
    """int32 [rows, words]: every token allowed in every row."""
    return np.full((rows, words(vocab_size)), ALL, np.int32)


def clear_from(row: np.ndarray, first: int) -> None:
    """Disallows tokens [first, 32 * len(row)) in the int32 row (ids past the tokenizer: the model's padding)."""
    word, bit = divmod(first, 32)
    if word < len(row):
        row[word] &= np.int32(np.uint32((1 << bit) - 1).view(np.int32) if bit else 0)
        row[word + 1 :] = 0


def allowed_ids(row: np.ndarray, vocab_size: int) -> list[int]:
    """The token ids an int32 row allows, below vocab_size."""
    bits = np.unpackbits(np.ascontiguousarray(row, np.int32).view(np.uint8), bitorder="little")
    return np.nonzero(bits[:vocab_size])[0].tolist()
