"""The decode tier's paged KV cache: physical K/V storage, indexed by the block ids of `kvcache` tables.

Token t of a request lives in block `block_table[t // block_size]` at offset `t % block_size`; its
flat slot is `block_id * block_size + offset`. The model stores through `store` and attention reads
a batch's context blocks through `context_blocks`; the transfer receiver writes prompt KV through `write`.

An MLA model's cache (`KvLayout.latent`) holds one latent per token and layer in `k` ([.., 1, latent]); `v` is
empty ([.., 1, 0]: no bytes), and so are its scales, so every path below moves the latent alone.

Quantized caches (fp8_e4m3, int8) hold one float32 scale per block per kv head beside the blocks
(`k_scales`, `v_scales` [L, N, Hkv]; x ≈ q * scale, as `kvcache.quant` defines). `write` stores the
prefill tier's bytes and scales as they came, never re-quantizing them. `store` quantizes the tokens
decode computes itself: a block's scale starts at the first token written at offset 0 and grows when
a later token exceeds its range (the block's earlier values are then re-expressed in the larger scale,
a rare event: the absmax of K/V varies little along a block). `context_blocks` and `gather` dequantize
in float32.
"""

from __future__ import annotations

import numpy as np
import torch

from pdserve.kvcache.block_bytes import BlockKv
from pdserve.kvcache.layout import QUANTIZED, KvLayout
from pdserve.kvcache.quant import QMAX

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
QUANTIZED_TORCH_DTYPES: dict[str, torch.dtype] = {
    "fp8_e4m3": torch.float8_e4m3fn,
    "int8": torch.int8,
}
_FROM_NUMPY: dict[str, torch.dtype] = TORCH_DTYPES | {"float8_e4m3fn": torch.float8_e4m3fn, "int8": torch.int8}
_SAME_SIZE_INT: dict[int, tuple[type, torch.dtype]] = {
    1: (np.int8, torch.int8),
    2: (np.int16, torch.int16),
    4: (np.int32, torch.int32),
    8: (np.int64, torch.int64),
}


def numpy_to_torch(array: np.ndarray) -> torch.Tensor:
    """A CPU tensor with the same bits and dtype (bfloat16 and fp8 included, which torch.from_numpy lacks)."""
    dtype = _FROM_NUMPY.get(array.dtype.name)
    if dtype is None:
        raise ValueError(f"dtype {array.dtype.name} is not one of {', '.join(_FROM_NUMPY)}")
    array = np.ascontiguousarray(array)
    if not array.flags.writeable:  # torch.from_numpy warns on read-only memory (memmaps, wire buffers)
        array = array.copy()
    np_int, torch_int = _SAME_SIZE_INT[array.dtype.itemsize]
    return torch.from_numpy(array.view(np_int)).view(torch_int).view(dtype)


def _bits(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor's memory as same-width integers (numpy has no bf16/fp8)."""
    np_int, torch_int = _SAME_SIZE_INT[tensor.element_size()]
    return tensor.view(torch_int).numpy()


def _pinned(array: np.ndarray) -> torch.Tensor:
    """A copy of the array in pinned (page-locked) host memory, same bits and dtype: the source of a fast
    non-blocking copy onto a CUDA device."""
    dtype = _FROM_NUMPY[array.dtype.name] if array.dtype.name in _FROM_NUMPY else torch.from_numpy(array[:0]).dtype
    staged = torch.empty(array.shape, dtype=dtype, pin_memory=True)
    _bits(staged)[...] = np.ascontiguousarray(array).view(_bits(staged).dtype)
    return staged


def _value_heads(layout: KvLayout) -> int:
    """V's heads, and so V's scales per block: none for a latent."""
    return 0 if layout.latent else layout.num_kv_heads


def _blocks(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """One layer's blocks [N, ...] at block_tables [B, M] -> [B, M, ...] (index_select: ~1.8x advanced indexing's
    speed on the CPU at a decode step's sizes)."""
    return cache.index_select(0, block_tables.flatten()).view(*block_tables.shape, *cache.shape[1:])


def _runs(block_ids: list[int]) -> list[tuple[int, int, int]]:
    """(index of the first, length, first block id) of each run of consecutive block ids."""
    runs: list[tuple[int, int, int]] = []
    for i, block_id in enumerate(block_ids):
        if runs and block_id == runs[-1][2] + runs[-1][1] and i == runs[-1][0] + runs[-1][1]:
            start, length, first = runs[-1]
            runs[-1] = (start, length + 1, first)
        else:
            runs.append((i, 1, block_id))
    return runs


class PagedKvCache:
    def __init__(self, layout: KvLayout, num_blocks: int, device: str | torch.device = "cpu"):
        if layout.dtype not in TORCH_DTYPES | QUANTIZED_TORCH_DTYPES:
            raise ValueError(
                f"the torch KV cache holds {', '.join(TORCH_DTYPES | QUANTIZED_TORCH_DTYPES)}, not {layout.dtype}"
            )
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.layout = layout
        self.num_blocks = num_blocks
        self.block_size = layout.block_size
        self.quantized = layout.dtype in QUANTIZED
        self.dtype = (TORCH_DTYPES | QUANTIZED_TORCH_DTYPES)[layout.dtype]
        shape = (layout.num_layers, num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
        self.k = torch.zeros(shape, dtype=self.dtype, device=device)  # [L, N, bs, Hkv, D]
        self.v = torch.zeros(*shape[:-1], layout.value_dim, dtype=self.dtype, device=device)  # [L, N, bs, Hkv, D | 0]
        self._k_slots, self._v_slots = (t.flatten(1, 2) for t in (self.k, self.v))  # [L, N bs, Hkv, D] views
        self._copy_stream = torch.cuda.Stream(device) if torch.device(device).type == "cuda" else None
        """CUDA: where received KV is copied onto the device (`_write_device`)."""
        self.k_scales: torch.Tensor | None = None  # [L, N, Hkv] float32, quantized dtypes only
        self.v_scales: torch.Tensor | None = None
        if self.quantized:
            self.qmax = QMAX[layout.dtype]
            scale_shape = (layout.num_layers, num_blocks, layout.num_kv_heads)
            self.k_scales = torch.zeros(scale_shape, dtype=torch.float32, device=device)
            self.v_scales = torch.zeros(*scale_shape[:-1], _value_heads(layout), dtype=torch.float32, device=device)

    @property
    def device(self) -> torch.device:
        return self.k.device

    @staticmethod
    def bytes_per_block(layout: KvLayout) -> int:
        """K and V of one block over all layers, plus its float32 scales (2 x L x Hkv x 4 bytes; a latent's
        L x 4) when quantized."""
        heads = layout.num_kv_heads + _value_heads(layout)
        scales = heads * layout.num_layers * 4 if layout.dtype in QUANTIZED else 0
        return layout.bytes_per_token * layout.block_size + scales

    @staticmethod
    def num_blocks_for_budget(layout: KvLayout, budget_bytes: int) -> int:
        return budget_bytes // PagedKvCache.bytes_per_block(layout)

    @property
    def nbytes(self) -> int:
        scales = 0 if self.k_scales is None else self.k_scales.nbytes + self.v_scales.nbytes
        return self.k.nbytes + self.v.nbytes + scales

    def write(
        self,
        block_table: list[int],
        layer_start: int,
        token_start: int,
        k: np.ndarray,
        v: np.ndarray,
        k_scales: np.ndarray | None = None,
        v_scales: np.ndarray | None = None,
    ):
        """Copies k, v [l, n, Hkv, D] bit-exactly to tokens [token_start, +n) of layers [layer_start, +l).

        On the CPU the copy is done on return (None); on CUDA it is in flight: the CUDA event returned
        follows it (`_write_device`).

        Quantized caches take the pieces' scales [l, ceil(n / block_size), Hkv] too, stored as they are.
        """
        layout = self.layout
        heads = (layout.num_kv_heads, layout.head_dim)
        v_heads = (layout.num_kv_heads, layout.value_dim)
        if k.shape[:2] != v.shape[:2] or k.ndim != 4 or k.shape[2:] != heads or v.shape[2:] != v_heads:
            both = f"must both be [layers, tokens, *{heads}]" if not layout.latent else \
                f"must be [layers, tokens, *{heads}] and [layers, tokens, *{v_heads}] (a latent has no V)"
            raise ValueError(f"k {k.shape} and v {v.shape} {both}")
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
        layers = slice(layer_start, layer_start + num_layers)
        if self.quantized:
            covered = layout.num_blocks(n)
            for name, scales, count in (("k_scales", k_scales, layout.num_kv_heads),
                                        ("v_scales", v_scales, _value_heads(layout))):
                scale_shape = (num_layers, covered, count)
                if scales is None or scales.shape != scale_shape or scales.dtype != np.float32:
                    got = "nothing" if scales is None else f"{scales.dtype} {scales.shape}"
                    raise ValueError(f"{layout.dtype} KV needs {name} float32 {scale_shape}, got {got}")
        elif k_scales is not None or v_scales is not None:
            raise ValueError(f"{layout.dtype} KV takes no scales")
        first = token_start // self.block_size
        runs = _runs(block_table[first : first + layout.num_blocks(n)])
        if self.device.type != "cpu":
            return self._write_device(layers, runs, n, k, v, block_table[first : first + layout.num_blocks(n)],
                                      k_scales, v_scales)
        if self.quantized:
            block_ids = torch.tensor(block_table[first : first + layout.num_blocks(n)], dtype=torch.int64)
            self.k_scales[layers, block_ids] = torch.from_numpy(np.array(k_scales))
            self.v_scales[layers, block_ids] = torch.from_numpy(np.array(v_scales))
        for cache, src in ((self.k, k), (self.v, v)):
            # On CPU, numpy copies (a plain memcpy): torch's multi-threaded copy_ collapses when the
            # cores are busy with other work, and this runs beside the decode loop.
            dst = _bits(cache)[layers].reshape(num_layers, self.num_blocks * self.block_size, *src.shape[2:])  # a view
            # [l, N * bs, Hkv, D]
            src = np.ascontiguousarray(src).view(dst.dtype)
            # Whole runs of consecutive block ids are one strided copy each (no scatter, no index tensor).
            for run_start, run_len, block_id in runs:
                t0, t1 = run_start * self.block_size, min((run_start + run_len) * self.block_size, n)
                slot = block_id * self.block_size
                dst[:, slot : slot + t1 - t0] = src[:, t0:t1]
        return None

    def _write_device(self, layers: slice, runs: list[tuple[int, int, int]], n: int, k: np.ndarray, v: np.ndarray,
                      block_ids: list[int], k_scales: np.ndarray | None, v_scales: np.ndarray | None):
        """`write` onto an accelerator: the piece is copied (a memcpy, in the caller's thread) into pinned host
        memory, then onto the device with non-blocking copies on the cache's copy stream. Returns the CUDA
        event that follows the copies: a step that reads these blocks waits for it on the device (no host
        wait); torch's pinned allocator keeps the staging memory until the copies are done."""
        with torch.cuda.stream(self._copy_stream):
            if self.quantized:
                ids = _pinned(np.asarray(block_ids, dtype=np.int64)).to(self.device, non_blocking=True)
                self.k_scales[layers, ids] = _pinned(k_scales).to(self.device, non_blocking=True)
                self.v_scales[layers, ids] = _pinned(v_scales).to(self.device, non_blocking=True)
            for cache, src in ((self.k, k), (self.v, v)):
                dst, staged = cache[layers].flatten(1, 2), _pinned(src)  # [l, N * bs, Hkv, D], [l, n, Hkv, D]
                # One contiguous copy per layer and run of blocks: a strided one would go through pageable memory.
                for layer in range(dst.shape[0]):
                    for run_start, run_len, block_id in runs:
                        t0, t1 = run_start * self.block_size, min((run_start + run_len) * self.block_size, n)
                        slot = block_id * self.block_size
                        dst[layer, slot : slot + t1 - t0].copy_(staged[layer, t0:t1], non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self._copy_stream)
        return copied

    def block_bytes(self, block_ids: list[int]) -> list[bytes]:
        """Each block's bytes as the offload tiers hold them (`kvcache.block_bytes`): one copy off the device."""
        ids = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        k, v = (_bits(t[:, ids].transpose(0, 1).contiguous().cpu()) for t in (self.k, self.v))  # [n, L, bs, Hkv, D]
        if not self.quantized:
            return [k[i].tobytes() + v[i].tobytes() for i in range(len(block_ids))]
        ks, vs = (t[:, ids].transpose(0, 1).contiguous().cpu().numpy() for t in (self.k_scales, self.v_scales))
        return [k[i].tobytes() + v[i].tobytes() + ks[i].tobytes() + vs[i].tobytes() for i in range(len(block_ids))]

    def copy_block(self, src: int, dst: int) -> None:
        """Block dst's KV (every layer, scales too) becomes block src's: a kept tail's copy on write."""
        for t in (self.k, self.v) if self.k_scales is None else (self.k, self.v, self.k_scales, self.v_scales):
            t[:, dst] = t[:, src]

    def write_block(self, block_id: int, block: BlockKv):
        """Writes one block's KV (and scales) as an offload tier gave it back; `write`'s return."""
        scales = (None, None) if not self.quantized else (block.k_scales[:, None], block.v_scales[:, None])
        return self.write([block_id], 0, 0, block.k, block.v, *scales)

    def read(self, block_table: list[int], num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [L, T, Hkv, D] of a request's first num_tokens tokens (a copy; a latent's V [L, T, 1, 0])."""
        table = block_table[: self.layout.num_blocks(num_tokens)]
        blocks = torch.tensor(table, dtype=torch.int64, device=self.device)
        L, _, _, H, D = self.k.shape
        k = self.k[:, blocks].reshape(L, -1, H, D)[:, :num_tokens]  # [L, T, Hkv, D]
        v = self.v[:, blocks].flatten(1, 2)[:, :num_tokens]  # [L, T, Hkv, D | 0]
        return k, v

    def read_scales(self, block_table: list[int], num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V scales [L, ceil(num_tokens / block_size), Hkv] of a quantized cache (a copy)."""
        if not self.quantized:
            raise ValueError(f"a {self.layout.dtype} cache has no scales")
        blocks = torch.tensor(block_table[: self.layout.num_blocks(num_tokens)], dtype=torch.int64)
        return self.k_scales[:, blocks.to(self.device)], self.v_scales[:, blocks.to(self.device)]

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Writes k, v [..., Hkv, D] of one layer at flat slots [...] (block_id * block_size + offset).

        slots [B, S]: each row the consecutive positions of one sequence (a forward's new tokens);
        slots [n]: any tokens, each taken as a row of its own. Quantized caches quantize here.
        """
        if not self.quantized:  # one index_put each, as the slots come ([B, S] or [n])
            k, v = k.reshape(*slots.shape, *k.shape[-2:]), v.reshape(*slots.shape, *v.shape[-2:])  # [.., Hkv, D]
            if k.dtype != self.dtype:
                k, v = k.to(self.dtype), v.to(self.dtype)
            self._k_slots[layer, slots] = k
            self._v_slots[layer, slots] = v
            return
        rows = slots if slots.ndim == 2 else slots[:, None]  # [B, S]
        k, v = k.reshape(rows.numel(), *k.shape[-2:]), v.reshape(rows.numel(), *v.shape[-2:])  # [n, Hkv, D]
        self._store_quantized(self.k[layer], self.k_scales[layer], rows, k)
        if not self.layout.latent:
            self._store_quantized(self.v[layer], self.v_scales[layer], rows, v)

    def _store_quantized(self, data: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor, x: torch.Tensor):
        """data [N, bs, Hkv, D] and scales [N, Hkv] of one layer; x [B S, Hkv, D] for slots rows [B, S].

        Per token, duplicate block ids reduced by scatter_reduce_, so that nothing here needs the set of
        touched blocks on the host (no unique, no boolean indexing: no host sync). Only a row's first
        block can hold earlier values (the row's later blocks start at offset 0), so only it is
        re-expressed when its scale grows.
        """
        B, S = rows.shape
        slots = rows.flatten()  # [n]
        blocks = slots // self.block_size  # [n]
        first = (slots % self.block_size == 0)[:, None]  # [n, 1] a block starts afresh at its first token
        fresh = torch.where(first, 0.0, float("inf")).expand(-1, scales.shape[1])  # [n, Hkv]
        index = blocks[:, None].expand(-1, scales.shape[1])  # [n, Hkv]
        scales.scatter_reduce_(0, index, fresh, "amin")
        lead = blocks.view(B, S)[:, 0]  # [B] each row's first block
        old = scales[lead]  # [B, Hkv] before this store
        need = x.detach().abs().amax(-1).float() / self.qmax  # [n, Hkv]
        scales.scatter_reduce_(0, index, need, "amax")
        new = scales[blocks]  # [n, Hkv]
        safe = torch.where(new > 0, new, torch.ones_like(new))
        # The earlier values of a lead block whose scale grew, re-expressed in the new scale (a ratio of 1
        # leaves the bytes as they are; a fresh block's 0 clears what its former owner left).
        ratio = old / safe.view(B, S, -1)[:, 0]  # [B, Hkv] <= 1
        data[lead] = self._quantize(data[lead].float() * ratio[:, None, :, None])
        data.flatten(0, 1)[slots] = self._quantize(x.float() / safe[..., None])

    def _quantize(self, y: torch.Tensor) -> torch.Tensor:
        """Values already divided by their scale -> the storage dtype (round to nearest, saturate)."""
        y = y.clamp(-self.qmax, self.qmax)
        return (y.round() if self.dtype == torch.int8 else y).to(self.dtype)

    def context_blocks(self, layer: int, block_tables: torch.Tensor, dtype: torch.dtype
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [B, Hkv, M * block_size, D] in dtype of one layer's blocks [B, M]: only those blocks are
        read, and a quantized cache dequantizes only them (in float32, then to dtype)."""
        k = _blocks(self.k[layer], block_tables)  # [B, M, bs, Hkv, D]
        v = _blocks(self.v[layer], block_tables)
        if self.quantized:
            k = k.float() * self.k_scales[layer][block_tables][:, :, None, :, None]  # scales [B, M, 1, Hkv, 1]
            v = v.float() * self.v_scales[layer][block_tables][:, :, None, :, None]
        if k.dtype != dtype:
            k, v = k.to(dtype), v.to(dtype)
        return k.flatten(1, 2).transpose(1, 2), v.flatten(1, 2).transpose(1, 2)  # views [B, Hkv, M bs, D]

    def gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [B, M * block_size, Hkv, D] of one layer for block tables [B, M] (float32 when quantized)."""
        k = self.k[layer][block_tables]  # [B, M, bs, Hkv, D]
        v = self.v[layer][block_tables]
        if self.quantized:
            k = k.float() * self.k_scales[layer][block_tables][:, :, None, :, None]  # scales [B, M, 1, Hkv, 1]
            v = v.float() * self.v_scales[layer][block_tables][:, :, None, :, None]
        return k.flatten(1, 2), v.flatten(1, 2)
