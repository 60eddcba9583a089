"""Writes pdserve KV pieces into vLLM's paged KV cache through each attention layer's own kernel.

vLLM's backends lay K and V out differently inside a layer's cache tensor (CUDA FlashAttention keeps
K|V side by side per token, the CPU backend K rows then V rows per block and head, in an ISA-specific
tiling). Rather than assume one, `PagedKvWriter` hands each piece to the layer's
`impl.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)`, the call vLLM itself makes for the
tokens it computes, so a piece lands exactly where that backend's attention reads it.
With tensor parallelism each rank writes its own slice of kv heads (`staging.kv_head_range`).

vLLM keeps one block table per KV cache group: all layers in one group for most models, the full-attention
and the sliding-window layers in groups of their own under its hybrid allocator (Gemma 2/3). A layer's
token t lives in its group's block `block_ids[group][t // B]` at offset `t % B`: slot `block * B + offset`.
A sliding-window group's leading blocks behind the window are vLLM's null block (NULL_BLOCK): the prefill
tier sent nothing for them (`KvLayout.stale_tokens`, the same rule) and nothing is written there.
"""

from __future__ import annotations

import torch

from pdserve.kvcache.codec import KvPiece
from pdserve.server.decode.kv_cache import numpy_to_torch

NULL_BLOCK = 0
"""vLLM's null block (its block pool's first): a placeholder in a table, never read, never written."""


class PagedKvWriter:
    def __init__(self, layers: list, caches: list[torch.Tensor], block_sizes: list[int], dtype: torch.dtype,
                 groups: list[int] | None = None):
        """layers[i] is vLLM's attention module of decoder layer i, caches[i] its registered KV tensor,
        groups[i] the KV cache group it belongs to (default: all in group 0), block_sizes[g] group g's."""
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
        self.groups = groups or [0] * len(layers)
        self.block_sizes = block_sizes
        self.dtype = dtype
        self.device = caches[0].device

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def write(self, block_ids: tuple[list[int], ...], piece: KvPiece, skip_tokens: int = 0) -> None:
        """Writes every layer of the piece into its group's blocks (block_ids[g]: group g's, in token order), but
        its tokens before skip_tokens (held in vLLM's prefix cache already)."""
        k, v = numpy_to_torch(piece.k), numpy_to_torch(piece.v)  # [l, n, Hkv, D]
        if k.dtype != self.dtype:
            raise ValueError(f"the piece holds {k.dtype} KV, vLLM computes in {self.dtype}")
        if piece.layer_start + piece.num_layers > self.num_layers:
            raise ValueError(f"piece layers {piece.layer_start}+{piece.num_layers} exceed vLLM's {self.num_layers}")
        heads = getattr(self.layers[0].impl, "num_kv_heads", k.shape[2])
        if k.shape[2] != heads:
            raise ValueError(f"the piece holds {k.shape[2]} kv heads, this rank's attention {heads}")
        tokens = torch.arange(piece.token_start, piece.token_start + piece.num_tokens)  # [n]
        k, v = k.to(self.device), v.to(self.device)
        slots_of: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # group -> (slots, which tokens)
        for i in range(piece.num_layers):
            layer = piece.layer_start + i
            group = self.groups[layer]
            if group not in slots_of:
                slots_of[group] = self._slots(block_ids[group], self.block_sizes[group], tokens, layer, skip_tokens)
            slots, keep = slots_of[group]
            if not len(slots):
                continue
            impl = self.layers[layer].impl
            impl.do_kv_cache_update(self.layers[layer], k[i, keep], v[i, keep], self.caches[layer], slots)

    def _slots(self, blocks: list[int], block_size: int, tokens: torch.Tensor, layer: int,
               skip_tokens: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(slots [m], the piece's token indices [m] they hold): the tokens from skip_tokens on in real blocks (a
        null block is behind the layer's window: vLLM never reads it)."""
        if int(tokens[-1]) // block_size >= len(blocks):
            raise ValueError(f"piece tokens up to {int(tokens[-1])} exceed the request's {len(blocks)} blocks "
                             f"(layer {layer})")
        table = torch.tensor(blocks, dtype=torch.int64)[tokens // block_size]  # [n]
        keep = torch.nonzero((table != NULL_BLOCK) & (tokens >= skip_tokens)).flatten()  # [m]
        slots = table[keep] * block_size + tokens[keep] % block_size
        return slots.to(self.device), keep.to(self.device)
