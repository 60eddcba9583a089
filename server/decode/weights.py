"""Loads a checkpoint's tensors into a `DecoderModel` built from its config (gpt-fast's shape: the model
file holds the math, this file the names, quantization is one step after).

    model = DecoderModel(config, dtype, device)    # empty buffers of the right shapes, on the device
    load_weights(model, tensors)                   # HF names -> fused buffers (q|k|v, gate|up), copied
    quantize(model, "fp8")                         # optional: int8/fp8 weight-only, per-output-channel

`build_model` does the three.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from pdserve.server.decode.kv_cache import numpy_to_torch
from pdserve.server.decode.model import DecoderModel
from pdserve.server.decode.quant import WeightFormat, quantize
from pdserve.server.model.config import ModelConfig
from pdserve.server.model.weights import EXPERT_NAMES


def load_weights(model: DecoderModel, tensors: Mapping[str, np.ndarray]) -> None:
    """Copies the HF-named checkpoint tensors into the model's buffers (converted to its dtype, on its
    device); raises ValueError naming the first missing tensor or mismatched shape."""
    config = model.config

    def copy(dst: torch.Tensor, name: str) -> None:
        if name not in tensors:
            raise ValueError(f"the checkpoint lacks {name} ({config.describe()})")
        src = tensors[name]
        if tuple(src.shape) != tuple(dst.shape):
            raise ValueError(f"{name} is {tuple(src.shape)} in the checkpoint; {config.describe()} needs "
                             f"{tuple(dst.shape)}: is config.json the checkpoint's own?")
        dst.copy_(numpy_to_torch(src))

    def rows(dst: torch.Tensor, names: list[str]) -> None:
        """Fused weights: each name's rows one after another in dst."""
        start = 0
        for name in names:
            n = tensors[name].shape[0] if name in tensors else 0
            copy(dst[start : start + n], name)
            start += n
        if start != dst.shape[0]:
            raise ValueError(f"{', '.join(names)} hold {start} rows together; {config.describe()} needs "
                             f"{dst.shape[0]}")

    with torch.no_grad():
        copy(model.embed, "model.embed_tokens.weight")
        if model.untied_lm_head is not None:
            copy(model.untied_lm_head, "lm_head.weight")
        copy(model.norm, "model.norm.weight")
        norms = [model.norm]
        for layer in model.layers:
            p = f"model.layers.{layer.index}."
            attn = [f"{p}self_attn.{n}_proj" for n in "qkv"]
            rows(layer.wqkv.weight, [f"{n}.weight" for n in attn])
            if layer.wqkv.bias is not None:
                rows(layer.wqkv.bias, [f"{n}.bias" for n in attn])
            if layer.qk_norm is not None:  # [H + Hkv, D]: q_norm for each query head, then k_norm
                H = config.num_heads
                copy(layer.qk_norm[0], f"{p}self_attn.q_norm.weight")
                copy(layer.qk_norm[H], f"{p}self_attn.k_norm.weight")
                layer.qk_norm[1:H] = layer.qk_norm[0]
                layer.qk_norm[H + 1 :] = layer.qk_norm[H]
            copy(layer.wo.weight, f"{p}self_attn.o_proj.weight")
            if layer.experts is None:
                rows(layer.w_gate_up.weight, [f"{p}mlp.gate_proj.weight", f"{p}mlp.up_proj.weight"])
                copy(layer.w_down.weight, f"{p}mlp.down_proj.weight")
            else:
                names = EXPERT_NAMES[config.family]
                copy(layer.experts.router, p + names["router"] + ".weight")
                for e in range(config.moe.num_experts):
                    rows(layer.experts.gate_up[e].weight, [p + names[n].format(e=e) for n in ("gate", "up")])
                    copy(layer.experts.down[e].weight, p + names["down"].format(e=e))
            copy(layer.attn_norm, f"{p}input_layernorm.weight")
            norms += [layer.attn_norm, layer.mlp_norm]
            if config.sandwich_norms:  # Gemma: post_attention_layernorm is on the attention's output
                copy(layer.mlp_norm, f"{p}pre_feedforward_layernorm.weight")
                copy(layer.attn_post_norm, f"{p}post_attention_layernorm.weight")
                copy(layer.mlp_post_norm, f"{p}post_feedforward_layernorm.weight")
                norms += [layer.attn_post_norm, layer.mlp_post_norm]
            else:
                copy(layer.mlp_norm, f"{p}post_attention_layernorm.weight")
            if layer.qk_norm is not None:
                norms.append(layer.qk_norm)
        if config.norm_offset:  # Gemma's norms scale by (1 + w)
            for norm in norms:
                norm.copy_((norm.float() + 1.0).to(norm.dtype))


def build_model(
    config: ModelConfig,
    tensors: Mapping[str, np.ndarray],
    dtype: torch.dtype = torch.float32,
    weight_format: WeightFormat | None = None,
    device: torch.device | str | None = None,
) -> DecoderModel:
    """The model on the device with the checkpoint's weights, its linears quantized when weight_format is set
    (from the loaded values: the checkpoint's own when dtype holds them exactly)."""
    if config.mla is not None:
        from pdserve.server.decode.deepseek import DeepseekModel
        from pdserve.server.decode.deepseek_weights import load_deepseek_weights

        model = DeepseekModel(config, dtype, device)
        load_deepseek_weights(model, tensors)
    else:
        model = DecoderModel(config, dtype, device)
        load_weights(model, tensors)
    if weight_format is not None:
        quantize(model, weight_format)
    return model.eval()
