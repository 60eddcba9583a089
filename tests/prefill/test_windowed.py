"""Sliding-window models on the prefill tier against transformers (a windowed Mistral; Gemma 2 and 3, whose
local and global layers alternate): prompts shorter and longer than the window, whole and in chunks that read
the earlier chunks' KV."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from pdserve.server.model.config import load_config
from pdserve.server.model.tiny import WINDOW
from pdserve.server.model.weights import load_weights
from pdserve.server.prefill.model import Packing, embed, forward_logits, head, layer_group, load_params

TOL = 1e-4


@pytest.fixture(scope="module", params=["mistral-windowed", "gemma2", "gemma3"])
def windowed(request, tiny_model):
    path = tiny_model(request.param)
    config = load_config(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return config, load_params(config, load_weights(path)), hf


def _hf_logits(hf, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor(ids[None], dtype=torch.long)).logits[0].numpy()  # [S, V]


@pytest.mark.parametrize("n", [WINDOW - 3, WINDOW + 1, 3 * WINDOW + 5])
def test_logits_match_transformers_within_and_past_the_window(windowed, n):
    config, params, hf = windowed
    assert set(config.layer_windows) <= {WINDOW, None} and config.sliding_window == WINDOW
    ids = np.random.default_rng(n).integers(0, config.vocab_size, n, dtype=np.int32)
    got = np.asarray(forward_logits(params, jnp.asarray(ids[None]), config=config))[0]
    assert np.abs(got - _hf_logits(hf, ids)).max() < TOL


def test_a_chunk_reads_only_the_window_of_the_chunks_before_it(windowed):
    """A 90-token prompt in chunks of 30: each chunk attends its context (the earlier chunks' KV) through
    the window; the last token's logits equal transformers' on the whole prompt."""
    config, params, hf = windowed
    ids = np.random.default_rng(7).integers(0, config.vocab_size, 90, dtype=np.int32)
    want = _hf_logits(hf, ids)
    ks, vs = [], []
    for start in range(0, 90, 30):
        chunk = jnp.asarray(ids[None, start : start + 30])
        positions = jnp.arange(start, start + 30, dtype=jnp.int32)[None]
        packing = Packing(positions, jnp.zeros((1, 30), jnp.int32), jnp.arange(start, dtype=jnp.int32)[None],
                          jnp.zeros((1, start), jnp.int32))
        shape = (config.num_layers, 1, 0, config.num_kv_heads, config.head_dim)
        ck = jnp.concatenate(ks, axis=2) if ks else jnp.zeros(shape)
        cv = jnp.concatenate(vs, axis=2) if vs else jnp.zeros(shape)
        x, cos, sin = embed(params, chunk, positions, config=config)
        x, k, v = layer_group(params["layers"], x, cos, sin, packing, ck, cv, config=config)
        ks.append(k)
        vs.append(v)
        logits = np.asarray(head(params, x, jnp.arange(30, dtype=jnp.int32), config=config))  # [30, V]
        assert np.abs(logits - want[start : start + 30]).max() < TOL
