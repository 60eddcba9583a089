"""kvcache.wire: pieces serialized straight from the host arrays, byte for byte what the generated
code writes; received blocks read as views, anything unusual parsed by protobuf."""

from __future__ import annotations

import numpy as np

from pdserve.kvcache.codec import decode_blocks, encode_chunks, iter_pieces
from pdserve.kvcache.layout import KvLayout
from pdserve.kvcache.tensors import KvTensors
from pdserve.kvcache import wire
from pdserve.kvcache.wire import WireChunk, decode_chunk, encode_chunk, encode_piece_bytes
from pdserve.v1 import worker_pb2 as pb

from .test_codec import random_kv


def test_pieces_are_the_generated_serialization_byte_for_byte():
    for layout, limit in ((KvLayout(3, 2, 8, 4, "bfloat16"), 600), (KvLayout(3, 2, 8, 4, "int8", "block_head"), 300),
                          (KvLayout(3, 2, 8, 4, "fp8_e4m3", "block_head"), 10**6)):
        k, v, ks, vs = random_kv(layout, 10, seed=2)
        kv = KvTensors(0, 0, k, v, ks, vs)
        want = [c.SerializeToString() for c in encode_chunks(layout, k, v, k_scales=ks, v_scales=vs, max_chunk_bytes=limit)]
        got = [encode_piece_bytes(4, kv, piece) for piece in iter_pieces(layout, 10, limit)]
        assert got == want


def test_messages_are_the_same_bytes_without_the_in_place_allocation(monkeypatch):
    layout = KvLayout(3, 2, 8, 4, "int8", "block_head")
    k, v, ks, vs = random_kv(layout, 10, seed=3)
    kv = KvTensors(0, 0, k, v, ks, vs)
    pieces = list(iter_pieces(layout, 10, 300))
    in_place = [encode_piece_bytes(4, kv, piece) for piece in pieces]
    monkeypatch.setattr(wire, "_IN_PLACE", False)  # another Python: filled in an array, then copied
    assert [encode_piece_bytes(4, kv, piece) for piece in pieces] == in_place
    assert wire._check_in_place() is True  # this CPython takes the in-place path


def test_a_layer_group_viewed_in_a_batch_encodes_without_a_contiguous_copy_first():
    layout = KvLayout(4, 2, 8, 4, "float32")
    batch = np.arange(2 * 3 * 16 * 2 * 8, dtype=np.float32).reshape(2, 3, 16, 2, 8)  # [l, B, S, Hkv, D]
    group = KvTensors(2, 0, batch[:, 1, :10], batch[:, 1, :10] + 1)  # layers 2-3 of row 1, its 10 true tokens
    chunk = pb.KvChunk.FromString(encode_piece_bytes(4, group, (2, 2, 4, 6)))
    assert (chunk.blocks.layer_start, chunk.blocks.layer_count, chunk.blocks.token_start) == (2, 2, 4)
    assert chunk.blocks.k == np.ascontiguousarray(batch[:, 1, 4:10]).tobytes()
    assert chunk.blocks.v == np.ascontiguousarray(batch[:, 1, 4:10] + 1).tobytes()


def test_received_blocks_are_views_on_the_message_bytes():
    layout = KvLayout(3, 2, 8, 4, "int8", "block_head")
    k, v, ks, vs = random_kv(layout, 10, seed=4)
    data = encode_piece_bytes(4, KvTensors(0, 0, k, v, ks, vs), (1, 2, 4, 6))
    chunk = decode_chunk(data)
    assert isinstance(chunk, WireChunk) and chunk.WhichOneof("part") == "blocks"
    piece = decode_blocks(layout, chunk.blocks)
    assert piece.k.base is not None and not piece.k.flags.writeable  # a view, not a copy
    assert piece.k.tobytes() == k[1:3, 4:10].tobytes() and piece.v_scales.tobytes() == vs[1:3, 1:3].tobytes()


def test_everything_else_goes_through_protobuf():
    header = pb.KvChunk(header=pb.KvHeader(request_id="r", num_tokens=3))
    end = pb.KvChunk(end=pb.KvEnd(first_token_id=5))
    assert decode_chunk(encode_chunk(header)) == header and decode_chunk(encode_chunk(end)) == end
    blocks = pb.KvChunk(blocks=pb.KvBlocks(layer_count=1, token_count=4, k=b"ab", v=b"cd"))
    twice = blocks.SerializeToString() * 2  # protobuf merges repeated fields: leave that to it
    assert decode_chunk(twice) == pb.KvChunk.FromString(twice)
    assert decode_chunk(b"") == pb.KvChunk()
    assert decode_chunk(encode_chunk(blocks)).blocks.k == memoryview(b"ab")
