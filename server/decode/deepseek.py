"""DeepSeek-V2/V3 in plain torch over a paged cache of MLA latents: `DecoderModel`'s forward, decode and
verify with DeepSeek's layers (multi-head latent attention, `mla.py`; a dense MLP in the first
`MoeConfig.dense_layers` layers, then routed experts plus the shared experts' dense MLP)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.server.decode.attention import PagedContext
from pdserve.server.decode.kv_cache import PagedKvCache
from pdserve.server.decode.lora import LoraRows
from pdserve.server.decode.mla import MlaAttention
from pdserve.server.decode.model import DecoderModel, rms_norm
from pdserve.server.decode.moe import MoeMlp
from pdserve.server.decode.quant import Linear
from pdserve.server.model.config import ModelConfig


class GatedMlp(nn.Module):
    """down(silu(gate(x)) * up(x)), gate|up fused."""

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype, device: torch.device | str | None):
        super().__init__()
        self.gate_up = Linear(hidden, 2 * intermediate, False, dtype, device)  # [2 I, d]
        self.down = Linear(intermediate, hidden, False, dtype, device)  # [d, I]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [.., d] -> [.., d]
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class DeepseekLayer(nn.Module):
    local_rope = False
    """Every layer reads the model's one RoPE table."""

    def __init__(self, config: ModelConfig, index: int, dtype: torch.dtype, device: torch.device | str | None = None):
        """Empty buffers of the layer's shapes; `deepseek_weights.load_deepseek_weights` fills them."""
        super().__init__()
        self.config = config
        self.index = index
        d, moe = config.hidden_size, config.moe
        self.attn = MlaAttention(config, index, dtype, device)
        dense = moe is None or index < moe.dense_layers
        self.mlp = GatedMlp(d, config.intermediate_size, dtype, device) if dense else None
        self.experts = None if dense else MoeMlp(moe, d, config.hidden_act, dtype, device)
        self.shared = GatedMlp(d, moe.shared_intermediate_size, dtype, device) \
            if not dense and moe.shared_intermediate_size else None
        self.attn_norm = nn.Buffer(torch.empty(d, dtype=dtype, device=device))  # [d]
        self.mlp_norm = nn.Buffer(torch.empty(d, dtype=dtype, device=device))  # [d]

    def forward(
        self,
        x: torch.Tensor,  # [B, S, d]
        cos: torch.Tensor,  # [B, S, 1, R]
        sin: torch.Tensor,  # [B, S, 1, R] first half negated
        context: PagedContext,
        cache: PagedKvCache,
        lora: LoraRows | None = None,
    ) -> torch.Tensor:
        if lora is not None:  # refused at start (`startup.lora_slots`): never reached with adapters
            raise ValueError("LoRA adapters are not served for DeepSeek models yet")
        eps = self.config.rms_norm_eps
        x = x + self.attn(rms_norm(x, self.attn_norm, eps), cos, sin, context, cache)
        h = rms_norm(x, self.mlp_norm, eps)
        if self.mlp is not None:
            return x + self.mlp(h)
        out = self.experts(h)  # [B, S, d]
        return x + (out if self.shared is None else out + self.shared(h))


class DeepseekModel(DecoderModel):
    """`DecoderModel` with DeepSeek's layers; its cache holds one latent per token and layer
    (`KvLayout.for_model`: kind mla_latent)."""

    @staticmethod
    def make_layer(config: ModelConfig, index: int, dtype: torch.dtype, device: torch.device | str | None
                   ) -> nn.Module:
        return DeepseekLayer(config, index, dtype, device)
