"""Attention on the host (torch's flash attention, called from C++ through onednn_native.py's FFI target, or from
Python through host_call.py's where that library is not built) computes attention.py's rule for every case the
prefill passes it: one causal prompt, packed prompts with padding, context keys before the new ones, a sliding window
that cuts, GQA, several rows; a soft-capped model keeps XLA's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pdserve.server.prefill import onednn_native
from pdserve.server.prefill.attention import attention, blockwise_attention, reference_attention
from pdserve.server.prefill.host_attention import host_attention


@pytest.fixture(autouse=True, params=["native", "python"])
def path(request, monkeypatch):
    """Each case on both paths: the C++ one (the library built here) and the Python one (as where it is not)."""
    if request.param == "native":
        assert isinstance(onednn_native.load(), onednn_native.Native), onednn_native.load()
    else:
        monkeypatch.setattr(onednn_native, "load", lambda: "as where the library is not built")
    return request.param


def _qkv(b: int, s: int, k: int, hq: int = 4, hkv: int = 2, d: int = 16, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for shape in
            ((b, s, hq, d), (b, k, hkv, d), (b, k, hkv, d))]


def _check(q, k, v, q_pos, q_seg, k_pos, k_seg, window=None):
    args = [jnp.asarray(a, jnp.int32) for a in (q_pos, q_seg, k_pos, k_seg)]
    got = np.asarray(jax.jit(lambda q, k, v: host_attention(q, k, v, *args, window))(q, k, v), np.float32)
    want = np.asarray(reference_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                                          *args, window), np.float32)
    real = np.asarray(q_seg) >= 0  # [B, S]
    np.testing.assert_allclose(got[real], want[real], atol=2e-2)  # bf16 output, fp32 accumulation
    assert not got[~real].any()  # padding queries read nothing here: zeros
    return got


def test_one_causal_prompt():
    q, k, v = _qkv(1, 40, 40)
    pos = np.arange(40)[None]
    _check(q, k, v, pos, np.zeros((1, 40)), pos, np.zeros((1, 40)))


def test_packed_prompts_with_padding_in_two_rows():
    # row 0: prompts of 5, 9 and 3 tokens, then 7 padding slots; row 1: one prompt of 12 tokens, 12 padding
    seg = np.array([[0] * 5 + [1] * 9 + [2] * 3 + [-1] * 7, [0] * 12 + [-1] * 12])
    pos = np.array([[*range(5), *range(9), *range(3), *[0] * 7], [*range(12), *[0] * 12]])
    q, k, v = _qkv(2, 24, 24, seed=1)
    _check(q, k, v, pos, seg, pos, seg)


def test_context_keys_before_the_chunk_and_a_packed_prompt_beside_it():
    # context: 20 cached keys of prompt 0 (positions 0..19) then 4 padding; new: prompt 0's next 6 tokens
    # (positions 20..25) and prompt 1's 5 first ones
    c_seg, c_pos = np.array([[0] * 20 + [-2] * 4]), np.array([[*range(20), *[0] * 4]])
    q_seg, q_pos = np.array([[0] * 6 + [1] * 5 + [-1]]), np.array([[*range(20, 26), *range(5), 0]])
    q, k, v = _qkv(1, 12, 36, hq=6, hkv=2, seed=2)
    _check(q, k, v, q_pos, q_seg, np.concatenate([c_pos, q_pos], 1), np.concatenate([c_seg, q_seg], 1))


@pytest.mark.parametrize("window", [4, 1, 2**30])
def test_a_sliding_window_with_and_without_context(window):
    pos = np.arange(30)[None]
    q, k, v = _qkv(1, 30, 30, seed=3)
    _check(q, k, v, pos, np.zeros((1, 30)), pos, np.zeros((1, 30)), jnp.int32(window))
    c_pos, q_pos = np.arange(18)[None], np.arange(18, 30)[None]
    q, k, v = _qkv(1, 12, 30, seed=4)
    _check(q, k, v, q_pos, np.zeros((1, 12)), np.concatenate([c_pos, q_pos], 1), np.zeros((1, 30)), jnp.int32(window))


def test_many_queries_with_context_pass_the_mask_in_chunks(monkeypatch):
    from pdserve.server.prefill import host_attention as module

    monkeypatch.setattr(module, "MASK_QUERIES", 8)  # 20 queries: chunks of 8, 8 and 4
    c_pos, q_pos = np.arange(10)[None], np.arange(10, 30)[None]
    q, k, v = _qkv(1, 20, 30, seed=5)
    _check(q, k, v, q_pos, np.zeros((1, 20)), np.concatenate([c_pos, q_pos], 1), np.zeros((1, 30)), jnp.int32(6))


def test_a_soft_capped_model_and_fp32_keep_xlas_attention():
    q, k, v = _qkv(1, 16, 16, seed=6)
    pos, seg = jnp.arange(16, dtype=jnp.int32)[None], jnp.zeros((1, 16), jnp.int32)
    capped = host_attention(q, k, v, pos, seg, pos, seg, softcap=5.0)
    assert np.array_equal(np.asarray(capped), np.asarray(attention(q, k, v, pos, seg, pos, seg, softcap=5.0)))
    q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))
    assert np.array_equal(np.asarray(host_attention(q32, k32, v32, pos, seg, pos, seg)),
                          np.asarray(blockwise_attention(q32, k32, v32, pos, seg, pos, seg)))
