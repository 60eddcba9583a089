"""Paged attention over the decode tier's KV cache: the reference path (CPU, and any device without a
kernel) that the GPU paged-attention kernel (`cuda_attention`, chosen here when `paged_kernel`) is
checked against.

A forward's `PagedContext` is built once, before the first layer, from the batch's block tables and
context lengths: the new tokens' flat cache slots, the block tables cut to the blocks the longest
context uses (never the whole reservation), and the additive mask. Every layer then stores its new K/V
at `slots` and attends over `context_blocks` of the cache: only the blocks the contexts hold are read,
and a quantized cache is dequantized only for those blocks. Nothing inside a layer waits on the host.

A model with sliding-window layers (window W: the query at position p reads keys p - W < j <= p) gets a
second view, `local`: per row, only the blocks from the one holding its first query's window on, a fixed
number of them (a function of S, W and the block size alone), so a windowed layer reads about W tokens
whatever the context's length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.server.decode.kv_cache import PagedKvCache


@dataclass(frozen=True)
class PagedContext:
    """What every layer of one forward needs to find its tokens in the paged cache."""

    positions: torch.Tensor  # [B, S] int64 position of each new token
    slots: torch.Tensor  # [B, S] int64 flat cache slot of each new token (block_id * block_size + offset)
    block_tables: torch.Tensor  # [B, M] int64, M = blocks of the longest context in the batch
    context_lens: torch.Tensor  # [B] int64 tokens each row attends to (its new tokens included)
    bias: torch.Tensor | None  # [B, 1, G S, M * block_size] float: 0 where a query attends a key, -inf elsewhere
    """Rows ordered (query-head group g, new token s), as `paged_attention` lays out the queries; None
    with `paged_kernel`, which masks each new token at its own position itself."""
    paged_kernel: bool = False
    """A few new tokens per row (decode: one; a verify step: k + 1), attended by the CUDA paged kernel
    (`cuda_attention`) straight from the cache, each masked at its own position."""
    window: int = 0
    """The sliding window this view masks by (0: none); the kernel reads it too."""
    local: PagedContext | None = None
    """The view of the model's windowed layers (None when it has none): its block_tables [B, Mw] start at
    each row's window and its bias masks by the window too."""

    @classmethod
    def build(
        cls,
        positions: torch.Tensor,  # [B, S]
        block_tables: torch.Tensor,  # [B, M0]
        context_lens: torch.Tensor,  # [B]
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        groups: int = 1,
        paged_kernel: bool = False,
        window: int | None = None,
    ) -> PagedContext:
        """Causal within the context: the query at position p attends keys [0, min(p + 1, context_len)).
        groups: query heads per kv head (G); the mask is repeated for them here, once per forward.
        window: the windowed layers' window (None: the model has none), which builds `local`.

        Tables given on the host (as the engine builds them) are cut there to the blocks of the longest
        context, so a long reservation costs nothing; tables already on an accelerator keep their width
        (cutting them would need the lengths on the host).
        """
        if context_lens.device.type == "cpu" and block_tables.shape[1]:
            width = -(-int(context_lens.max()) // block_size)
            block_tables = block_tables[:, :width]
        block_tables = block_tables.to(device)
        positions = positions.to(device)
        context_lens = context_lens.to(device)
        slots = block_tables.gather(1, positions // block_size) * block_size + positions % block_size  # [B, S]
        if paged_kernel:
            local = None if window is None else cls(positions, slots, block_tables, context_lens, None, True, window)
            return cls(positions, slots, block_tables, context_lens, None, True, local=local)
        keys = torch.arange(block_tables.shape[1] * block_size, device=device)  # [T]
        bias = _bias(keys[None, None], positions, context_lens, None, groups, dtype)
        local = None
        if window is not None:
            local_tables, local_keys = _window_blocks(block_tables, positions, window, block_size)
            local = cls(positions, slots, local_tables, context_lens,
                        _bias(local_keys[:, None], positions, context_lens, window, groups, dtype), window=window)
        return cls(positions, slots, block_tables, context_lens, bias, local=local)


def _bias(keys: torch.Tensor, positions: torch.Tensor, context_lens: torch.Tensor, window: int | None, groups: int,
          dtype: torch.dtype) -> torch.Tensor:
    """keys [B | 1, 1, T] (each key's position), positions [B, S] -> the additive mask [B, 1, G S | 1, T]."""
    behind = positions[..., None] - keys  # [B, S, T]
    visible = (behind >= 0) & (keys < context_lens[:, None, None])
    if window is not None:
        visible &= behind < window
    bias = torch.zeros(visible.shape, dtype=dtype, device=keys.device).masked_fill_(~visible, float("-inf"))
    B, S, T = bias.shape
    if S > 1 and groups > 1:  # one token each: the [B, 1, 1, T] mask broadcasts over the groups
        bias = bias[:, None].expand(B, groups, S, T).reshape(B, groups * S, T)
    return bias[:, None]


def _window_blocks(block_tables: torch.Tensor, positions: torch.Tensor, window: int, block_size: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks each row's window may read: (tables [B, Mw], their keys' positions [B, Mw * block_size]),
    from the block holding the first query's oldest visible key; Mw from the shapes alone. Columns past a
    row's table repeat its last block, at positions past the context (masked)."""
    B, M = block_tables.shape
    S = positions.shape[1]
    width = min(M, (S + window - 2) // block_size + 2)  # blocks that S queries' windows of W keys can touch
    first = (positions[:, :1] - window + 1).clamp(min=0) // block_size  # [B, 1]
    columns = first + torch.arange(width, device=block_tables.device)  # [B, Mw]
    tables = block_tables.gather(1, columns.clamp(max=M - 1))
    keys = (columns[:, :, None] * block_size + torch.arange(block_size, device=block_tables.device)).flatten(1)
    return tables, keys


def paged_attention(q: torch.Tensor, cache: PagedKvCache, layer: int, context: PagedContext,
                    scale: float | None = None, softcap: float | None = None) -> torch.Tensor:
    """softmax(q K^T scale) V over the context's blocks of one layer; q [B, S, H, D] -> [B, S, H, D].
    A windowed layer passes its context's `local` view. scale None: D ** -0.5; softcap: the scores capped to
    cap * tanh(s / cap) before the mask (Gemma 2).

    Grouped-query heads share their K/V without repeating them: q is viewed as [B, Hkv, G * S, D].
    """
    if context.paged_kernel:  # decode or verify on CUDA: q [B, S, H, D], S = 1 or k + 1
        from pdserve.server.decode.cuda_attention import cache_attention

        positions = None if q.shape[1] == 1 else context.positions  # decode: each context's last position
        return cache_attention(q, cache, layer, context.block_tables, context.context_lens, positions,
                               context.window, scale, softcap)
    B, S, H, D = q.shape
    k, v = cache.context_blocks(layer, context.block_tables, q.dtype)  # [B, Hkv, T, D] each
    Hkv = k.shape[1]
    G = H // Hkv
    attend = F.scaled_dot_product_attention if softcap is None else _softcapped
    if S == 1:  # decode: the rows are the G query heads of each kv head, views all along
        out = attend(q.view(B, Hkv, G, D), k, v, attn_mask=context.bias, scale=scale, **_cap(softcap))  # [B, Hkv, G, D]
        return out.reshape(B, 1, H, D)
    q = q.view(B, S, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * S, D)  # [B, Hkv, G S, D]
    out = attend(q, k, v, attn_mask=context.bias, scale=scale, **_cap(softcap))  # [B, Hkv, G S, D]
    return out.view(B, Hkv, G, S, D).permute(0, 3, 1, 2, 4).reshape(B, S, H, D)


def _cap(softcap: float | None) -> dict:
    return {} if softcap is None else {"softcap": softcap}


def _softcapped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor, scale: float | None,
                softcap: float) -> torch.Tensor:
    """scaled_dot_product_attention with the scores soft-capped (which SDPA does not do): q [B, N, R, D],
    k, v [B, N, T, D], attn_mask [B, 1, R | 1, T] -> [B, N, R, D]; scores and softmax in fp32."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # [B, N, R, T]
    scores = softcap * torch.tanh(scores / softcap) + attn_mask.float()
    return torch.matmul(scores.softmax(-1).to(v.dtype), v)
