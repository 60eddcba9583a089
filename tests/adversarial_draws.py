"""Adversarial masks, settings and seeds for the samplers' zero-forbidden-draws tests (both tiers, the verifier).

A draw is one uniform number u = b / 2^24 (b: 24 bits, `server/seeded.py`) and a pick by the inverse CDF, so
the only u that can go wrong are those next to a boundary of the CDF, where rounding decides. `boundary_bits`
lists every b within a few grid steps of every boundary (as float64 and as a sequential float32 sum put them:
a parallel scan's sums wiggle around those), and `seed_for` inverts the seeded hash, so each such b is a seed
a client could send: the tests need not find bad seeds by luck.

`reference` is the law a row is drawn from, computed in float64 apart from the samplers, for the boundaries
and for the chi-square tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MASK32 = 0xFFFFFFFF
GRID = 2**24  # the uniform numbers' grid: u = b / GRID


def _unmix(x: int) -> int:
    """The inverse of `seeded.mix` (lowbias32): each step undone in reverse."""
    x ^= x >> 16
    x = (x * pow(0x846CA68B, -1, 2**32)) & MASK32
    x ^= (x >> 15) ^ (x >> 30)
    x = (x * pow(0x7FEB352D, -1, 2**32)) & MASK32
    return x ^ (x >> 16)


def seed_for(bits: int, index: int) -> int:
    """A seed (< 2^32, so `seeded.fold` keeps it) whose draw for output token `index` is u = bits / 2^24."""
    return _unmix(_unmix((bits % GRID) << 8) ^ (index & MASK32))


_INVERSES = np.uint32(pow(0x846CA68B, -1, 2**32)), np.uint32(pow(0x7FEB352D, -1, 2**32))


def _unmix_array(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint32(16))
    x = x * _INVERSES[0]  # uint32 products wrap, as the hash's do
    x = x ^ (x >> np.uint32(15)) ^ (x >> np.uint32(30))
    x = x * _INVERSES[1]
    return x ^ (x >> np.uint32(16))


def seeds_for(bits: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """`seed_for` over arrays: uint32 [N] seeds from bits [N] and output-token indices [N]."""
    bits = (np.asarray(bits, np.uint64) % GRID).astype(np.uint32) << np.uint32(8)
    return _unmix_array(_unmix_array(bits) ^ np.asarray(indices, np.int64).astype(np.uint32))


@dataclass(frozen=True)
class Row:
    """One adversarial row: raw logits f32 [V] (forbidden tokens often far above the allowed ones before the
    mask), the grammar's allowed ids bool [V]."""

    name: str
    logits: np.ndarray
    allowed: np.ndarray

    def packed(self) -> np.ndarray:
        """The mask as the tiers take it: int32 [ceil(V / 32)], bit i of word w allows token 32w + i."""
        words = (len(self.allowed) + 31) // 32
        bits = np.zeros(words * 32, np.uint8)
        bits[: len(self.allowed)] = self.allowed
        return np.packbits(bits.reshape(words, 32), axis=1, bitorder="little").view(np.int32).reshape(words)


def rows(vocab: int, seed: int = 0) -> list[Row]:
    """The adversarial masks over a vocabulary of `vocab` ids (>= 64)."""
    rng = np.random.default_rng(seed)
    V = vocab
    ids = np.arange(V)
    out: list[Row] = []

    def add(name: str, logits, allowed) -> None:
        out.append(Row(name, np.asarray(logits, np.float32), np.asarray(allowed, bool)))

    for at in (0, V // 2 + 3, V - 1):  # one allowed token among many, the others far more likely
        add(f"one allowed at {at}", np.where(ids == at, -5.0, 60.0 + rng.normal(size=V)), ids == at)
    tiny = rng.uniform(-30.0, -17.0, V)  # p ~ 1e-13..4e-8: under the grid's 6e-8, beside huge forbidden logits
    tiny[V // 3] = 0.0
    add("tiny allowed among huge forbidden", np.where(ids % 3 == 0, tiny, 80.0), ids % 3 == 0)
    ends = (ids < 2) | (ids >= V - 2)
    add("only the ends allowed", np.where(ends, 0.0, 40.0), ends)
    add("the ends forbidden", rng.normal(size=V) * 2 + np.where((ids < V // 4) | (ids >= 3 * V // 4), 50.0, 0.0),
        (ids >= V // 4) & (ids < 3 * V // 4))
    add("last allowed, huge forbidden after", np.where(ids >= V - 8, 90.0, rng.normal(size=V)), ids < V - 8)
    add("ties", np.ones(V), rng.random(V) < 0.5)
    near = np.float32(3.0) + np.float32(np.spacing(np.float32(3.0))) * rng.integers(-2, 3, V).astype(np.float32)
    add("near ties", near, rng.random(V) < 0.5)
    add("random half, wide", rng.normal(size=V) * 5, rng.random(V) < 0.5)
    add("alternating", rng.normal(size=V) * 3, ids % 2 == 0)
    add("sparse, wide", rng.normal(size=V) * 8, rng.random(V) < 0.02)
    add("dense", rng.normal(size=V), rng.random(V) < 0.95)
    return out


@dataclass(frozen=True)
class Settings:
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def ranked(self, vocab: int) -> bool:
        """Whether the sampler walks the sorted order (top-k or top-p on) rather than the vocabulary's."""
        return 0 < self.top_k < vocab or self.top_p < 1.0


SETTINGS = (
    Settings(),  # the path of the old cumsum bug: the vocabulary in id order
    Settings(temperature=0.7, min_p=0.05),
    Settings(temperature=1.5),
    Settings(top_k=40),
    Settings(top_p=0.9),
    Settings(temperature=1.2, top_k=200, top_p=0.95, min_p=0.01),
)


def reference(row: Row, s: Settings) -> tuple[np.ndarray, np.ndarray]:
    """The law a sampled row is drawn from, in float64, in the order the sampler walks: (order int [V] token
    ids, probs f64 [V] in that order, 0 for the masked and filtered). The samplers' rules: the mask,
    temperature, then top-k and min-p, then top-p over the renormalised rest."""
    V = len(row.logits)
    scaled = np.where(row.allowed, row.logits.astype(np.float64), -np.inf) / s.temperature
    order = np.argsort(-scaled, kind="stable") if s.ranked(V) else np.arange(V)
    walked = scaled[order]
    if s.ranked(V) and s.top_k > 0:
        walked = np.where(np.arange(V) < s.top_k, walked, -np.inf)
    if s.min_p > 0:
        walked = np.where(walked < walked.max() + np.log(s.min_p), -np.inf, walked)
    probs = np.exp(walked - walked.max())
    probs /= probs.sum()
    if s.ranked(V):
        probs = np.where(np.cumsum(probs) - probs > s.top_p, 0.0, probs)
        probs /= probs.sum()
    return order, probs


def boundary_bits(probs: np.ndarray, reach: int = 4) -> np.ndarray:
    """Every b in [0, 2^24) within `reach` grid steps of a boundary of the CDF of probs [V] (in walk order) as
    float64 and as a sequential float32 sum place it, and the grid's ends: uint32 [N], sorted, distinct."""
    centres = []
    for cdf in (np.cumsum(probs), np.cumsum(probs.astype(np.float32))):
        centres.append(np.floor(cdf / cdf[-1] * GRID).astype(np.int64))
    centres = np.unique(np.concatenate(centres))
    near = (centres[:, None] + np.arange(-reach, reach + 1)).reshape(-1)
    near = np.concatenate([near, np.arange(reach + 1), GRID - 1 - np.arange(reach + 1)])
    return np.unique(near[(near >= 0) & (near < GRID)]).astype(np.uint32)


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """The p-value of counts [V] drawn from probs [V] (tokens of probability 0 must have count 0, checked by the
    callers); cells expected under 5 pooled into one."""
    from scipy.stats import chisquare

    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)
