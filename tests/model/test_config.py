"""Configs as transformers 4 and 5 write them, every supported family, and clear refusals."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from pdserve.server.model.config import ModelLoadError, load_config, parse_config
from pdserve.server.model.rope import inv_freq
from pdserve.server.model.weights import load_weights


def test_families_load(family_model):
    family, path = family_model
    c = load_config(path)
    assert c.family == family
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (2, 4, 2, 32)
    assert c.qkv_bias == (family == "qwen2")
    assert c.qk_norm == (family == "qwen3")
    assert c.eos_token_ids == (0,)
    assert c.max_model_len == 512


def test_transformers4_style_rope_equals_transformers5_style(tiny_model):
    raw = json.loads((tiny_model("llama") / "config.json").read_text())
    v5 = parse_config(raw)
    params = raw.pop("rope_parameters")
    raw["rope_theta"] = params.pop("rope_theta")
    raw["rope_scaling"] = dict(params, type=params.pop("rope_type"))
    v4 = parse_config(raw)
    assert v4.rope == v5.rope and v4.rope.kind == "llama3"


def test_rope_matches_transformers(tiny_model):
    import torch
    import transformers

    for family in ("llama", "qwen3"):
        path = tiny_model(family)
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        ours = inv_freq(load_config(path))
        theirs = hf.model.rotary_emb.inv_freq.numpy()
        np.testing.assert_allclose(ours, theirs, rtol=1e-6)


def test_unsupported_architecture_is_named(tmp_path, tiny_model):
    shutil.copytree(tiny_model("llama"), tmp_path / "m")
    raw = json.loads((tmp_path / "m" / "config.json").read_text())
    raw["architectures"] = ["GPTNeoXForCausalLM"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="GPTNeoXForCausalLM"):
        load_config(tmp_path / "m")


def test_missing_and_corrupt_directories(tmp_path, tiny_model):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_config(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="config.json is missing"):
        load_config(tmp_path / "empty")
    shutil.copytree(tiny_model("llama"), tmp_path / "bad")
    (tmp_path / "bad" / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        load_config(tmp_path / "bad")
    shutil.copytree(tiny_model("llama"), tmp_path / "trunc")
    weights = tmp_path / "trunc" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ModelLoadError):
        load_weights(tmp_path / "trunc")
    (tmp_path / "trunc" / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no weights"):
        load_weights(tmp_path / "trunc")


def test_sharded_and_bf16_checkpoints_load(tmp_path):
    from pdserve.server.model.tiny import make_tiny_model

    sharded = make_tiny_model(tmp_path / "sharded", "qwen2", max_shard_size="300KB")
    assert (sharded / "model.safetensors.index.json").exists()
    one = make_tiny_model(tmp_path / "one", "qwen2")
    a, b = load_weights(sharded), load_weights(one)
    assert a.keys() == b.keys()
    assert all(np.array_equal(a[k], b[k]) for k in a)
    bf16 = make_tiny_model(tmp_path / "bf16", "qwen2", dtype="bfloat16")
    w = load_weights(bf16)
    assert str(w["model.embed_tokens.weight"].dtype) == "bfloat16"
    np.testing.assert_allclose(w["model.embed_tokens.weight"].astype(np.float32),
                               b["model.embed_tokens.weight"], rtol=1e-2, atol=1e-3)


def test_max_model_len_is_the_flag_or_the_models_capped_by_the_cache():
    from pdserve.server.model.config import resolve_max_model_len

    assert resolve_max_model_len(131072) == 131072
    assert resolve_max_model_len(131072, capacity=2048) == 2048
    assert resolve_max_model_len(131072, 4096) == 4096
    assert resolve_max_model_len(131072, 4096, capacity=8192) == 4096
    with pytest.raises(ValueError, match="--max-model-len 200000 exceeds the model's max_model_len 131072"):
        resolve_max_model_len(131072, 200000)
