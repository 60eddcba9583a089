"""The uniform number a sampled token draws, one rule for both tiers: a seeded request gives the same tokens
whichever tier samples each one (the prefill tier samples the first token, and a migrated request's first
after the migration; the decode tier the rest), on any worker, device and batch.

u(seed, index) = (mix(mix(fold(seed)) ^ index) >> 8) / 2^24, in [0, 1) and exact in float32, where fold
xors a 64-bit seed's halves and mix is the lowbias32 integer hash (Chris Wellons), all in uint32 arithmetic:
the prefill tier computes it inside its jitted sampler (`prefill/sampler.py`), the decode tier on the host
(here). Each tier then picks by the inverse CDF in the same order, only ever a token of positive
probability (`decode/sampler.pick`, `prefill/sampler._pick`), from logits scaled alike (times the
temperature's reciprocal).
"""

from __future__ import annotations

MASK32 = 0xFFFFFFFF


def fold(seed: int) -> int:
    """A request's 64-bit seed as the uint32 the samplers hash."""
    seed &= 2**64 - 1
    return (seed ^ (seed >> 32)) & MASK32


def mix(x: int) -> int:
    """lowbias32: a uint32 -> uint32 hash whose every output bit depends on every input bit."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def uniform(seed: int, index: int) -> float:
    """The draw of output token `index` of a request seeded with `seed`."""
    return (mix(mix(fold(seed)) ^ (index & MASK32)) >> 8) * 2.0**-24
