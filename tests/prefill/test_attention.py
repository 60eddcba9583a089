"""Blockwise and Pallas (interpret mode) attention against the whole-matrix reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pdserve.server.prefill.attention import (blockwise_attention, pallas_attention, reference_attention,
                                              scheduled_attention)


def _packed(seed: int, lengths: list[int], contexts: list[int], total: int, hq: int = 4, hkv: int = 2, d: int = 16):
    """Prompts packed in one row: each segment's context keys first (earlier positions), then its queries."""
    rng = np.random.default_rng(seed)
    q_pos, q_seg, k_pos, k_seg = [], [], [], []
    for i, (n, c) in enumerate(zip(lengths, contexts)):
        q_pos += range(c, c + n)
        q_seg += [i] * n
        k_pos += range(c)
        k_seg += [i] * c
    k_pos += q_pos  # the keys: every context, then the queries' own
    k_seg += q_seg
    s = total
    pad = s - len(q_pos)
    q_pos, q_seg = q_pos + [0] * pad, q_seg + [-1] * pad
    k_pos, k_seg = k_pos + [0] * pad, k_seg + [-1] * pad
    kk = len(k_pos)
    q = rng.standard_normal((1, s, hq, d), dtype=np.float32)
    k = rng.standard_normal((1, kk, hkv, d), dtype=np.float32)
    v = rng.standard_normal((1, kk, hkv, d), dtype=np.float32)
    ints = [np.asarray([a], np.int32) for a in (q_pos, q_seg, k_pos, k_seg)]
    return q, k, v, *ints, s - pad


CASES = {
    "one prompt": ([37], [0], 48),
    "packed mixed lengths": ([5, 40, 1, 17], [0, 0, 0, 0], 80),
    "chunk after context": ([24], [40], 32),
    "packed with contexts": ([8, 16, 3], [32, 0, 16], 32),
}


@pytest.mark.parametrize("case", CASES)
def test_blockwise_equals_reference(case):
    lengths, contexts, total = CASES[case]
    q, k, v, qp, qs, kp, ks, real = _packed(1, lengths, contexts, total)
    want = np.asarray(reference_attention(q, k, v, qp, qs, kp, ks))
    got = np.asarray(blockwise_attention(q, k, v, qp, qs, kp, ks, block_q=16, block_k=8))
    np.testing.assert_allclose(got[:, :real], want[:, :real], rtol=1e-5, atol=1e-5)
    assert np.isfinite(got).all()  # padding queries read nothing: zeros, not NaN


@pytest.mark.parametrize("case", CASES)
def test_pallas_interpret_equals_reference(case):
    lengths, contexts, total = CASES[case]
    q, k, v, qp, qs, kp, ks, real = _packed(2, lengths, contexts, total)
    want = np.asarray(reference_attention(q, k, v, qp, qs, kp, ks))
    got = np.asarray(pallas_attention(q, k, v, qp, qs, kp, ks, block_q=16, block_k=8, interpret=True))
    np.testing.assert_allclose(got[:, :real], want[:, :real], rtol=1e-5, atol=1e-5)


def test_reference_is_plain_causal_softmax():
    """The reference itself, on one unpacked prompt, against softmax written out by hand."""
    q, k, v, qp, qs, kp, ks, real = _packed(3, [9], [0], 9, hq=2, hkv=2, d=8)
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(8)
    scores = np.where(np.tril(np.ones((9, 9), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    want = np.einsum("bhqk,bkhd->bqhd", probs, v)
    np.testing.assert_allclose(np.asarray(reference_attention(q, k, v, qp, qs, kp, ks)), want, rtol=1e-5, atol=1e-6)


def test_blockwise_memory_is_linear_in_length():
    """No [S, S] buffer: the compiled blockwise attention's temporaries stay far below S*S floats."""
    s, hq, d = 4096, 2, 16
    args = (jnp.zeros((1, s, hq, d)), jnp.zeros((1, s, hq, d)), jnp.zeros((1, s, hq, d)),
            *(jnp.zeros((1, s), jnp.int32),) * 4)
    compiled = jax.jit(blockwise_attention).lower(*args).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < s * s * 4 // 8, f"{temp} bytes of temporaries for {s} tokens: an S x S buffer is back"


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("window", [1, 7, 24])
def test_windowed_kernels_equal_the_windowed_reference(case, window):
    """A sliding window W: each kernel reads only keys p - W < j <= p, a chunk's context included."""
    lengths, contexts, total = CASES[case]
    q, k, v, qp, qs, kp, ks, real = _packed(3, lengths, contexts, total)
    w = jnp.int32(window)
    want = np.asarray(reference_attention(q, k, v, qp, qs, kp, ks, w))
    got = {
        "blockwise": blockwise_attention(q, k, v, qp, qs, kp, ks, w, block_q=16, block_k=8),
        "scheduled": scheduled_attention(q, k, v, qp, qs, kp, ks, w, own_keys_from=k.shape[1] - q.shape[1],
                                         block_q=16, block_k=8),
        "pallas": pallas_attention(q, k, v, qp, qs, kp, ks, w, block_q=16, block_k=8, interpret=True),
    }
    for name, out in got.items():
        np.testing.assert_allclose(np.asarray(out)[:, :real], want[:, :real], rtol=1e-5, atol=1e-5, err_msg=name)


def test_the_window_masks_what_full_attention_reads():
    """The windowed reference by hand: a one-token window is each query's own value; a window longer than
    the prompt is full attention."""
    q, k, v, qp, qs, kp, ks, real = _packed(4, [20], [0], 20)
    own = np.asarray(reference_attention(q, k, v, qp, qs, kp, ks, jnp.int32(1)))  # [1, S, Hq, D]
    np.testing.assert_allclose(own[0], np.repeat(v[0], 2, axis=1), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(reference_attention(q, k, v, qp, qs, kp, ks, jnp.int32(20))),
                               np.asarray(reference_attention(q, k, v, qp, qs, kp, ks)), rtol=1e-6)
    assert not np.allclose(np.asarray(reference_attention(q, k, v, qp, qs, kp, ks, jnp.int32(19))),
                           np.asarray(reference_attention(q, k, v, qp, qs, kp, ks)))
