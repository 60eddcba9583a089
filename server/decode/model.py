"""The decoder-only transformer (llama, mistral, qwen2, qwen3, gemma2, gemma3) in plain torch, over a paged
KV cache.
A layer with a sliding window attends through its context's `local` view (only the window's blocks).

Every forward writes the new tokens' K (post-RoPE, HF rotate_half convention) and V into the cache,
then attends over the cache, so prompt KV computed here and KV received from the prefill tier are read
the same way. A forward given `LoraRows` adds each row's LoRA adapter delta to every matmul it targets
(`lora.py`: base rows get exactly zero). Numerics follow transformers: RMSNorm in fp32, RoPE cos/sin from fp32 frequencies.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.server.decode.attention import PagedContext, paged_attention
from pdserve.server.decode.cuda_attention import takes
from pdserve.server.decode.kv_cache import PagedKvCache
from pdserve.server.decode.lora import LoraRows
from pdserve.server.decode.moe import MoeMlp
from pdserve.server.decode.quant import Linear, WeightFormat
from pdserve.server.model.config import ModelConfig
from pdserve.server.model.rope import inv_freq


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [.., D] rotated in HF's rotate_half convention, x cos + rotate_half(x) sin, with `sin` given as
    `rope_tables` makes it (its first half negated): rotate_half(x) sin = roll(x, D / 2) sin then, the
    same values bit for bit (a sign moves from x to sin), in 4 ops instead of 6."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype, attention_factor: float = 1.0
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin with its first half negated) [B, S, 1, D] in dtype for positions [B, S], from fp32 angles
    as transformers computes them, both multiplied by attention_factor (YaRN's) in fp32 when it is not 1."""
    freqs = positions[..., None].float() * inv_freq.float()  # [B, S, D / 2]
    cos = torch.cat((freqs, freqs), dim=-1).cos()  # [B, S, D]
    sin = freqs.sin()  # [B, S, D / 2]
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos.to(dtype)[:, :, None], torch.cat((-sin, sin), dim=-1).to(dtype)[:, :, None]


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int, dtype: torch.dtype,
                 device: torch.device | str | None = None):
        """Empty buffers of the layer's shapes; `weights.load_weights` fills them."""
        super().__init__()
        self.config = config
        self.index = index
        self.window = config.window(index)
        H, Hkv, D, d, inter = config.num_heads, config.num_kv_heads, config.head_dim, config.hidden_size, \
            config.intermediate_size
        norm = lambda n: nn.Buffer(torch.empty(n, dtype=dtype, device=device))  # noqa: E731
        self.wqkv = Linear(d, (H + 2 * Hkv) * D, config.qkv_bias, dtype, device)  # [(H + 2 Hkv) D, d]
        self.qk_norm = nn.Buffer(torch.empty(H + Hkv, D, dtype=dtype, device=device)) if config.qk_norm else None
        """[H + Hkv, D]: q_norm's weight for each query head, then k_norm's for each kv head (one norm over
        q and k together)."""
        self.wo = Linear(H * D, d, False, dtype, device)  # [d, H D]
        if config.moe is None:
            self.w_gate_up = Linear(d, 2 * inter, False, dtype, device)  # [2 I, d]
            self.w_down = Linear(inter, d, False, dtype, device)  # [d, I]
        self.experts = None if config.moe is None else MoeMlp(config.moe, d, config.hidden_act, dtype, device)
        self.attn_norm = norm(d)  # [d]
        self.mlp_norm = norm(d)  # [d]
        self.attn_post_norm = norm(d) if config.sandwich_norms else None  # [d] Gemma: on the attention's output
        self.mlp_post_norm = norm(d) if config.sandwich_norms else None  # [d] Gemma: on the MLP's output
        self.local_rope = config.local_rope is not None and self.window is not None
        """It reads the model's second RoPE table (Gemma 3's local layers)."""

    def forward(
        self,
        x: torch.Tensor,  # [B, S, d]
        cos: torch.Tensor,  # [B, S, 1, D]
        sin: torch.Tensor,  # [B, S, 1, D] first half negated (`rope_tables`)
        context: PagedContext,
        cache: PagedKvCache,
        lora: LoraRows | None = None,
    ) -> torch.Tensor:
        c = self.config
        B, S, _ = x.shape
        eps = c.rms_norm_eps
        h = rms_norm(x, self.attn_norm, eps)
        qkv = self._linear("wqkv", h, lora)  # [B, S, (H + 2 Hkv) D]
        H, Hkv, D = c.num_heads, c.num_kv_heads, c.head_dim
        qk, v = qkv.unflatten(-1, (H + 2 * Hkv, D)).split([H + Hkv, Hkv], dim=2)  # [B, S, H + Hkv | Hkv, D]
        if self.qk_norm is not None:
            qk = rms_norm(qk, self.qk_norm, eps)
        q, k = rope(qk, cos, sin).split([H, Hkv], dim=2)  # [B, S, H, D], [B, S, Hkv, D]

        cache.store(self.index, context.slots, k, v)
        view = context if self.window is None else context.local  # a windowed layer reads only its window
        out = paged_attention(q, cache, self.index, view, c.scale, c.attn_softcap)  # [B, S, H, D]
        attn = self._linear("wo", out.reshape(B, S, -1), lora)
        x = x + (attn if self.attn_post_norm is None else rms_norm(attn, self.attn_post_norm, eps))

        h = rms_norm(x, self.mlp_norm, eps)
        if self.experts is not None:
            mlp = self.experts(h)  # [B, S, d]
        else:
            gate, up = self._linear("w_gate_up", h, lora).chunk(2, dim=-1)  # [B, S, I] each
            act = F.silu(gate) if c.hidden_act == "silu" else F.gelu(gate, approximate="tanh")
            mlp = self._linear("w_down", act * up, lora)
        return x + (mlp if self.mlp_post_norm is None else rms_norm(mlp, self.mlp_post_norm, eps))

    def _linear(self, name: str, x: torch.Tensor, lora: LoraRows | None) -> torch.Tensor:
        """The matmul `name` of x [B, S, in], each row's LoRA delta added when the forward has adapters."""
        y = getattr(self, name)(x)
        return y if lora is None else lora.apply(self.index, name, x, y)


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None):
        """The model's shapes from its config, in the compute dtype on the device, holding no weights yet:
        `weights.load_weights(model, tensors)` fills them, `quant.quantize(model, fmt)` may follow."""
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.weight_format: WeightFormat | None = None
        V, d = config.vocab_size, config.hidden_size
        self.embed = nn.Buffer(torch.empty(V, d, dtype=dtype, device=device))  # [V, d]
        tied = config.tie_word_embeddings
        self.untied_lm_head = None if tied else nn.Buffer(torch.empty(V, d, dtype=dtype, device=device))  # [V, d]
        self.layers = nn.ModuleList(self.make_layer(config, i, dtype, device) for i in range(config.num_layers))
        self.norm = nn.Buffer(torch.empty(d, dtype=dtype, device=device))  # [d]
        self.inv_freq = nn.Buffer(torch.from_numpy(inv_freq(config)).to(device))  # [D / 2] float32
        self.local_inv_freq = None if config.local_rope is None else \
            nn.Buffer(torch.from_numpy(inv_freq(config, config.local_rope)).to(device))  # [D / 2] float32
        self.packed_head: Linear | None = None
        """The LM head in oneDNN's layout once `prepack` ran on CPU (a copy beside the embedding table)."""
        self.paged_kernel = False
        """Decode (one new token per sequence) and verify steps (k + 1) attend through the CUDA paged kernel
        (`cuda_attention`); set where the model runs, by the worker's start-up."""

    @staticmethod
    def make_layer(config: ModelConfig, index: int, dtype: torch.dtype, device: torch.device | str | None
                   ) -> nn.Module:
        """Layer `index`, empty (`DeepseekModel` makes its own)."""
        return DecoderLayer(config, index, dtype, device)

    def fuse_experts(self) -> int:
        """Every mixture-of-experts layer's step through the fused CUDA kernels (`MoeMlp.fuse`); returns how many."""
        moe = [layer.experts for layer in self.layers if layer.experts is not None]
        for experts in moe:
            experts.fuse()
        return len(moe)

    @property
    def lm_head(self) -> torch.Tensor:
        return self.embed if self.untied_lm_head is None else self.untied_lm_head

    def prepack(self, float32: bool = False) -> None:
        """On CPU, bf16/fp16 (with `float32`, fp32) linear weights reordered once for oneDNN (`Linear.prepack`):
        ~1.5x (bf16) to ~3x (fp32, 4-16 rows) the rate at which a decode step streams them. The LM head gets
        a packed copy (V x d more memory) since the embedding lookup still reads the plain table. The experts of a
        mixture whose step reads their weights as loaded (`MoeMlp.reads_plain`) stay plain. A no-op elsewhere."""
        plain = {id(m) for layer in self.layers if getattr(layer, "experts", None) is not None
                 and layer.experts.reads_plain for m in (*layer.experts.gate_up, *layer.experts.down)}
        for module in self.modules():
            if isinstance(module, Linear) and id(module) not in plain:
                module.prepack(float32)
        head = Linear.of(self.lm_head, None, self.dtype)
        head.prepack(float32)
        if head.packed:
            self.packed_head = head

    def _forward(
        self,
        token_ids: torch.Tensor,  # [B, S]
        context: PagedContext,
        cache: PagedKvCache,
        lora: LoraRows | None = None,
    ) -> torch.Tensor:
        c = self.config
        tables = [rope_tables(context.positions, self.inv_freq, self.dtype, c.rope.attention_factor)]  # [B, S, 1, D] x 2
        if self.local_inv_freq is not None:
            tables.append(rope_tables(context.positions, self.local_inv_freq, self.dtype))
        x = F.embedding(token_ids, self.embed)  # [B, S, d]
        if c.embed_scale is not None:
            x = x * torch.tensor(c.embed_scale, dtype=x.dtype)
        for layer in self.layers:
            x = layer(x, *tables[layer.local_rope], context, cache, lora)
        x = rms_norm(x, self.norm, c.rms_norm_eps)
        logits = (F.linear(x, self.lm_head) if self.packed_head is None else self.packed_head(x)).float()  # [B, S, V]
        cap = c.final_softcap
        return logits if cap is None else cap * torch.tanh(logits / cap)

    def _context(self, positions: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                 cache: PagedKvCache, kernel: bool = False) -> PagedContext:
        """kernel: attend through the CUDA paged kernel when `paged_kernel` is set and it takes the shape
        (decode and verify steps; a prefill never)."""
        c = self.config
        groups = c.num_heads // c.num_kv_heads
        return PagedContext.build(positions, block_tables, context_lens, cache.block_size, self.embed.device,
                                  self.dtype, groups=groups,
                                  paged_kernel=kernel and self.paged_kernel and takes(positions.shape[1], groups)
                                  and (c.mla is None or positions.shape[1] == 1),  # MLA: `cuda_mla`, decode
                                  window=c.sliding_window if c.layer_windows else None)

    @torch.inference_mode()
    def prefill(
        self, token_ids: torch.Tensor, block_table: list[int], cache: PagedKvCache, start_pos: int = 0,
        lora: LoraRows | None = None,
    ) -> torch.Tensor:
        """Logits f32 [S, V] of S new tokens of one sequence whose first start_pos tokens are cached (lora: its
        adapter, one row)."""
        total = start_pos + token_ids.shape[0]
        num_blocks = -(-total // cache.block_size)
        if num_blocks > len(block_table):
            raise ValueError(f"{total} tokens need {num_blocks} blocks; the table has {len(block_table)}")
        table = torch.tensor(block_table[:num_blocks], dtype=torch.int64)[None]  # [1, M]
        positions = torch.arange(start_pos, total)[None]  # [1, S]
        context = self._context(positions, table, torch.tensor([total]), cache)
        return self._forward(token_ids.to(self.embed.device)[None], context, cache, lora)[0]

    @torch.inference_mode()
    def decode(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        cache: PagedKvCache,
        lora: LoraRows | None = None,
    ) -> torch.Tensor:
        """Logits f32 [B, V] of one new token per sequence, at positions [B], attending context_lens [B]; lora:
        each row's adapter (`LoraSlots.rows`).

        Only the blocks the contexts hold are read: tables and lengths given on the host are cut there to
        the longest context (see `PagedContext.build`), whatever width the tables have.
        """
        context = self._context(positions[:, None], block_tables, context_lens, cache, kernel=True)
        return self._forward(token_ids.to(self.embed.device)[:, None], context, cache, lora)[:, 0]

    @torch.inference_mode()
    def verify(
        self,
        token_ids: torch.Tensor,  # [B, S]
        positions: torch.Tensor,  # [B, S]
        block_tables: torch.Tensor,  # [B, M]
        context_lens: torch.Tensor,  # [B]
        cache: PagedKvCache,
        pad_slots: torch.Tensor | None = None,  # [B, S] bool
        pad_slot: int = 0,
    ) -> torch.Tensor:
        """Logits f32 [B, S, V] of S new tokens per sequence (speculative decoding's verify step: the last
        token and the proposals after it), causal over the new positions, attending context_lens [B]. Entries
        marked in `pad_slots` (rows with fewer new tokens) write their K/V at the cache slot `pad_slot`, which
        no sequence reads; their logits mean nothing. With `paged_kernel` the CUDA paged kernel attends them
        (each entry masked at its position), as it does decode's one token."""
        context = self._context(positions, block_tables, context_lens, cache, kernel=True)
        if pad_slots is not None:
            slots = context.slots.masked_fill(pad_slots.to(context.slots.device, torch.bool), pad_slot)  # [B, S]
            context = dataclasses.replace(context, slots=slots)
        return self._forward(token_ids.to(self.embed.device), context, cache)
