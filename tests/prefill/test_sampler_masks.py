"""The prefill tier's sampler never draws a token its grammar masks (issue 38): adversarial masks, settings and
seeds (`tests/adversarial_draws.py`), about a million draws of the pick and ~100k of the whole jitted sampler.

XLA's cumsum is a parallel scan whose sums need not rise where a probability is 0, so the binary search the
sampler used to make landed on masked tokens; the first test keeps that rule to show these seeds find it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pdserve.server.prefill.sampler import _pick, _uniform, sample_jit
from tests.adversarial_draws import (GRID, SETTINGS, Row, Settings, boundary_bits, chi_square_p, reference, rows,
                                    seeds_for)

CHUNK = 8192  # draws per call: one shape, one compile


def _old_pick(probs: jax.Array, u) -> jax.Array:
    """The rule before issue 38: a binary search of the cumulative sums, clamped to the last kept token."""
    cdf = jnp.cumsum(probs)
    last_kept = jnp.max(jnp.where(probs > 0, jnp.arange(probs.shape[-1]), 0))
    return jnp.minimum(jnp.searchsorted(cdf, u * cdf[-1], side="right"), last_kept)


def _picks(rule, probs: jax.Array, bits: np.ndarray) -> np.ndarray:
    """rule(probs [V], u) for each u = the seeded draw of seeds made to give bits [N] (random indices) -> [N]."""
    run = jax.jit(jax.vmap(lambda p, s, i: rule(p, _uniform(s, i)), (None, 0, 0)))
    indices = np.random.default_rng(len(bits)).integers(0, 2**31, len(bits))
    seeds = seeds_for(bits, indices)
    out = []
    for start in range(0, len(bits), CHUNK):
        s, i = seeds[start : start + CHUNK], indices[start : start + CHUNK]
        pad = CHUNK - len(s)
        got = run(probs, jnp.asarray(np.pad(s, (0, pad))), jnp.asarray(np.pad(i, (0, pad)), jnp.int32))
        out.append(np.asarray(got)[: len(s)])
    return np.concatenate(out)


def _vocab_order_probs(row) -> jax.Array:
    """What the sampler picks from without top-k/top-p at temperature 1: the softmax over the allowed."""
    return jax.nn.softmax(jnp.where(jnp.asarray(row.allowed), jnp.asarray(row.logits), -jnp.inf))


def test_the_old_cumsum_rule_draws_masked_tokens_at_these_seeds():
    forbidden = 0
    for row in rows(1024):
        bits = boundary_bits(reference(row, Settings())[1], reach=8)
        forbidden += int((~row.allowed[_picks(_old_pick, _vocab_order_probs(row), bits)]).sum())
    assert forbidden > 0  # the harness finds the old bug (12 of ~94k draws here)


def test_the_pick_never_lands_on_a_masked_token_over_a_million_seeds():
    draws = 0
    rng = np.random.default_rng(0)
    for row in rows(1024, seed=4):
        probs = _vocab_order_probs(row)
        bits = np.unique(np.concatenate([boundary_bits(reference(row, Settings())[1], reach=128),
                                         rng.integers(0, GRID, 16384).astype(np.uint32)]))
        picked = _picks(_pick, probs, bits)
        assert row.allowed[picked].all(), (row.name, np.flatnonzero(~row.allowed[picked])[:5])
        assert (np.asarray(probs)[picked] > 0).all(), row.name
        draws += len(bits)
    assert draws > 1_000_000


def _sample(table: list, which: np.ndarray, settings: list[Settings], seeds: np.ndarray, indices: np.ndarray
            ) -> np.ndarray:
    """sample_jit over draws of the rows in `table`: draw n takes table[which[n]] (logits and mask) with
    settings[n] and (seeds[n], indices[n]) -> tokens [N]."""
    V = len(table[0].logits)
    logits = jnp.asarray(np.stack([r.logits for r in table]))  # [T, V]
    masks = jnp.asarray(np.stack([r.packed() for r in table]))  # [T, W]
    column = lambda f, dt: np.array([f(s) for s in settings], dt)
    columns = (column(lambda s: s.temperature, np.float32), column(lambda s: min(s.top_k, V), np.int32),
               column(lambda s: s.top_p, np.float32), np.asarray(seeds, np.uint32), np.asarray(indices, np.int32),
               column(lambda s: s.min_p, np.float32))
    out = []
    for start in range(0, len(which), CHUNK):
        n = min(CHUNK, len(which) - start)
        part = jnp.asarray(np.pad(which[start : start + n], (0, CHUNK - n)))
        cols = [jnp.asarray(np.pad(c[start : start + n], (0, CHUNK - n), constant_values=c[0])) for c in columns]
        out.append(np.asarray(sample_jit(logits[part], *cols, masks[part]))[:n])
    return np.concatenate(out)


def test_the_sampler_never_draws_a_masked_token_at_adversarial_seeds_and_settings():
    """Every mask, every settings path (vocabulary order, min-p, temperature, top-k, top-p, all four), seeds
    at every boundary of the row's law and random ones, all in one stream of draws."""
    rng = np.random.default_rng(1)
    table = rows(512, seed=3)
    which, settings, bits = [], [], []
    for t, row in enumerate(table):
        for s in SETTINGS:
            b = np.unique(np.concatenate([boundary_bits(reference(row, s)[1], reach=1),
                                          rng.integers(0, GRID, 256).astype(np.uint32)]))
            which.append(np.full(len(b), t))
            settings += [s] * len(b)
            bits.append(b)
    which, bits = np.concatenate(which), np.concatenate(bits)
    indices = rng.integers(0, 2**31, len(bits))
    tokens = _sample(table, which, settings, seeds_for(bits, indices), indices)
    allowed = np.stack([r.allowed for r in table])[which, tokens]  # [N]
    bad = np.flatnonzero(~allowed)
    assert len(bad) == 0, [(table[which[n]].name, settings[n], tokens[n]) for n in bad[:5]]
    assert len(tokens) > 50_000


def test_masked_draws_follow_the_law_over_the_allowed_tokens():
    """Chi-square of 40,000 seeded draws against the float64 law (the mask, temperature and filters)."""
    rng = np.random.default_rng(2)
    V = 64
    ids = np.arange(V)
    row = Row("mild", (rng.normal(size=V) * 1.5).astype(np.float32), (ids % 3 != 1) & (ids != 0))
    for s in (Settings(), Settings(temperature=0.8, min_p=0.05), Settings(top_k=12, top_p=0.9)):
        order, probs = reference(row, s)
        law = np.zeros(V)
        law[order] = probs
        indices = rng.integers(0, 2**31, 40_000)
        seeds = rng.integers(0, 2**32, 40_000, dtype=np.uint64).astype(np.uint32)
        counts = np.bincount(_sample([row], np.zeros(len(seeds), int), [s] * len(seeds), seeds, indices),
                             minlength=V)
        assert counts[law == 0].sum() == 0
        assert chi_square_p(counts, law) > 1e-3, (s, counts, law)
