"""The on-device sampler: greedy, top-k, top-p, temperature, and reproducibility by (seed, index)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from pdserve.server.prefill.sampler import sample_jit


def _draw(logits, n: int, temperature=1.0, top_k=0, top_p=1.0, seed=7, index=None) -> np.ndarray:
    """n draws of one row of logits [V], each with its own index (0..n-1 by default) -> int32[n]."""
    rows = jnp.tile(jnp.asarray(logits, jnp.float32)[None], (n, 1))  # [n, V]
    full = lambda x, dt: jnp.full((n,), x, dt)  # noqa: E731
    index = jnp.arange(n, dtype=jnp.int32) if index is None else jnp.asarray(index, jnp.int32)
    out = sample_jit(
        rows,
        full(temperature, jnp.float32),
        full(top_k, jnp.int32),
        full(top_p, jnp.float32),
        full(seed, jnp.uint32),
        index,
    )
    assert out.dtype == jnp.int32 and out.shape == (n,)
    return np.asarray(out)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def test_greedy_is_argmax():
    logits = np.random.default_rng(0).normal(size=(8, 50)).astype(np.float32)  # [B, V]
    zeros = jnp.zeros(8)
    out = sample_jit(
        jnp.asarray(logits), zeros, zeros.astype(jnp.int32), jnp.ones(8),
        jnp.arange(8, dtype=jnp.uint32), jnp.arange(8, dtype=jnp.int32),
    )  # fmt: skip
    assert np.asarray(out).tolist() == logits.argmax(-1).tolist()


def test_top_k_one_is_argmax_at_temperature_one():
    logits = np.random.default_rng(1).normal(size=50)
    assert set(_draw(logits, 64, top_k=1).tolist()) == {int(logits.argmax())}


def test_tiny_top_p_is_argmax():
    logits = np.random.default_rng(2).normal(size=50)
    assert set(_draw(logits, 64, top_p=1e-6).tolist()) == {int(logits.argmax())}


def test_same_seed_and_index_give_the_same_token_in_any_batch():
    logits = np.zeros(64)  # uniform: every token as likely
    first = _draw(logits, 200)
    again = _draw(logits, 200)
    reversed_batch = _draw(logits, 200, index=np.arange(200)[::-1])[::-1]
    assert first.tolist() == again.tolist() == reversed_batch.tolist()
    assert len(set(first.tolist())) > 40  # different indices draw different tokens
    assert _draw(logits, 200, seed=8).tolist() != first.tolist()
    assert len(set(_draw(logits, 50, index=np.full(50, 3)).tolist())) == 1


def test_empirical_distribution_matches_softmax():
    logits = np.array([1.0, 0.5, -0.5, 2.0])
    for temperature in (1.0, 0.5):
        draws = _draw(logits, 4000, temperature=temperature)
        freq = np.bincount(draws, minlength=4) / 4000
        assert np.abs(freq - _softmax(logits / temperature)).max() < 0.03


def test_top_k_and_top_p_keep_only_the_head():
    probs = np.array([0.05, 0.5, 0.15, 0.3])
    logits = np.log(probs)
    top2 = np.bincount(_draw(logits, 4000, top_k=2), minlength=4) / 4000
    assert top2[0] == top2[2] == 0
    assert abs(top2[1] - 0.5 / 0.8) < 0.03
    # top_p 0.7: token 1 (0.5) is in; token 3 starts at 0.5 < 0.7 so is in; token 2 starts at 0.8: out.
    nucleus = np.bincount(_draw(logits, 4000, top_p=0.7), minlength=4) / 4000
    assert nucleus[0] == nucleus[2] == 0
    assert abs(nucleus[1] - 0.5 / 0.8) < 0.03
