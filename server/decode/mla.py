"""Multi-head latent attention (DeepSeek-V2/V3) over a paged cache of latents, in the absorbed form.

Each token caches, per layer, one entry of kv_lora_rank + qk_rope_head_dim values: the latent (kv_a_layernorm of
kv_a_proj_with_mqa's first kv_lora_rank outputs) and the rotated key its last qk_rope_head_dim outputs make, one
for every head. The heads' keys and values are that latent through kv_b_proj (W_UK: each head's nope key rows,
W_UV: its value rows); attention never expands them. W_UK is folded into the query (q_nope W_UK: each head asks
the latent directly), so every head attends the same [T, latent] entries (like one kv head shared by H query
heads), and W_UV is applied to the attended latent afterwards. Prefill and decode take the same path.

The rope dimensions rotate as transformers' model does (`MlaConfig.rope_pairs`), and the cache holds the key
as transformers' cache does: V3's rope_interleave pairs written de-interleaved, V2's left interleaved.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.server.decode.attention import PagedContext
from pdserve.server.decode.kv_cache import PagedKvCache
from pdserve.server.decode.model import rms_norm, rope
from pdserve.server.decode.quant import Linear
from pdserve.server.model.config import MlaConfig, ModelConfig

LORA_NORM_EPS = 1e-6
"""q_a_layernorm's and kv_a_layernorm's epsilon: transformers builds them with its RMSNorm's default, whatever
rms_norm_eps says."""


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pairs: str) -> torch.Tensor:
    """x [.., R] rotated by `rope_tables`' cos and sin [.., R] (sin's first half negated) as `pairs` says
    (`MlaConfig.rope_pairs`)."""
    if pairs == "halves":
        return rope(x, cos, sin)
    rotated = rope(torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1), cos, sin)  # [.., R] as [evens | odds]
    if pairs == "deinterleaved":
        return rotated
    a, b = rotated.chunk(2, dim=-1)
    return torch.stack((a, b), dim=-1).flatten(-2)  # back in place: (a0, b0, a1, b1, ...)


def latent_attention(q: torch.Tensor, cache: PagedKvCache, layer: int, context: PagedContext, scale: float,
                     rank: int) -> torch.Tensor:
    """softmax(q E^T scale) E[:rank] over the context's cached entries E [T, rank + R] of one layer:
    q [B, S, H, rank + R] (absorbed queries) -> [B, S, H, rank] (attended latents). The H heads share the
    entries, as grouped-query heads share a kv head (the context's mask is built for groups = H); with the context's
    `paged_kernel` (decode on CUDA) through `cuda_mla`'s Triton kernel."""
    B, S, H, D = q.shape
    if context.paged_kernel:  # decode on CUDA (S = 1): the Triton kernel reads the context's blocks itself
        from pdserve.server.decode.cuda_mla import paged_mla_decode

        scales = None if cache.k_scales is None else cache.k_scales[layer]  # [N, 1]
        out = paged_mla_decode(q[:, 0, :, :rank], q[:, 0, :, rank:], cache.k[layer], context.block_tables,
                               context.context_lens, scale, scales)  # [B, H, rank]
        return out[:, None]
    entries, _ = cache.context_blocks(layer, context.block_tables, q.dtype)  # [B, 1, T, rank + R]
    latents = entries[..., :rank]  # [B, 1, T, rank]
    if S == 1:
        out = F.scaled_dot_product_attention(q.view(B, 1, H, D), entries, latents, attn_mask=context.bias,
                                             scale=scale)  # [B, 1, H, rank]
        return out.view(B, 1, H, rank)
    rows = q.transpose(1, 2).reshape(B, 1, H * S, D)  # [B, 1, H S, D] rows (head, token), as the mask's
    out = F.scaled_dot_product_attention(rows, entries, latents, attn_mask=context.bias, scale=scale)
    return out.view(B, H, S, rank).transpose(1, 2)  # [B, S, H, rank]


class MlaAttention(nn.Module):
    def __init__(self, config: ModelConfig, index: int, dtype: torch.dtype, device: torch.device | str | None = None):
        """Empty buffers of the layer's shapes; `deepseek_weights.load_deepseek_weights` fills them."""
        super().__init__()
        mla: MlaConfig = config.mla
        self.mla = mla
        self.index = index
        self.scale = config.scale
        H, d = config.num_heads, config.hidden_size
        qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        buffer = lambda *shape: nn.Buffer(torch.empty(*shape, dtype=dtype, device=device))  # noqa: E731
        if mla.q_lora_rank is None:
            self.wq = Linear(d, H * qk, False, dtype, device)  # [H qk, d] q_proj
        else:
            self.wq_a = Linear(d, mla.q_lora_rank, False, dtype, device)  # [q_lora, d]
            self.q_a_norm = buffer(mla.q_lora_rank)  # [q_lora]
            self.wq_b = Linear(mla.q_lora_rank, H * qk, False, dtype, device)  # [H qk, q_lora]
        self.wkv_a = Linear(d, mla.latent_dim, False, dtype, device)  # [C + R, d] kv_a_proj_with_mqa
        self.kv_a_norm = buffer(mla.kv_lora_rank)  # [C]
        self.w_uk = buffer(H, mla.qk_nope_head_dim, mla.kv_lora_rank)  # [H, nope, C] kv_b_proj's key rows
        self.w_uv = buffer(H, mla.v_head_dim, mla.kv_lora_rank)  # [H, V, C] kv_b_proj's value rows
        self.wo = Linear(H * mla.v_head_dim, d, False, dtype, device)  # [d, H V]

    def forward(
        self,
        x: torch.Tensor,  # [B, S, d] normed
        cos: torch.Tensor,  # [B, S, 1, R]
        sin: torch.Tensor,  # [B, S, 1, R] first half negated
        context: PagedContext,
        cache: PagedKvCache,
    ) -> torch.Tensor:
        mla = self.mla
        B, S, _ = x.shape
        if mla.q_lora_rank is None:
            q = self.wq(x)
        else:
            q = self.wq_b(rms_norm(self.wq_a(x), self.q_a_norm, LORA_NORM_EPS))  # [B, S, H qk]
        q_nope, q_rot = q.unflatten(-1, (-1, mla.qk_nope_head_dim + mla.qk_rope_head_dim)).split(
            [mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)  # [B, S, H, nope], [B, S, H, R]
        latent, k_rot = self.wkv_a(x).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)  # [B, S, C], [B, S, R]
        latent = rms_norm(latent, self.kv_a_norm, LORA_NORM_EPS)
        q_rot = rotate(q_rot, cos, sin, mla.rope_pairs)
        k_rot = rotate(k_rot[:, :, None], cos, sin, mla.rope_pairs)  # [B, S, 1, R]
        entry = torch.cat((latent[:, :, None], k_rot), dim=-1)  # [B, S, 1, C + R]
        cache.store(self.index, context.slots, entry, entry[..., :0])  # the latent alone: no V
        q_latent = torch.einsum("bshn,hnc->bshc", q_nope, self.w_uk)  # [B, S, H, C] W_UK absorbed
        out = latent_attention(torch.cat((q_latent, q_rot), dim=-1), cache, self.index, context, self.scale,
                               mla.kv_lora_rank)  # [B, S, H, C]
        out = torch.einsum("bshc,hvc->bshv", out, self.w_uv)  # [B, S, H, V] W_UV after the attention
        return self.wo(out.reshape(B, S, -1))
