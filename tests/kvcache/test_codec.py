"""encode_chunks/decode_blocks: bit-exact, every message under the limit, every (layer, token) once."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.kvcache.codec import MAX_CHUNK_BYTES, decode_blocks, encode_chunks, iter_pieces
from pdserve.kvcache.layout import QUANTIZED, KvLayout
from pdserve.v1 import worker_pb2 as pb


def encode_blocks(*args, **kwargs):
    """The KvBlocks messages encode_chunks sends, unwrapped."""
    return (chunk.blocks for chunk in encode_chunks(*args, **kwargs))


def random_kv(layout: KvLayout, num_tokens: int, seed: int = 0):
    """Random bit patterns (NaNs and all) in the layout's dtype, plus scales when it has them."""
    rng = np.random.default_rng(seed)
    shape = (layout.num_layers, num_tokens, layout.num_kv_heads, layout.head_dim)  # [L, T, Hkv, D]
    nbytes = int(np.prod(shape)) * layout.np_dtype.itemsize
    k, v = (rng.integers(0, 256, nbytes, dtype=np.uint8).view(layout.np_dtype).reshape(shape) for _ in "kv")
    if layout.dtype not in QUANTIZED:
        return k, v, None, None
    scale_shape = (layout.num_layers, layout.num_blocks(num_tokens), layout.num_kv_heads)  # [L, nblocks, Hkv]
    k_scales, v_scales = (rng.random(scale_shape, dtype=np.float32) for _ in "kv")
    return k, v, k_scales, v_scales


def reassemble(layout: KvLayout, msgs: list[pb.KvBlocks], num_tokens: int):
    """Decodes every message into full arrays; counts how often each (layer, token) arrived."""
    shape = (layout.num_layers, num_tokens, layout.num_kv_heads, layout.head_dim)
    k, v = np.zeros(shape, layout.np_dtype), np.zeros(shape, layout.np_dtype)
    scale_shape = (layout.num_layers, layout.num_blocks(num_tokens), layout.num_kv_heads)
    k_scales, v_scales = np.zeros(scale_shape, np.float32), np.zeros(scale_shape, np.float32)
    seen = np.zeros((layout.num_layers, num_tokens), dtype=np.int64)
    for msg in msgs:
        piece = decode_blocks(layout, msg)
        layers = slice(piece.layer_start, piece.layer_start + piece.num_layers)
        tokens = slice(piece.token_start, piece.token_start + piece.num_tokens)
        k[layers, tokens], v[layers, tokens] = piece.k, piece.v
        seen[layers, tokens] += 1
        if piece.k_scales is not None:
            blocks = slice(piece.token_start // layout.block_size, None)
            k_scales[layers, blocks][:, : piece.k_scales.shape[1]] = piece.k_scales
            v_scales[layers, blocks][:, : piece.v_scales.shape[1]] = piece.v_scales
    return k, v, k_scales, v_scales, seen


def pieces(msgs: list[pb.KvBlocks]) -> list[tuple[int, int, int, int]]:
    return [(m.layer_start, m.layer_count, m.token_start, m.token_count) for m in msgs]


LAYOUTS = {
    "float32": KvLayout(3, 2, 8, 4, "float32"),
    "bfloat16": KvLayout(3, 2, 8, 4, "bfloat16"),
    "fp8_e4m3": KvLayout(3, 2, 8, 4, "fp8_e4m3", "block_head"),
    "int8": KvLayout(3, 2, 8, 4, "int8", "block_head"),
}


@pytest.mark.parametrize("dtype", list(LAYOUTS))
@pytest.mark.parametrize("max_chunk_bytes", [MAX_CHUNK_BYTES, 1100, 600])
def test_round_trip_is_bit_exact_with_a_partial_last_block(dtype, max_chunk_bytes):
    layout, num_tokens = LAYOUTS[dtype], 10  # blocks of 4, 4, 2 tokens
    k, v, k_scales, v_scales = random_kv(layout, num_tokens)
    msgs = list(
        encode_blocks(layout, k, v, k_scales=k_scales, v_scales=v_scales, max_chunk_bytes=max_chunk_bytes)
    )
    assert all(pb.KvChunk(blocks=m).ByteSize() <= max_chunk_bytes for m in msgs)  # wrapper included
    assert all(m.token_start % layout.block_size == 0 for m in msgs)
    assert all(
        m.token_count % layout.block_size == 0 for m in msgs if m.token_start + m.token_count < num_tokens
    )
    k2, v2, ks2, vs2, seen = reassemble(layout, msgs, num_tokens)
    assert k2.tobytes() == k.tobytes() and v2.tobytes() == v.tobytes()
    assert (seen == 1).all()
    if layout.dtype in QUANTIZED:
        assert ks2.tobytes() == k_scales.tobytes() and vs2.tobytes() == v_scales.tobytes()
    else:
        assert all(not m.k_scales and not m.v_scales for m in msgs)


def test_pieces_for_each_limit():
    layout = LAYOUTS["float32"]  # one block of one layer: 2 * 4 * 2 * 8 * 4 = 512 bytes
    k, v, _, _ = random_kv(layout, 10)
    assert pieces(list(encode_blocks(layout, k, v))) == [(0, 3, 0, 10)]
    # room for 2 blocks of all 3 layers (3072 bytes) plus the envelope
    assert pieces(list(encode_blocks(layout, k, v, max_chunk_bytes=3072 + 64))) == [
        (0, 3, 0, 8),
        (0, 3, 8, 2),
    ]
    # room for 2 layers of a block: 3 layers split evenly into groups of 2 and 1
    assert pieces(list(encode_blocks(layout, k, v, max_chunk_bytes=1024 + 64))) == [
        (0, 2, 0, 4), (2, 1, 0, 4), (0, 2, 4, 4), (2, 1, 4, 4), (0, 2, 8, 2), (2, 1, 8, 2),
    ]  # fmt: skip
    # room for one layer of a block only
    assert pieces(list(encode_blocks(layout, k, v, max_chunk_bytes=512 + 64))) == [
        (layer, 1, t, n) for t, n in ((0, 4), (4, 4), (8, 2)) for layer in range(3)
    ]


def test_scales_count_against_the_limit():
    layout = LAYOUTS["int8"]  # one block of one layer: 2 * 4 * 2 * 8 + 2 * 2 * 4 = 144 bytes
    k, v, k_scales, v_scales = random_kv(layout, 10)
    msgs = list(
        encode_blocks(layout, k, v, k_scales=k_scales, v_scales=v_scales, max_chunk_bytes=144 * 3 + 64)
    )
    assert pieces(msgs) == [(0, 3, 0, 4), (0, 3, 4, 4), (0, 3, 8, 2)]
    # payload + tags, varints (layer_start 0 is omitted) and length prefixes
    assert [m.ByteSize() for m in msgs] == [3 * 144 + 14, 3 * 144 + 16, 3 * 80 + 14]


def test_big_model_blocks_split_into_layer_groups_under_1_mib():
    # One block of one layer is 2 * 16 * 8 * 128 * 2 bytes = 64 KiB: 15 fit in 1 MiB, so the 80 layers
    # split into 6 even groups: 5 of 14 and one of 10.
    layout = KvLayout(num_layers=80, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")
    num_tokens = 40
    k, v, _, _ = random_kv(layout, num_tokens)
    msgs = list(encode_blocks(layout, k, v, max_chunk_bytes=2**20))
    assert pieces(msgs) == [
        (layer, 14 if layer < 70 else 10, t, n) for t, n in ((0, 16), (16, 16), (32, 8)) for layer in range(0, 80, 14)
    ]
    sizes = [m.ByteSize() for m in msgs]
    assert max(pb.KvChunk(blocks=m).ByteSize() for m in msgs) <= 2**20
    # The default 4 MiB messages hold 63 layer-blocks: two groups of 40 layers.
    assert pieces(list(encode_blocks(layout, k, v))) == [
        (layer, 40, t, n) for t, n in ((0, 16), (16, 16), (32, 8)) for layer in (0, 40)
    ]
    assert sizes[0] == 2 * 14 * 16 * 8 * 128 * 2 + 12  # 896 KiB of KV + the envelope
    k2, v2, _, _, seen = reassemble(layout, msgs, num_tokens)
    assert k2.tobytes() == k.tobytes() and v2.tobytes() == v.tobytes()
    assert (seen == 1).all()


def test_small_limit_on_a_big_layout():
    layout = KvLayout(num_layers=80, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")
    limit = 256 * 1024  # 4 layers of one block (64 KiB each) minus the envelope: 3 per message
    k, v, _, _ = random_kv(layout, 20)
    msgs = list(encode_blocks(layout, k, v, max_chunk_bytes=limit))
    assert len(msgs) == 2 * 27  # 80 layers in 27 groups of 3 (the last 2), for 2 blocks
    assert max(m.ByteSize() for m in msgs) <= limit
    _, _, _, _, seen = reassemble(layout, msgs, 20)
    assert (seen == 1).all()


def test_iter_pieces_covers_every_layer_and_token_once():
    layout = KvLayout(7, 2, 8, 16, "float16")
    for num_tokens in (0, 1, 15, 16, 17, 100):
        for limit in (1024 + 64, 2048 + 64, 5000, MAX_CHUNK_BYTES):
            seen = np.zeros((7, num_tokens), dtype=np.int64)
            for l0, lc, t0, tc in iter_pieces(layout, num_tokens, limit):
                assert t0 % 16 == 0 and (tc % 16 == 0 or t0 + tc == num_tokens)
                seen[l0 : l0 + lc, t0 : t0 + tc] += 1
            assert (seen == 1).all(), (num_tokens, limit)


def test_encode_refuses_bad_arrays_at_the_call():
    layout = LAYOUTS["int8"]
    k, v, k_scales, v_scales = random_kv(layout, 10)
    with pytest.raises(ValueError, match=r"int8 KV needs k_scales float32 \(3, 3, 2\).*got nothing"):
        encode_blocks(layout, k, v)
    with pytest.raises(ValueError, match=r"needs v_scales float32 \(3, 3, 2\).*got float64 \(3, 3, 2\)"):
        encode_blocks(layout, k, v, k_scales=k_scales, v_scales=v_scales.astype(np.float64))
    with pytest.raises(ValueError, match=r"k and v are int8/float32, the layout wants int8: quantize first"):
        encode_blocks(layout, k, v.astype(np.float32), k_scales=k_scales, v_scales=v_scales)
    with pytest.raises(ValueError, match=r"k and v must both be \[L, T, Hkv, D\]"):
        encode_blocks(layout, k, v[:, :5], k_scales=k_scales, v_scales=v_scales)
    with pytest.raises(ValueError, match=r"the layout wants \[3, T, 2, 8\]"):
        encode_blocks(layout, k[:2], v[:2], k_scales=k_scales, v_scales=v_scales)
    f32 = LAYOUTS["float32"]
    k, v, _, _ = random_kv(f32, 10)
    with pytest.raises(ValueError, match=r"float32 KV takes no scales"):
        encode_blocks(f32, k, v, k_scales=k_scales, v_scales=v_scales)
    with pytest.raises(
        ValueError, match=r"one block of one layer takes 512 bytes, over the 500-byte chunk limit"
    ):
        encode_blocks(f32, k, v, max_chunk_bytes=500)


def test_encode_is_lazy():
    layout = LAYOUTS["float32"]
    k, v, _, _ = random_kv(layout, 10)
    msgs = encode_blocks(layout, k, v, max_chunk_bytes=512 + 64)
    first = next(msgs)
    k[1:] = 0  # later pieces are encoded from the arrays as they are when reached
    assert first.k == k[0, 0:4].tobytes()
    assert next(msgs).k == bytes(512 // 2)


def good_msg() -> tuple[KvLayout, pb.KvBlocks]:
    layout = LAYOUTS["int8"]
    k, v, k_scales, v_scales = random_kv(layout, 10)
    return layout, next(encode_blocks(layout, k, v, k_scales=k_scales, v_scales=v_scales))


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(layer_count=0), r"layers 0\+0 tokens 0\+10: a piece needs at least one layer and one token"),
        (dict(token_count=0), r"a piece needs at least one layer and one token"),
        (dict(layer_start=1), r"layers 1\+3 tokens 0\+10: the layout has only 3 layers"),
        (dict(token_start=2), r"token_start must be a multiple of the block size 4"),
        (dict(k=b"\0" * 479), r"k has 479 bytes, expected 480 for int8 \(3, 10, 2, 8\)"),
        (dict(v=b""), r"v has 0 bytes, expected 480"),
        (dict(token_count=9), r"k has 480 bytes, expected 432"),
        (dict(k_scales=b""), r"k_scales has 0 bytes, expected 72 for float32 \(3, 3, 2\)"),
        (dict(v_scales=b"\0" * 73), r"v_scales has 73 bytes, expected 72"),
    ],
)
def test_decode_refuses_malformed_messages(change, message):
    layout, msg = good_msg()
    assert decode_blocks(layout, msg).k.shape == (3, 10, 2, 8)
    for name, value in change.items():
        setattr(msg, name, value)
    with pytest.raises(ValueError, match=message):
        decode_blocks(layout, msg)


def test_decode_refuses_scales_for_a_dtype_without_them():
    layout = LAYOUTS["bfloat16"]
    k, v, _, _ = random_kv(layout, 4)
    msg = next(encode_blocks(layout, k, v))
    msg.k_scales = b"\0" * 4
    with pytest.raises(ValueError, match=r"bfloat16 KV carries no scales, but the piece has some"):
        decode_blocks(layout, msg)


def test_decode_gives_read_only_views_in_the_layout_dtype():
    layout, msg = good_msg()
    piece = decode_blocks(layout, msg)
    assert (piece.k.dtype, piece.k_scales.dtype, piece.k_scales.shape) == (np.int8, np.float32, (3, 3, 2))
    assert not piece.k.flags.writeable
