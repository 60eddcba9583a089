import ml_dtypes
import numpy as np
import pytest
import torch

from pdserve.kvcache.layout import KvLayout
from pdserve.server.decode.kv_cache import PagedKvCache, numpy_to_torch

L, HKV, D, BS = 3, 2, 4, 4


def _random_kv(layers: int, tokens: int, dtype: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    np_dtype = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
    k = rng.standard_normal((layers, tokens, HKV, D)).astype(np_dtype)
    v = rng.standard_normal((layers, tokens, HKV, D)).astype(np_dtype)
    return k, v


def _bits(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy()
    return t.view(torch.int32).numpy()


def _np_bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.int16 if a.dtype.itemsize == 2 else np.int32)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_round_trip_is_bit_exact_with_partial_block_and_layer_offset(dtype):
    cache = PagedKvCache(KvLayout(L, HKV, D, BS, dtype), num_blocks=8)
    table = [6, 1, 3]
    num_tokens = 10  # two full blocks and a partial third one
    k, v = _random_kv(L, num_tokens, dtype, seed=0)
    # Layer 0 in one write, layers 1-2 in two token chunks (the second starting mid-table).
    cache.write(table, 0, 0, k[:1], v[:1])
    cache.write(table, 1, 0, k[1:, :4], v[1:, :4])
    cache.write(table, 1, 4, k[1:, 4:], v[1:, 4:])

    k_read, v_read = cache.read(table, num_tokens)
    assert k_read.shape == (L, num_tokens, HKV, D)
    assert k_read.dtype == cache.dtype == {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    np.testing.assert_array_equal(_bits(k_read), _np_bits(k))
    np.testing.assert_array_equal(_bits(v_read), _np_bits(v))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_values_land_in_the_given_blocks_and_nowhere_else(dtype):
    cache = PagedKvCache(KvLayout(L, HKV, D, BS, dtype), num_blocks=6)
    table = [4, 0, 2]
    k, v = _random_kv(2, 9, dtype, seed=1)
    cache.write(table, 1, 0, k, v)  # layers 1-2, tokens 0..8

    expected_k = torch.zeros_like(cache.k)
    expected_v = torch.zeros_like(cache.v)
    for t in range(9):
        block, offset = table[t // BS], t % BS
        expected_k[1:, block, offset] = numpy_to_torch(k[:, t])
        expected_v[1:, block, offset] = numpy_to_torch(v[:, t])
    assert torch.equal(cache.k, expected_k)
    assert torch.equal(cache.v, expected_v)
    # Spot-check the placement by hand: token 5 is block 0, offset 1; token 8 is block 2, offset 0.
    np.testing.assert_array_equal(_bits(cache.k[2, 0, 1]), _np_bits(k[1, 5]))
    np.testing.assert_array_equal(_bits(cache.v[1, 2, 0]), _np_bits(v[0, 8]))
    untouched = [1, 3, 5]
    assert not cache.k[:, untouched].any() and not cache.v[:, untouched].any()
    assert not cache.k[0].any()  # layer 0 was never written
    assert not cache.k[1:, 2, 1:].any()  # the rest of the partial block stays empty


def test_store_and_gather_use_flat_slots():
    cache = PagedKvCache(KvLayout(1, HKV, D, BS, "float32"), num_blocks=4)
    k = torch.arange(2 * HKV * D, dtype=torch.float32).reshape(2, HKV, D)
    cache.store(0, torch.tensor([3 * BS + 2, 1 * BS + 0]), k, -k)
    assert torch.equal(cache.k[0, 3, 2], k[0]) and torch.equal(cache.k[0, 1, 0], k[1])
    k_all, v_all = cache.gather(0, torch.tensor([[3, 1], [1, 1]]))
    assert k_all.shape == (2, 2 * BS, HKV, D)
    assert torch.equal(k_all[0, 2], k[0]) and torch.equal(k_all[0, BS], k[1])
    assert torch.equal(v_all[1, 0], -k[1])


def test_write_refuses_wrong_dtype_shape_and_short_table():
    cache = PagedKvCache(KvLayout(L, HKV, D, BS, "bfloat16"), num_blocks=4)
    k, v = _random_kv(L, 5, "float32", seed=2)
    with pytest.raises(ValueError, match="holds bfloat16"):
        cache.write([0, 1], 0, 0, k, v)
    k, v = _random_kv(L, 5, "bfloat16", seed=2)
    with pytest.raises(ValueError, match="need 2 blocks; table has 1"):
        cache.write([0], 0, 0, k, v)
    with pytest.raises(ValueError, match="layers"):
        cache.write([0, 1], 1, 0, k, v)
    with pytest.raises(ValueError, match="must both be"):
        cache.write([0, 1], 0, 0, k[..., :2], v[..., :2])


def test_num_blocks_for_budget():
    layout = KvLayout(num_layers=2, num_kv_heads=2, head_dim=32, block_size=16, dtype="bfloat16")
    block_bytes = 2 * 2 * 2 * 32 * 2 * 16  # K and V, layers, heads, head_dim, bytes, tokens
    assert PagedKvCache.num_blocks_for_budget(layout, 10 * block_bytes + block_bytes - 1) == 10
    cache = PagedKvCache(layout, 10)
    assert cache.k.numel() * 2 + cache.v.numel() * 2 == 10 * block_bytes
