"""Writes pdserve KV pieces into vLLM's paged KV cache through each attention layer's own kernel.

vLLM's backends lay K and V out differently inside a layer's cache tensor (CUDA FlashAttention keeps
K|V side by side per token, the CPU backend K rows then V rows per block and head, in an ISA-specific
tiling). Rather than assume one, `PagedKvWriter` hands each piece to the layer's
`impl.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)`, the call vLLM itself makes for the
tokens it computes, so a piece lands exactly where that backend's attention reads it.
With tensor parallelism each rank writes its own slice of kv heads (`staging.kv_head_range`).
Token t of a request lives in block `block_ids[t // B]` at offset `t % B`: slot `block * B + offset`.
"""

from __future__ import annotations

import torch

from pdserve.kvcache.codec import KvPiece
from pdserve.server.decode.kv_cache import numpy_to_torch


class PagedKvWriter:
    def __init__(self, layers: list, caches: list[torch.Tensor], block_size: int, dtype: torch.dtype):
        """layers[i] is vLLM's attention module of decoder layer i; caches[i] its registered KV tensor."""
        for layer in layers:
            if getattr(layer.attn_backend, "forward_includes_kv_cache_update", True) or not hasattr(
                layer.impl, "do_kv_cache_update"
            ):
                raise ValueError(
                    f"vLLM's attention backend {layer.attn_backend.get_name()} writes its KV cache only inside "
                    "its forward; pdserve's connector needs a backend with do_kv_cache_update (CPU_ATTN, "
                    "FLASH_ATTN, TRITON_ATTN)"
                )
        self.layers = layers
        self.caches = caches
        self.block_size = block_size
        self.dtype = dtype
        self.device = caches[0].device

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def write(self, block_ids: list[int], piece: KvPiece) -> None:
        k, v = numpy_to_torch(piece.k), numpy_to_torch(piece.v)  # [l, n, Hkv, D]
        if k.dtype != self.dtype:
            raise ValueError(f"the piece holds {k.dtype} KV, vLLM computes in {self.dtype}")
        if piece.layer_start + piece.num_layers > self.num_layers:
            raise ValueError(f"piece layers {piece.layer_start}+{piece.num_layers} exceed vLLM's {self.num_layers}")
        heads = getattr(self.layers[0].impl, "num_kv_heads", k.shape[2])
        if k.shape[2] != heads:
            raise ValueError(f"the piece holds {k.shape[2]} kv heads, this rank's attention {heads}")
        tokens = torch.arange(piece.token_start, piece.token_start + piece.num_tokens)  # [n]
        if int(tokens[-1]) // self.block_size >= len(block_ids):
            raise ValueError(f"piece tokens up to {int(tokens[-1])} exceed the request's {len(block_ids)} blocks")
        blocks = torch.tensor(block_ids, dtype=torch.int64)[tokens // self.block_size]
        slots = (blocks * self.block_size + tokens % self.block_size).to(self.device)  # [n]
        k, v = k.to(self.device), v.to(self.device)
        for i in range(piece.num_layers):
            layer = self.layers[piece.layer_start + i]
            layer.impl.do_kv_cache_update(layer, k[i], v[i], self.caches[piece.layer_start + i], slots)
