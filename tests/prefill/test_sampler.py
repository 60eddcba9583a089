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


def _draw_min_p(logits, n: int, min_p: float) -> np.ndarray:
    rows = jnp.tile(jnp.asarray(logits, jnp.float32)[None], (n, 1))
    full = lambda x, dt: jnp.full((n,), x, dt)  # noqa: E731
    return np.asarray(sample_jit(rows, full(1.0, jnp.float32), full(0, jnp.int32), full(1.0, jnp.float32),
                                 full(3, jnp.uint32), jnp.arange(n, dtype=jnp.int32), full(min_p, jnp.float32)))


def test_min_p_keeps_only_tokens_above_min_p_times_the_top_probability():
    probs = np.array([0.4, 0.3, 0.2, 0.09, 0.01])  # min_p 0.6: 0.2 and below fall (< 0.6 x 0.4)
    drawn = set(_draw_min_p(np.log(probs), 300, 0.6).tolist())
    assert drawn == {0, 1}
    assert set(_draw_min_p(np.log(probs), 300, 0.0).tolist()) >= {0, 1, 2, 3}


PENALTY_CASE = dict(
    logits=np.array([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0], [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]], np.float32),  # [B, V]
    tokens=np.array([[0, 1, 3, 3, 0, 0], [2, 5, 5, 0, 0, 0]], np.int32),  # [B, S], right-padded
    lengths=np.array([4, 3], np.int32), num_outputs=np.array([2, 2], np.int32),  # outputs: [3, 3] and [5, 5]
    presence=np.array([0.5, 0.0], np.float32), frequency=np.array([0.25, 1.0], np.float32),
    repetition=np.array([2.0, 1.0], np.float32),
    blocked=np.array([[False] * 5 + [True], [False] * 6]),
)
# Row 0: repetition 2 over prompt {0, 1} + outputs {3}: 2 -> 1, -1 -> -2, 3 -> 1.5; then token 3 (twice out):
# 1.5 - 0.25 x 2 - 0.5 = 0.5; token 5 blocked. Row 1: frequency 1 x 2 on token 5.
PENALIZED = np.array([[1.0, -2.0, 0.5, 0.5, -2.0, -np.inf], [1.0, 1.0, 1.0, 1.0, 1.0, -1.0]], np.float32)


def test_penalties_are_vllms_and_both_tiers_apply_them_alike():
    import torch

    from pdserve.server.decode.sampler import apply_penalties
    from pdserve.server.prefill.sampler import penalize

    c = PENALTY_CASE
    got = np.asarray(penalize(*(jnp.asarray(c[k]) for k in ("logits", "tokens", "lengths", "num_outputs",
                                                             "presence", "frequency", "repetition", "blocked"))))
    np.testing.assert_array_equal(got, PENALIZED)
    prompts = [c["tokens"][b, : c["lengths"][b] - c["num_outputs"][b]].tolist() for b in range(2)]
    outputs = [c["tokens"][b, c["lengths"][b] - c["num_outputs"][b] : c["lengths"][b]].tolist() for b in range(2)]
    blocked = [np.flatnonzero(row).tolist() for row in c["blocked"]]
    torch_got = apply_penalties(torch.tensor(c["logits"]), prompts, outputs, c["presence"].tolist(),
                                c["frequency"].tolist(), c["repetition"].tolist(), blocked)
    np.testing.assert_array_equal(torch_got.numpy(), PENALIZED)
