"""An MLA latent layout (kind mla_latent: one entry per token and layer, no V) on the wire and in a block's bytes:
the latent alone travels, its V and V scales empty, bit-exact."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.kvcache.block_bytes import BlockKv, block_nbytes, pack_block, unpack_block
from pdserve.kvcache.codec import decode_blocks, encode_chunks, kv_bytes
from pdserve.kvcache.layout import QUANTIZED, KvLayout

C_PLUS_R = 32 + 16  # the tiny deepseek's kv_lora_rank + qk_rope_head_dim


def _latent(dtype: str) -> KvLayout:
    return KvLayout.of(3, 1, C_PLUS_R, 16, dtype, kind="mla_latent")


def _arrays(layout: KvLayout, num_tokens: int):
    rng = np.random.default_rng(0)
    shape = (layout.num_layers, num_tokens, 1, C_PLUS_R)
    nbytes = int(np.prod(shape)) * layout.np_dtype.itemsize
    k = rng.integers(0, 256, nbytes, dtype=np.uint8).view(layout.np_dtype).reshape(shape)
    v = np.zeros((*shape[:3], 0), layout.np_dtype)
    if layout.dtype not in QUANTIZED:
        return k, v, None, None
    blocks = layout.num_blocks(num_tokens)
    return k, v, rng.random((layout.num_layers, blocks, 1), dtype=np.float32), np.zeros((3, blocks, 0), np.float32)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "fp8_e4m3"])
def test_the_latent_travels_alone_and_bit_exact(dtype):
    layout = _latent(dtype)
    assert (layout.value_dim, layout.value_heads) == (0, 0)
    k, v, ks, vs = _arrays(layout, 41)  # 3 blocks, the last partial
    size = layout.np_dtype.itemsize
    scales = 3 * 3 * 4 if dtype in QUANTIZED else 0  # 3 layers x 3 blocks x one float32
    assert kv_bytes(layout, 41) == 3 * 41 * C_PLUS_R * size + scales
    got_k = np.zeros_like(k)
    got_ks = None if ks is None else np.zeros_like(ks)
    sent = 0
    for chunk in encode_chunks(layout, k, v, k_scales=ks, v_scales=vs, max_chunk_bytes=2 * 16 * C_PLUS_R * 4 + 64):
        msg = chunk.blocks
        assert msg.v == b"" and msg.v_scales == b""
        sent += len(msg.k) + len(msg.k_scales)
        piece = decode_blocks(layout, msg)
        assert piece.v.shape == (piece.num_layers, piece.num_tokens, 1, 0)
        layers = slice(piece.layer_start, piece.layer_start + piece.num_layers)
        got_k[layers, piece.token_start : piece.token_start + piece.num_tokens] = piece.k
        if ks is not None:
            assert piece.v_scales.shape == (piece.num_layers, piece.k_scales.shape[1], 0)
            b0 = piece.token_start // 16
            got_ks[layers, b0 : b0 + piece.k_scales.shape[1]] = piece.k_scales
    assert sent == kv_bytes(layout, 41)
    assert got_k.tobytes() == k.tobytes()
    assert ks is None or got_ks.tobytes() == ks.tobytes()


def test_a_heads_shaped_v_is_refused_for_a_latent():
    layout = _latent("float32")
    k, _, _, _ = _arrays(layout, 16)
    with pytest.raises(ValueError, match=r"\[L, T, 1, latent\] and \[L, T, 1, 0\] \(no V\)"):
        encode_chunks(layout, k, np.zeros_like(k))


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_a_latent_block_packs_to_the_entries_and_their_scales(dtype):
    layout = _latent(dtype)
    k, v, ks, vs = _arrays(layout, 16)
    block = BlockKv(k, v, None if ks is None else ks[:, 0], None if vs is None else vs[:, 0])
    data = pack_block(layout, block)
    assert len(data) == block_nbytes(layout) == 3 * 16 * C_PLUS_R * layout.np_dtype.itemsize + (12 if ks is not None else 0)
    back = unpack_block(layout, data)
    assert back.k.tobytes() == k.tobytes() and back.v.shape == (3, 16, 1, 0)
    assert ks is None or (back.k_scales.tobytes() == ks[:, 0].tobytes() and back.v_scales.shape == (3, 0))
