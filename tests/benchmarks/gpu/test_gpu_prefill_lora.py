"""benchmarks/gpu/prefill_lora.py on the CPU (its dry-run sizes): the check of a step mixing the base and two adapters
against merged-weight references passes, and fails when the programs drop the adapters' deltas; merging is exact."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pdserve.benchmarks.gpu import prefill_lora
from pdserve.benchmarks.gpu.checks import Check


def test_merged_params_add_scaling_b_a_to_the_targeted_weights_of_each_layer():
    import jax.numpy as jnp

    from pdserve.benchmarks.gpu.prefill import random_params

    config = prefill_lora._config(True, 2, Path("."))
    params = random_params(config)
    ckpt = prefill_lora.random_lora("x", 4, ("q_proj", "down_proj"), config, seed=0)
    merged = prefill_lora.merged_params(params, ckpt)
    a, b = ckpt.weights[(1, "q_proj")]  # A [r, H], B [Hq * D, r]
    want = np.asarray(params["layers"]["wq"][1], np.float32) + (2.0 * b @ a).T.reshape(config.hidden_size,
                                                                                         config.num_heads, -1)
    np.testing.assert_allclose(np.asarray(merged["layers"]["wq"][1]), want, rtol=1e-6, atol=1e-6)
    a, b = ckpt.weights[(0, "down_proj")]  # A [r, I], B [H, r]
    want = np.asarray(params["layers"]["w_down"][0], np.float32) + 2.0 * (b @ a).T
    np.testing.assert_allclose(np.asarray(merged["layers"]["w_down"][0]), want, rtol=1e-6, atol=1e-6)
    for untouched in ("wk", "wv", "wo", "w_gate", "w_up"):  # not targeted: the base weights, in fp32
        assert merged["layers"][untouched].dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(merged["layers"][untouched]),
                                      np.asarray(params["layers"][untouched], np.float32))


def test_the_check_passes_on_the_served_programs(tmp_path):
    (check,) = prefill_lora.lora_check(tmp_path, True, Check)
    assert check.passed, check.detail
    assert check.group == "prefill-lora" and "steps run [3]" in check.detail


def test_the_check_fails_when_the_programs_drop_the_deltas(tmp_path, monkeypatch):
    from pdserve.server.prefill import model

    monkeypatch.setattr(model, "add_delta", lambda lora, proj, x, y: y)  # every token computes as the base model
    (check,) = prefill_lora.lora_check(tmp_path, True, Check)
    assert not check.passed and "KV max error" in check.detail, check.detail
