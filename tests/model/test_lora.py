"""PEFT LoRA checkpoints read and checked against the base model: what peft writes is read exactly (A, B, scaling);
what pdserve cannot serve is refused at load, naming why and what to change."""

from __future__ import annotations

import json
import math
import re
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from pdserve.server.model.config import load_config
from pdserve.server.model.lora import LoraLoadError, LoraNotFound, load_lora
from pdserve.server.model.tiny import DRAFT_SHAPE, make_tiny_model
from pdserve.server.model.tiny_lora import make_tiny_lora


def test_peft_weights_and_scaling_are_read_as_written(tiny_loras):
    base, loras = tiny_loras
    config = load_config(base)
    ada = load_lora("ada", loras["ada"], config, max_rank=16)
    assert (ada.rank, ada.scaling, ada.targets) == (8, 2.0, ("q_proj", "v_proj", "down_proj"))
    assert sorted(ada.weights) == [(layer, p) for layer in (0, 1) for p in ("down_proj", "q_proj", "v_proj")]
    raw = load_file(loras["ada"] / "adapter_model.safetensors")
    a, b = ada.weights[1, "v_proj"]
    assert np.array_equal(a, raw["base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"].numpy())
    assert np.array_equal(b, raw["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"].numpy())
    assert a.shape == (8, config.hidden_size) and b.shape == (config.num_kv_heads * config.head_dim, 8)
    bob = load_lora("bob", loras["bob"], config, max_rank=16)  # use_rslora: alpha / sqrt(r)
    assert (bob.rank, bob.scaling) == (16, 32 / math.sqrt(16))
    assert bob.targets == ("k_proj", "o_proj", "gate_proj", "up_proj")


def test_a_missing_adapter_is_vllms_not_found(tiny_loras, tmp_path):
    base, _ = tiny_loras
    with pytest.raises(LoraNotFound, match=f"^Loading lora x failed: No adapter found for {tmp_path}$"):
        load_lora("x", tmp_path, load_config(base), 16)


def test_a_rank_over_the_maximum_is_refused_naming_the_flag(tiny_loras):
    base, loras = tiny_loras
    with pytest.raises(LoraLoadError, match="rank 16 exceeds --max-lora-rank 8; start the server with "
                                            "--max-lora-rank 16 or more"):
        load_lora("bob", loras["bob"], load_config(base), max_rank=8)


def test_an_adapter_of_another_base_model_is_refused(tiny_loras, tmp_path):
    base, _ = tiny_loras
    other = make_tiny_model(tmp_path / "other", "llama", shape=DRAFT_SHAPE)  # hidden 64, one layer
    adapter = make_tiny_lora(other, tmp_path / "a", rank=8, targets=("q_proj",))
    with pytest.raises(LoraLoadError, match=r"layer 0 q_proj has lora_A \(8, 64\) and lora_B \(64, 8\); this base "
                                            r"model \(and r=8\) needs \(8, 128\) and \(128, 8\): the adapter was "
                                            r"trained on another base model"):
        load_lora("a", adapter, load_config(base), 16)


@pytest.mark.parametrize("change, words", [
    ({"use_dora": True}, "use_dora=True is not served (train the adapter with use_dora=False)"),
    ({"bias": "all"}, "bias='all' is not served"),
    ({"rank_pattern": {"q_proj": 4}}, "rank_pattern={'q_proj': 4} is not served"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save=['lm_head'] is not served"),
    ({"peft_type": "IA3"}, "not a LoRA adapter (peft_type 'IA3'"),
    ({"r": 0}, "needs an integer r >= 1"),
])
def test_configs_pdserve_cannot_serve_are_refused(tiny_loras, tmp_path, change, words):
    base, loras = tiny_loras
    folder = tmp_path / "a"
    shutil.copytree(loras["ada"], folder)
    raw = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**raw, **change}))
    with pytest.raises(LoraLoadError, match=re.escape(f"LoRA adapter 'a' ({folder}): ") + ".*" + re.escape(words)):
        load_lora("a", folder, load_config(base), 16)


def test_an_embedding_or_head_target_and_a_lone_half_are_refused(tiny_loras, tmp_path):
    from safetensors.torch import save_file

    base, loras = tiny_loras
    raw = load_file(loras["ada"] / "adapter_model.safetensors")
    folder = tmp_path / "a"
    shutil.copytree(loras["ada"], folder)
    save_file({**raw, "base_model.model.lm_head.lora_A.weight": torch.zeros(8, 128)},
              folder / "adapter_model.safetensors")
    with pytest.raises(LoraLoadError, match="lm_head.lora_A.weight is not a LoRA weight of a layer's projection"):
        load_lora("a", folder, load_config(base), 16)
    half = {k: v for k, v in raw.items() if k != "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"}
    save_file(half, folder / "adapter_model.safetensors")
    with pytest.raises(LoraLoadError, match="layer 0 down_proj has lora_A without its other half"):
        load_lora("a", folder, load_config(base), 16)
