"""The decode tier's paged KV cache: physical K/V storage, indexed by the block ids of `kvcache` tables.

Token t of a request lives in block `block_table[t // block_size]` at offset `t % block_size`; its
flat slot is `block_id * block_size + offset`. The model stores and gathers through `store`/`gather`,
the transfer receiver writes prompt KV through `write`; a quantized dtype would convert in those three.
"""

from __future__ import annotations

import numpy as np
import torch

from kvcache.layout import KvLayout

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
_SAME_SIZE_INT: dict[int, tuple[type, torch.dtype]] = {
    1: (np.int8, torch.int8),
    2: (np.int16, torch.int16),
    4: (np.int32, torch.int32),
}


def numpy_to_torch(array: np.ndarray) -> torch.Tensor:
    """A CPU tensor with the same bits and dtype (bfloat16 included, which torch.from_numpy lacks)."""
    dtype = TORCH_DTYPES.get(array.dtype.name)
    if dtype is None:
        raise ValueError(f"dtype {array.dtype.name} is not one of {', '.join(TORCH_DTYPES)}")
    array = np.ascontiguousarray(array)
    if not array.flags.writeable:  # torch.from_numpy warns on read-only memory (memmaps, wire buffers)
        array = array.copy()
    np_int, torch_int = _SAME_SIZE_INT[array.dtype.itemsize]
    return torch.from_numpy(array.view(np_int)).view(torch_int).view(dtype)


class PagedKvCache:
    def __init__(self, layout: KvLayout, num_blocks: int, device: str | torch.device = "cpu"):
        if layout.dtype not in TORCH_DTYPES:
            raise ValueError(f"the torch KV cache holds {', '.join(TORCH_DTYPES)}, not {layout.dtype}")
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.layout = layout
        self.num_blocks = num_blocks
        self.block_size = layout.block_size
        self.dtype = TORCH_DTYPES[layout.dtype]
        shape = (layout.num_layers, num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
        self.k = torch.zeros(shape, dtype=self.dtype, device=device)  # [L, N, bs, Hkv, D]
        self.v = torch.zeros(shape, dtype=self.dtype, device=device)  # [L, N, bs, Hkv, D]

    @property
    def device(self) -> torch.device:
        return self.k.device

    @staticmethod
    def num_blocks_for_budget(layout: KvLayout, budget_bytes: int) -> int:
        return budget_bytes // (layout.bytes_per_token * layout.block_size)

    def write(
        self, block_table: list[int], layer_start: int, token_start: int, k: np.ndarray, v: np.ndarray
    ) -> None:
        """Copies k, v [l, n, Hkv, D] bit-exactly to tokens [token_start, +n) of layers [layer_start, +l)."""
        layout = self.layout
        heads = (layout.num_kv_heads, layout.head_dim)
        if k.shape != v.shape or k.ndim != 4 or k.shape[2:] != heads:
            raise ValueError(f"k {k.shape} and v {v.shape} must both be [layers, tokens, *{heads}]")
        if k.dtype != layout.np_dtype or v.dtype != layout.np_dtype:
            raise ValueError(f"k/v are {k.dtype}/{v.dtype}; this cache holds {layout.dtype}")
        num_layers, n = k.shape[:2]
        if layer_start < 0 or layer_start + num_layers > layout.num_layers:
            raise ValueError(
                f"layers [{layer_start}, {layer_start + num_layers}) outside [0, {layout.num_layers})"
            )
        if token_start % self.block_size:
            raise ValueError(f"token_start {token_start} is not a multiple of block size {self.block_size}")
        if (needed := layout.num_blocks(token_start + n)) > len(block_table):
            raise ValueError(f"{token_start + n} tokens need {needed} blocks; table has {len(block_table)}")
        tokens = torch.arange(token_start, token_start + n)  # [n]
        blocks = torch.tensor(block_table, dtype=torch.int64)[tokens // self.block_size]  # [n]
        slots = (blocks * self.block_size + tokens % self.block_size).to(self.device)  # [n]
        layers = slice(layer_start, layer_start + num_layers)
        self.k[layers].flatten(1, 2)[:, slots] = numpy_to_torch(k).to(self.device)  # [l, n, Hkv, D]
        self.v[layers].flatten(1, 2)[:, slots] = numpy_to_torch(v).to(self.device)

    def read(self, block_table: list[int], num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [L, T, Hkv, D] of a request's first num_tokens tokens (a copy)."""
        table = block_table[: self.layout.num_blocks(num_tokens)]
        blocks = torch.tensor(table, dtype=torch.int64, device=self.device)
        L, _, _, H, D = self.k.shape
        k = self.k[:, blocks].reshape(L, -1, H, D)[:, :num_tokens]  # [L, T, Hkv, D]
        v = self.v[:, blocks].reshape(L, -1, H, D)[:, :num_tokens]
        return k, v

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Writes k, v [N, Hkv, D] of one layer at flat slots [N] (block_id * block_size + offset)."""
        self.k[layer].flatten(0, 1)[slots] = k.to(self.dtype)
        self.v[layer].flatten(0, 1)[slots] = v.to(self.dtype)

    def gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [B, M * block_size, Hkv, D] of one layer for block tables [B, M]."""
        k = self.k[layer][block_tables]  # [B, M, bs, Hkv, D]
        v = self.v[layer][block_tables]
        return k.flatten(1, 2), v.flatten(1, 2)
