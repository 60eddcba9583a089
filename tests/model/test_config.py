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


def test_gemma_configs_carry_what_their_layers_compute(tiny_model):
    import torch
    import transformers

    g2, g3 = load_config(tiny_model("gemma2")), load_config(tiny_model("gemma3"))
    assert g2.layer_windows == (24, None, 24, None) and g3.layer_windows == (24, 24, 24, None)
    assert (g2.attn_softcap, g2.final_softcap, g3.attn_softcap, g3.final_softcap) == (5.0, 3.0, None, None)
    assert g2.scale == g3.scale == 24**-0.5 and g2.embed_scale == 128**0.5 and g2.tie_word_embeddings
    assert g3.qk_norm and not g2.qk_norm and g2.local_rope is None
    assert g3.rope_of(0).theta == 10000.0 and g3.rope_of(3).theta == 1e6
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model("gemma3"), dtype=torch.float32)
    for kind, rope in (("full_attention", g3.rope), ("sliding_attention", g3.local_rope)):
        theirs = getattr(hf.model.rotary_emb, f"{kind}_inv_freq").numpy()
        np.testing.assert_allclose(inv_freq(g3, rope), theirs, rtol=1e-6)


def test_transformers4_style_gemma3_config_equals_transformers5_style(tiny_model):
    raw = json.loads((tiny_model("gemma3") / "config.json").read_text())
    v5 = parse_config(raw)
    ropes = raw.pop("rope_parameters")
    raw.pop("layer_types")
    v4 = parse_config(dict(raw, rope_theta=ropes["full_attention"]["rope_theta"], sliding_window_pattern=4,
                           rope_local_base_freq=ropes["sliding_attention"]["rope_theta"]))
    assert v4 == v5
    linear = parse_config(dict(raw, rope_scaling={"rope_type": "linear", "factor": 8.0}))  # Gemma 3 4B's global
    assert linear.rope.kind == "linear" and linear.rope.factor == 8.0 and linear.local_rope.kind == "default"
    assert parse_config(dict(raw, sliding_window_pattern=2)).layer_windows == (24, None, 24, None)


def test_unsupported_architecture_is_named(tmp_path, tiny_model):
    shutil.copytree(tiny_model("llama"), tmp_path / "m")
    raw = json.loads((tmp_path / "m" / "config.json").read_text())
    raw["architectures"] = ["GPTNeoXForCausalLM"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="GPTNeoXForCausalLM"):
        load_config(tmp_path / "m")


@pytest.mark.parametrize("arch, words", [
    ("KimiK2ForCausalLM", r"multi-head latent attention \(MLA\).* nearest it serves is DeepseekV3ForCausalLM"),
    ("JambaForCausalLM", "a hybrid of Mamba and attention layers.* nearest it serves is MixtralForCausalLM"),
    ("Gemma3ForConditionalGeneration", r"a multimodal model \(vision tower\).* nearest it serves is Gemma3ForCausalLM"),
])
def test_known_unsupported_architectures_are_refused_naming_the_nearest_supported(tmp_path, tiny_model, arch, words):
    shutil.copytree(tiny_model("llama"), tmp_path / "m")
    raw = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps(dict(raw, architectures=[arch])))
    with pytest.raises(ModelLoadError, match=f"^architecture {arch} is not supported: it needs {words}"):
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


_SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, max_position_embeddings=512, vocab_size=64)


def _saved(tmp_path, name: str, **kwargs):
    """config.json as transformers writes it for the family `name` (MistralConfig, ...) with kwargs."""
    import transformers

    family = name.removesuffix("Config")
    config = getattr(transformers, name)(**_SHAPE, architectures=[f"{family}ForCausalLM"], **kwargs)
    config.save_pretrained(tmp_path / family)
    return tmp_path / family


def _edited(tmp_path, tiny_model, family: str, **changes):
    """The tiny checkpoint's config.json with fields set (None: removed)."""
    raw = json.loads((tiny_model(family) / "config.json").read_text())
    raw.update(changes)
    out = tmp_path / f"{family}-edited"
    out.mkdir(exist_ok=True)
    (out / "config.json").write_text(json.dumps({k: v for k, v in raw.items() if v is not None}))
    return out


def test_a_sliding_window_is_served_to_the_model_length_with_every_layer_windowed(tmp_path):
    path = _saved(tmp_path, "MistralConfig", sliding_window=24)
    config = load_config(path)
    assert config.sliding_window == 24 and config.layer_windows == (24, 24) and config.all_windowed
    assert config.limited_to(None).max_model_len == 512
    assert config.limited_to(16).max_model_len == 16
    plain = load_config(_saved(tmp_path, "MistralConfig", sliding_window=None)).limited_to(None)
    assert plain.sliding_window is None and plain.layer_windows == () and not plain.all_windowed
    assert plain.window(0) is None


def test_qwen_windows_follow_use_sliding_window_and_max_window_layers(tmp_path, tiny_model):
    # Qwen2.5 ships sliding_window set, use_sliding_window false (and no layer_types: transformers 4).
    qwen25 = load_config(_edited(tmp_path, tiny_model, "qwen2", sliding_window=24, use_sliding_window=False,
                                 max_window_layers=1, layer_types=None))
    assert qwen25.sliding_window is None and qwen25.limited_to(None).max_model_len == 512
    for name in ("Qwen2Config", "Qwen3Config"):
        # Layers from max_window_layers on are windowed: layer 1 of 2.
        windowed = load_config(_saved(tmp_path, name, use_sliding_window=True, sliding_window=24, max_window_layers=1))
        assert windowed.raw["layer_types"] == ["full_attention", "sliding_attention"]
        assert windowed.layer_windows == (None, 24) and not windowed.all_windowed
        assert windowed.window(0) is None and windowed.window(1) == 24
        none = load_config(_saved(tmp_path, name, use_sliding_window=True, sliding_window=24, max_window_layers=2))
        assert none.sliding_window is None and none.limited_to(None).max_model_len == 512
    # transformers 4's configs carry no layer_types: max_window_layers decides alone.
    v4 = load_config(_edited(tmp_path, tiny_model, "qwen2", sliding_window=24, use_sliding_window=True,
                             max_window_layers=1, layer_types=None))
    assert v4.sliding_window == 24 and v4.layer_windows == (None, 24)


@pytest.mark.parametrize("family, changes, words", [
    ("llama", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
     "rope_parameters.rope_type 'yarn'"),
    ("mistral", {"rope_parameters": None, "rope_theta": 1e4, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
     "rope_scaling.type 'dynamic'"),
    ("gemma2", {"hidden_activation": "gelu"}, "hidden_activation 'gelu'"),
    ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention true"),
    ("gemma3", {"attention_bias": True}, "attention_bias true"),
    ("qwen3", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e6, "factor": 2.0}},
     "rope_parameters.rope_type 'dynamic'"),
    ("qwen2", {"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
    ("qwen3", {"layer_types": ["full_attention", "chunked_attention"]}, "layer_types with 'chunked_attention'"),
    ("llama", {"layer_types": ["sliding_attention", "full_attention"]}, "layer_types with 'sliding_attention'"),
    ("llama", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping 50.0"),
    ("qwen2", {"final_logit_softcapping": 30.0}, "final_logit_softcapping 30.0"),
    ("llama", {"attention_bias": True}, "attention_bias true"),
    ("qwen3", {"attention_bias": True}, "attention_bias true"),
    ("llama", {"mlp_bias": True}, "mlp_bias true"),
    ("mistral", {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ("qwen2", {"quantization_config": {"quant_method": "awq", "bits": 4}},
     r"quantization_config \(quant_method 'awq'\): .* --quantization fp8 or int8"),
    ("llama", {"dtype": None, "torch_dtype": "float64"}, "torch_dtype 'float64'"),
])
def test_what_pdserve_does_not_implement_is_refused_naming_the_field(tmp_path, tiny_model, family, changes, words):
    with pytest.raises(ModelLoadError, match=f"^config.json sets {words}"):
        load_config(_edited(tmp_path, tiny_model, family, **changes))


def test_fields_the_familys_transformers_code_ignores_are_ignored(tmp_path, tiny_model):
    import transformers

    # Mistral's and Qwen2's attention modules take no attention_bias / mlp_bias (q/k/v biases: Qwen2 always).
    mistral = load_config(_edited(tmp_path, tiny_model, "mistral", attention_bias=True, mlp_bias=True))
    assert not mistral.qkv_bias
    qwen2 = load_config(_edited(tmp_path, tiny_model, "qwen2", attention_bias=False, hidden_act="swish"))
    assert qwen2.qkv_bias
    # No rope_theta at all: transformers' default_theta.
    path = _edited(tmp_path, tiny_model, "qwen3", rope_parameters=None, rope_theta=None)
    theirs = transformers.AutoConfig.from_pretrained(path).rope_parameters["rope_theta"]
    assert load_config(path).rope.theta == theirs == 10000.0
