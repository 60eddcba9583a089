"""The reference paged attention: reads only the context's blocks, and equals dense attention over them."""

from __future__ import annotations

import pytest
import torch

from pdserve.kvcache.layout import KvLayout
from pdserve.server.decode.attention import PagedContext, paged_attention
from pdserve.server.decode.kv_cache import PagedKvCache

L, HKV, D, BS, H = 1, 2, 8, 4, 6  # 3 query heads per kv head


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: list[int]) -> torch.Tensor:
    """q [S, H, D] at positions, k/v [T, Hkv, D] of one sequence -> [S, H, D] (causal, float64)."""
    k, v = (t.double().repeat_interleave(H // HKV, dim=1) for t in (k, v))  # [T, H, D]
    scores = torch.einsum("shd,thd->hst", q.double(), k) / D**0.5  # [H, S, T]
    keys = torch.arange(k.shape[0])
    scores = scores.masked_fill(keys[None, None] > torch.tensor(positions)[None, :, None], float("-inf"))
    return torch.einsum("hst,thd->shd", scores.softmax(-1), v).float()


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_decode_reads_only_the_context_and_matches_dense_attention(dtype):
    """Rows of 3, 9 and 6 tokens, each with a 7-block reservation whose unused blocks hold huge values."""
    cache = PagedKvCache(KvLayout.of(L, HKV, D, BS, dtype), 24)
    g = torch.Generator().manual_seed(0)
    tables = [[20, 3, 7, 9, 11, 13, 15], [1, 5, 2, 8, 10, 12, 14], [6, 0, 4, 16, 17, 18, 19]]
    lengths = [3, 9, 6]
    for table in tables:  # garbage everywhere first: a former owner's values
        slots = torch.tensor([b * BS + o for b in table for o in range(BS)])
        junk = 1e3 * torch.randn(len(slots), HKV, D, generator=g)
        cache.store(0, slots, junk, junk)
    kv = [torch.randn(n, HKV, D, generator=g) for n in lengths]
    for table, x in zip(tables, kv):
        cache.store(0, torch.tensor([[table[t // BS] * BS + t % BS for t in range(len(x))]]), x, -x)

    positions = torch.tensor(lengths) - 1
    context = PagedContext.build(positions[:, None], torch.tensor(tables), torch.tensor(lengths), BS,
                                 torch.device("cpu"), torch.float32, groups=H // HKV)
    assert context.block_tables.shape == (3, 3)  # the longest context's 3 blocks, not the 7 reserved
    assert context.slots.tolist() == [[20 * BS + 2], [2 * BS + 0], [0 * BS + 1]]
    q = torch.randn(3, 1, H, D, generator=g)
    out = paged_attention(q, cache, 0, context)  # [B, 1, H, D]
    for row, n in enumerate(lengths):
        k, v = cache.gather(0, torch.tensor([tables[row]]))  # [1, T, Hkv, D] as the cache holds it, dequantized
        torch.testing.assert_close(out[row], _dense(q[row], k[0, :n], v[0, :n], [n - 1]), rtol=1e-5, atol=1e-5)


def test_prefill_of_a_chunk_attends_causally_over_cached_and_new_tokens():
    cache = PagedKvCache(KvLayout(L, HKV, D, BS, "float32"), 8)
    g = torch.Generator().manual_seed(1)
    table, start, n = [5, 2, 7], 3, 6  # tokens 3..8 new, 0..2 already cached
    x = torch.randn(start + n, HKV, D, generator=g)
    slots = torch.tensor([[table[t // BS] * BS + t % BS for t in range(start + n)]])
    cache.store(0, slots, x, 2 * x)
    positions = torch.arange(start, start + n)[None]  # [1, S]
    context = PagedContext.build(positions, torch.tensor([table]), torch.tensor([start + n]), BS,
                                 torch.device("cpu"), torch.float32, groups=H // HKV)
    assert context.bias.shape == (1, 1, (H // HKV) * n, 3 * BS)
    q = torch.randn(1, n, H, D, generator=g)
    out = paged_attention(q, cache, 0, context)[0]  # [S, H, D]
    torch.testing.assert_close(out, _dense(q[0], x, 2 * x, positions[0].tolist()), rtol=1e-5, atol=1e-5)


def test_tables_on_an_accelerator_keep_their_width():
    """Cutting needs the lengths on the host; tables given on a device keep every column (the kernel
    there reads only the context). The meta device stands in for one here."""
    context = PagedContext.build(torch.tensor([[5]]), torch.tensor([[1, 2, 3, 4]]).to("meta"),
                                 torch.tensor([6]).to("meta"), BS, torch.device("meta"), torch.float32)
    assert context.block_tables.shape == (1, 4) and context.bias.shape == (1, 1, 1, 4 * BS)


def _windowed_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: list[int], window: int):
    """_dense with a sliding window: the query at p reads keys p - window < j <= p."""
    k, v = (t.double().repeat_interleave(H // HKV, dim=1) for t in (k, v))  # [T, H, D]
    scores = torch.einsum("shd,thd->hst", q.double(), k) / D**0.5  # [H, S, T]
    behind = torch.tensor(positions)[None, :, None] - torch.arange(k.shape[0])[None, None]
    scores = scores.masked_fill((behind < 0) | (behind >= window), float("-inf"))
    return torch.einsum("hst,thd->shd", scores.softmax(-1), v).float()


@pytest.mark.parametrize("window", [1, 5, 9])
def test_a_windowed_layer_reads_only_the_blocks_of_its_window(window):
    """Rows of 3, 17 and 26 tokens: the local view holds only the blocks from each row's window on (a fixed
    number), blocks before it hold NaN (were they read, the output would be NaN), and it equals dense
    windowed attention."""
    cache = PagedKvCache(KvLayout.of(L, HKV, D, BS, "float32"), 24)
    g = torch.Generator().manual_seed(5)
    tables = [[20, 3, 7, 9, 11, 13, 15], [1, 5, 2, 8, 10, 12, 14], [6, 0, 4, 16, 17, 18, 19]]
    lengths = [3, 17, 26]
    kv = [torch.randn(n, HKV, D, generator=g) for n in lengths]
    for table, x in zip(tables, kv):
        cache.store(0, torch.tensor([[table[t // BS] * BS + t % BS for t in range(len(x))]]), x, -x)
    positions = torch.tensor(lengths) - 1
    context = PagedContext.build(positions[:, None], torch.tensor(tables), torch.tensor(lengths), BS,
                                 torch.device("cpu"), torch.float32, groups=H // HKV, window=window)
    local = context.local
    assert local.block_tables.shape == (3, min(7, (window - 1) // BS + 2))
    for table, n in zip(tables, lengths):  # poison every block wholly before the window
        for block in table[: max(0, n - window) // BS]:
            cache.k[0, block] = float("nan")
            cache.v[0, block] = float("nan")
    q = torch.randn(3, 1, H, D, generator=g)
    out = paged_attention(q, cache, 0, local)  # [B, 1, H, D]
    assert not out.isnan().any()
    for row, n in enumerate(lengths):
        k, v = kv[row], -kv[row]
        torch.testing.assert_close(out[row], _windowed_dense(q[row], k, v, [n - 1], window), rtol=1e-5, atol=1e-5)


def test_a_windowed_chunk_attends_each_query_through_its_own_window():
    """A chunk of 6 new tokens after 14 cached, window 5: each query reads its own last 5 positions."""
    window = 5
    cache = PagedKvCache(KvLayout.of(L, HKV, D, BS, "float32"), 8)
    g = torch.Generator().manual_seed(6)
    table = [4, 1, 6, 0, 2]
    x = torch.randn(20, HKV, D, generator=g)
    cache.store(0, torch.tensor([[table[t // BS] * BS + t % BS for t in range(20)]]), x, 2 * x)
    positions = torch.arange(14, 20)[None]
    context = PagedContext.build(positions, torch.tensor([table]), torch.tensor([20]), BS, torch.device("cpu"),
                                 torch.float32, groups=H // HKV, window=window)
    q = torch.randn(1, 6, H, D, generator=g)
    out = paged_attention(q, cache, 0, context.local)  # [1, 6, H, D]
    torch.testing.assert_close(out[0], _windowed_dense(q[0], x, 2 * x, list(range(14, 20)), window),
                               rtol=1e-5, atol=1e-5)
