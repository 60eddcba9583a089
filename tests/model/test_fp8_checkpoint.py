"""fp8 block-scaled checkpoints (DeepSeek-V3/R1's format) read by the shared loader: each weight dequantized to
exactly fp8 x its block's scale, the ragged last blocks included; malformed ones refused with what to do."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.server.model.config import ModelLoadError, load_config
from pdserve.server.model.fp8_checkpoint import DequantizedTensors, Fp8Blocks, dequantize, load_note
from pdserve.server.model.weights import load_weights


def test_each_block_is_scaled_by_its_own_scale_the_last_ones_ragged():
    q = np.arange(15, dtype=np.float32).reshape(3, 5).astype(ml_dtypes.float8_e4m3fn)  # 0..14 are exact in e4m3
    scale = np.array([[1.0, 2.0, 4.0], [0.5, 8.0, 16.0]], dtype=np.float32)  # [ceil(3/2), ceil(5/2)]
    got = dequantize("w", q, scale, (2, 2))
    assert got.dtype == np.float32
    assert got.tolist() == [[0, 1, 4, 6, 16], [5, 6, 14, 16, 36], [5, 5.5, 96, 104, 224]]


def test_one_scale_per_tensor_when_the_block_size_is_null():
    q = np.array([[1.0, -2.0]], dtype=np.float32).astype(ml_dtypes.float8_e4m3fn)
    assert dequantize("w", q, np.array([0.25], np.float32), None).tolist() == [[0.25, -0.5]]


def test_a_scale_of_the_wrong_shape_is_refused_saying_which_shape_is_needed():
    q = np.zeros((160, 32), ml_dtypes.float8_e4m3fn)
    with pytest.raises(ModelLoadError, match=r"w_scale_inv has shape \[1, 1\]; a \[160, 32\] weight in 128x128 "
                                             r"blocks needs \[2, 1\] .*fix weight_block_size"):
        dequantize("w", q, np.ones((1, 1), np.float32), (128, 128))


def test_the_deepseek_fp8_checkpoint_loads_equal_to_its_dequantized_twin(tiny_fp8_pair):
    fp8, twin = tiny_fp8_pair("deepseek_v3")
    stored = load_file(fp8 / "model.safetensors")
    kv_b = "model.layers.1.self_attn.kv_b_proj.weight"
    assert stored[kv_b].dtype == torch.float8_e4m3fn and stored[kv_b].shape == (160, 32)
    assert stored[kv_b + "_scale_inv"].shape == (2, 1)  # 160 rows: one full block of 128 and a ragged one of 32
    assert stored["model.layers.1.self_attn.q_b_proj.weight_scale_inv"].shape == (1, 1)  # in 48 of a block of 128
    assert stored["model.layers.0.mlp.gate_proj.weight_scale_inv"].shape == (2, 1)  # [256, 128]: two full blocks
    assert stored["model.layers.0.self_attn.o_proj.weight"].dtype == torch.float32  # modules_to_not_convert
    assert stored["model.layers.1.self_attn.kv_a_proj_with_mqa.weight_scale_inv"].shape == (1, 1)  # [48, 128]
    assert stored["model.layers.1.mlp.gate.weight"].dtype == torch.float32  # the router is never quantized

    got, want = load_weights(fp8), load_weights(twin)
    assert isinstance(got, DequantizedTensors) and got.quantized == 71
    assert sorted(got) == sorted(want) and len(got) == len(want) == 91
    for name in want:
        assert got[name].dtype == want[name].dtype and np.array_equal(got[name], want[name]), name
    assert load_weights(fp8, np.dtype(ml_dtypes.bfloat16))[kv_b].tobytes() == \
        want[kv_b].astype(ml_dtypes.bfloat16).tobytes()
    assert load_config(fp8).describe() == load_config(twin).describe()


def test_the_tiers_log_that_they_dequantize(tiny_fp8_pair):
    fp8, twin = tiny_fp8_pair("deepseek_v3")
    assert load_note(fp8, "decode", "bfloat16", "cpu") == (
        "decode weights: fp8 e4m3 checkpoint (128x128 block scales) dequantized to bfloat16 at load: the decode tier "
        "has no block-scaled fp8 matmul on cpu, so the weights are not kept fp8")
    assert load_note(fp8, "decode", "bfloat16", "cuda").endswith(
        "on cuda, so the weights are not kept fp8 (its fp8 matmul with per-channel scales: --quantization fp8, which "
        "requantizes them)")
    assert load_note(twin, "decode", "float32", "cpu") is None


def _copy(fp8, tmp_path, edit_tensors=None, edit_quant=None):
    out = tmp_path / "edited"
    out.mkdir()
    tensors = load_file(fp8 / "model.safetensors")
    if edit_tensors:
        edit_tensors(tensors)
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((fp8 / "config.json").read_text())
    if edit_quant:
        edit_quant(config["quantization_config"])
    (out / "config.json").write_text(json.dumps(config))
    return out


KV_B = "model.layers.1.self_attn.kv_b_proj.weight"


@pytest.mark.parametrize("edit, words", [
    (lambda t: t.update({KV_B + "_scale_inv": t[KV_B + "_scale_inv"][:1]}),
     r"kv_b_proj.weight_scale_inv has shape \[1, 1\]; a \[160, 32\] weight in 128x128 blocks needs \[2, 1\]"),
    (lambda t: t.pop(KV_B + "_scale_inv"), r"kv_b_proj.weight is float8_e4m3fn but the checkpoint has no "
                                           r".*_scale_inv: .*re-download"),
    (lambda t: t.pop(KV_B), r"holds .*kv_b_proj.weight_scale_inv but no .*kv_b_proj.weight"),
    (lambda t: t.update({"model.layers.0.self_attn.o_proj.weight_scale_inv": torch.ones(1, 1),
                         "model.layers.0.self_attn.o_proj.weight": torch.zeros(128, 96).to(torch.float8_e4m3fn)}),
     r"o_proj.weight is stored fp8 but its module is in modules_to_not_convert"),
])
def test_a_malformed_checkpoint_is_refused(tiny_fp8_pair, tmp_path, edit, words):
    fp8, _ = tiny_fp8_pair("deepseek_v3")
    path = _copy(fp8, tmp_path, edit_tensors=edit)
    with pytest.raises(ModelLoadError, match=words):
        weights = load_weights(path)
        weights[KV_B]


@pytest.mark.parametrize("change, words", [
    ({"fmt": "e5m2"}, r"fmt 'e5m2': only e4m3"),
    ({"activation_scheme": "static"}, r"activation_scheme 'static': static activation scales are not applied"),
    ({"weight_block_size": [128]}, r"weight_block_size \[128\]: expected two positive integers"),
    ({"modules_to_not_convert": ["lm_head", "layers.(1"]}, r"modules_to_not_convert entry 'layers.\(1' is not a valid"),
    ({"quant_method": "gptq"}, r"quant_method 'gptq': pdserve loads fp8 .* --quantization fp8 or int8"),
])
def test_a_quantization_config_pdserve_does_not_serve_is_refused(tiny_fp8_pair, tmp_path, change, words):
    fp8, _ = tiny_fp8_pair("deepseek_v3")
    path = _copy(fp8, tmp_path, edit_quant=lambda q: q.update(change))
    with pytest.raises(ModelLoadError, match=r"^config.json sets quantization_config .*" + words):
        load_config(path)
    with pytest.raises(ModelLoadError, match=words):
        load_weights(path)


def test_modules_to_not_convert_match_as_transformers_matches_them():
    scheme = Fp8Blocks((128, 128), ("lm_head", "model.layers.1", r"model.layers.*.mlp.gate"))
    assert not scheme.converts("lm_head") and not scheme.converts("model.layers.1.self_attn.q_proj")
    assert scheme.converts("model.layers.11.self_attn.q_proj")  # "layers.1" up to a module boundary only
    assert not scheme.converts("model.layers.3.mlp.gate") and scheme.converts("model.layers.3.mlp.gate_proj")
