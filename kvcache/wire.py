"""KvChunk on the wire with one copy per byte: blocks encoded straight from the host arrays, and
received blocks read as views on the message's bytes.

grpcio hands a servicer the request bytes and takes `bytes` from a serializer. The generated protobuf
code would copy a piece's KV three more times on the way out (tobytes, the message field, serialize)
and twice on the way in (parse, field access). Here a KvBlocks piece is written as the protobuf wire
format directly: its fields, then k and v (and scales) joined from per-layer slices of the host array
into the one `bytes` grpcio sends. On receipt, a chunk whose only field is `blocks` is parsed here into
memoryviews on the received bytes; anything else (header, end, abort, or a layout this parser does
not expect) goes through the generated parser, so the wire stays plain protobuf both ways.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pdserve.kvcache.codec import Piece
from pdserve.kvcache.tensors import KvTensors
from pdserve.v1 import worker_pb2 as pb

_BLOCKS = 2  # KvChunk.blocks
_LEN, _VARINT = 2, 0


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _layer_views(a: np.ndarray, l0: int, lc: int, t0: int, tc: int) -> list:
    """The bytes of a[l0:l0+lc, t0:t0+tc] in C order, as one buffer per layer (no copy when a layer's
    rows are contiguous, as in a batch's host copy viewed at one prompt)."""
    return [np.ascontiguousarray(a[layer, t0:t0 + tc]).reshape(-1).view(np.uint8) for layer in range(l0, l0 + lc)]


def encode_piece_bytes(layout_block_size: int, kv: KvTensors, piece: Piece) -> bytes:
    """A serialized KvChunk{blocks} for one piece of kv: the same bytes the generated code would produce."""
    l0, lc, t0, tc = piece
    g0 = l0 - kv.layer_start
    fields: list = []
    for number, value in ((1, l0), (2, lc), (3, t0), (4, tc)):
        if value:
            fields.append(bytes([number << 3 | _VARINT]) + _varint(value))
    arrays = [(5, kv.k), (6, kv.v)]
    if kv.k_scales is not None and kv.v_scales is not None:
        arrays += [(7, kv.k_scales), (8, kv.v_scales)]
    size = sum(len(f) for f in fields)
    parts: list = [None, *fields]
    r0 = t0 - kv.token_start  # kv's arrays start at its token_start (a block multiple)
    for number, array in arrays:
        if number >= 7:  # scales cover the blocks the tokens touch
            b0, b1 = r0 // layout_block_size, -(-(r0 + tc) // layout_block_size)
            views = _layer_views(array, g0, lc, b0, b1 - b0)
        else:
            views = _layer_views(array, g0, lc, r0, tc)
        nbytes = sum(v.nbytes for v in views)
        if not nbytes:
            continue
        head = bytes([number << 3 | _LEN]) + _varint(nbytes)
        parts.append(head)
        parts.extend(views)
        size += len(head) + nbytes
    parts[0] = bytes([_BLOCKS << 3 | _LEN]) + _varint(size)
    return b"".join(parts)  # the one copy: the host arrays into the message grpcio sends


@dataclass
class WireBlocks:
    """A KvBlocks read in place: the byte fields are memoryviews on the received message."""

    layer_start: int = 0
    layer_count: int = 0
    token_start: int = 0
    token_count: int = 0
    k: memoryview | bytes = b""
    v: memoryview | bytes = b""
    k_scales: memoryview | bytes = b""
    v_scales: memoryview | bytes = b""


@dataclass
class WireChunk:
    """What the receiver reads of a KvChunk whose part is `blocks`."""

    blocks: WireBlocks

    def WhichOneof(self, name: str) -> str:  # noqa: N802 (the protobuf message's interface)
        return "blocks"


_NAMES = {1: "layer_start", 2: "layer_count", 3: "token_start", 4: "token_count",
          5: "k", 6: "v", 7: "k_scales", 8: "v_scales"}


def decode_chunk(data: bytes) -> pb.KvChunk | WireChunk:
    """grpcio's request deserializer for PushKv: blocks as views, anything else parsed by protobuf."""
    parsed = _blocks_in_place(data)
    return pb.KvChunk.FromString(data) if parsed is None else parsed


def _blocks_in_place(data: bytes) -> WireChunk | None:
    view = memoryview(data)
    try:
        tag, pos = _read_varint(view, 0)
        if tag != (_BLOCKS << 3 | _LEN):
            return None
        size, pos = _read_varint(view, pos)
        if pos + size != len(view):  # more than one field in the chunk: let protobuf merge them
            return None
        blocks, seen = WireBlocks(), set()
        end = pos + size
        while pos < end:
            tag, pos = _read_varint(view, pos)
            number, kind = tag >> 3, tag & 7
            if number not in _NAMES or number in seen:
                return None
            seen.add(number)
            if number <= 4:
                if kind != _VARINT:
                    return None
                value, pos = _read_varint(view, pos)
                if value >= 2**32:
                    return None
            else:
                if kind != _LEN:
                    return None
                length, pos = _read_varint(view, pos)
                if pos + length > end:
                    return None
                value, pos = view[pos:pos + length], pos + length
            setattr(blocks, _NAMES[number], value)
        return WireChunk(blocks) if pos == end else None
    except IndexError:
        return None


def _read_varint(view: memoryview, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = view[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise IndexError("varint too long")


def encode_chunk(chunk: pb.KvChunk | bytes) -> bytes:
    """grpcio's request serializer for PushKv: pre-encoded pieces as they are, messages serialized."""
    return chunk if isinstance(chunk, bytes) else chunk.SerializeToString()
