"""The JAX prefill tier's loader on an fp8 block-scaled Llama checkpoint (DeepSeek-V3's format on another family):
its params are exactly those of the dequantized float32 twin."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from pdserve.server.model.config import load_config
from pdserve.server.model.weights import load_weights
from pdserve.server.prefill.model import load_params


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_fp8_llama_loads_as_its_dequantized_twin(tiny_fp8_pair, dtype):
    fp8, twin = tiny_fp8_pair("llama")
    got = load_params(load_config(fp8), load_weights(fp8), dtype=dtype)
    want = load_params(load_config(twin), load_weights(twin), dtype=dtype)
    got_leaves, got_tree = jax.tree_util.tree_flatten_with_path(got)
    want_leaves, want_tree = jax.tree_util.tree_flatten_with_path(want)
    assert got_tree == want_tree and len(got_leaves) == len(want_leaves) > 10
    for (path, a), (_, b) in zip(got_leaves, want_leaves):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b)), jax.tree_util.keystr(path)


def test_the_fp8_llama_stores_its_projections_fp8(tiny_fp8_pair):
    fp8, _ = tiny_fp8_pair("llama")
    weights = load_weights(fp8)
    assert weights.quantized == 2 * 7 - 1  # q, k, v, o, gate, up, down per layer; layer 0's o_proj left float32
    assert weights.stored["model.layers.1.self_attn.q_proj.weight"].dtype.name == "float8_e4m3fn"
