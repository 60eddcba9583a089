"""Loads a DeepSeek-V2/V3 checkpoint's tensors (transformers' names) into a `DeepseekModel`: kv_b_proj split into
the absorbed projections W_UK and W_UV, gate|up fused, the routed experts under `EXPERT_NAMES`."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from pdserve.server.decode.deepseek import DeepseekModel, GatedMlp
from pdserve.server.decode.kv_cache import numpy_to_torch
from pdserve.server.model.weights import EXPERT_NAMES


def load_deepseek_weights(model: DeepseekModel, tensors: Mapping[str, np.ndarray]) -> None:
    """Copies the checkpoint's tensors into the model's buffers (converted to its dtype, on its device); raises
    ValueError naming the first missing tensor or mismatched shape."""
    config = model.config

    def read(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in tensors:
            raise ValueError(f"the checkpoint lacks {name} ({config.describe()})")
        if tuple(tensors[name].shape) != shape:
            raise ValueError(f"{name} is {tuple(tensors[name].shape)} in the checkpoint; {config.describe()} needs "
                             f"{shape}: is config.json the checkpoint's own?")
        return numpy_to_torch(tensors[name])

    def copy(dst: torch.Tensor, name: str) -> None:
        dst.copy_(read(name, tuple(dst.shape)))

    def gated(mlp: GatedMlp, prefix: str) -> None:
        half = mlp.gate_up.weight.shape[0] // 2
        copy(mlp.gate_up.weight[:half], f"{prefix}gate_proj.weight")
        copy(mlp.gate_up.weight[half:], f"{prefix}up_proj.weight")
        copy(mlp.down.weight, f"{prefix}down_proj.weight")

    mla = config.mla
    H = config.num_heads
    with torch.no_grad():
        copy(model.embed, "model.embed_tokens.weight")
        if model.untied_lm_head is not None:
            copy(model.untied_lm_head, "lm_head.weight")
        copy(model.norm, "model.norm.weight")
        for layer in model.layers:
            p = f"model.layers.{layer.index}."
            a = f"{p}self_attn."
            attn = layer.attn
            if mla.q_lora_rank is None:
                copy(attn.wq.weight, f"{a}q_proj.weight")
            else:
                copy(attn.wq_a.weight, f"{a}q_a_proj.weight")
                copy(attn.q_a_norm, f"{a}q_a_layernorm.weight")
                copy(attn.wq_b.weight, f"{a}q_b_proj.weight")
            copy(attn.wkv_a.weight, f"{a}kv_a_proj_with_mqa.weight")
            copy(attn.kv_a_norm, f"{a}kv_a_layernorm.weight")
            nope, v = mla.qk_nope_head_dim, mla.v_head_dim
            kv_b = read(f"{a}kv_b_proj.weight", (H * (nope + v), mla.kv_lora_rank)).view(H, nope + v, -1)
            attn.w_uk.copy_(kv_b[:, :nope])  # [H, nope, C]
            attn.w_uv.copy_(kv_b[:, nope:])  # [H, V, C]
            copy(attn.wo.weight, f"{a}o_proj.weight")
            copy(layer.attn_norm, f"{p}input_layernorm.weight")
            copy(layer.mlp_norm, f"{p}post_attention_layernorm.weight")
            if layer.mlp is not None:
                gated(layer.mlp, f"{p}mlp.")
                continue
            names = EXPERT_NAMES[config.family]
            copy(layer.experts.router, p + names["router"] + ".weight")
            if layer.experts.correction_bias is not None:
                copy(layer.experts.correction_bias, p + names["router"] + ".e_score_correction_bias")
            for e in range(config.moe.num_experts):
                gate_up = layer.experts.gate_up[e].weight
                half = gate_up.shape[0] // 2
                copy(gate_up[:half], p + names["gate"].format(e=e))
                copy(gate_up[half:], p + names["up"].format(e=e))
                copy(layer.experts.down[e].weight, p + names["down"].format(e=e))
            if layer.shared is not None:
                gated(layer.shared, f"{p}mlp.shared_experts.")
