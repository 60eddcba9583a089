"""KvChunk on the wire with one copy per byte: blocks encoded straight from the host arrays, and
received blocks read as views on the message's bytes.

grpcio hands a servicer the request bytes and takes `bytes` from a serializer. The generated protobuf
code would copy a piece's KV three more times on the way out (tobytes, the message field, serialize)
and twice on the way in (parse, field access). Here a KvBlocks piece is written as the protobuf wire
format directly: its fields, then k and v (and scales), each copied by one numpy copy from the host
array (any strides) into the one `bytes` grpcio sends, allocated once at its final size. On receipt,
a chunk whose only field is `blocks` is parsed here into memoryviews on the received bytes; anything
else (header, end, abort, or a layout this parser does not expect) goes through the generated
parser, so the wire stays plain protobuf both ways.
"""

from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass

import numpy as np

from pdserve.kvcache.codec import Piece
from pdserve.kvcache.tensors import KvTensors
from pdserve.v1 import worker_pb2 as pb

PROTOCOL_VERSION = 2
"""The KvHeader's protocol_version this code speaks. 2: BeginKv, layer groups over parallel streams."""
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


def _field_views(a: np.ndarray, g0: int, lc: int, t0: int, tc: int) -> np.ndarray:
    """a[g0:g0+lc, t0:t0+tc] as bytes [lc, tc, rest..., itemsize * last] without a copy (any strides
    outside the last axis): what a copy into the message reads, in C order."""
    part = a[g0:g0 + lc, t0:t0 + tc]
    if part.strides[-1] != part.itemsize:
        part = np.ascontiguousarray(part)
    return part.view(np.uint8)


def piece_bytes(kv: KvTensors, piece: Piece) -> int:
    """The KV bytes (scales aside) of one piece of kv: what encoding it copies, give or take its scales."""
    _, lc, _, tc = piece
    return 2 * lc * tc * kv.k[0, 0].nbytes if kv.k.shape[1] else 0


def encode_piece_bytes(layout_block_size: int, kv: KvTensors, piece: Piece) -> bytes:
    """A serialized KvChunk{blocks} for one piece of kv: the same bytes the generated code would produce.

    The `bytes` object is allocated once at its final size and each array field copied into it by
    one numpy copy (the GIL released while it runs), so encoding can run in a thread beside grpcio.
    """
    l0, lc, t0, tc = piece
    g0 = l0 - kv.layer_start
    head = bytearray()
    for number, value in ((1, l0), (2, lc), (3, t0), (4, tc)):
        if value:
            head += bytes([number << 3 | _VARINT]) + _varint(value)
    arrays = [(5, kv.k), (6, kv.v)]
    if kv.k_scales is not None and kv.v_scales is not None:
        arrays += [(7, kv.k_scales), (8, kv.v_scales)]
    fields: list[tuple[bytes, np.ndarray]] = []  # (tag and length, the bytes to copy)
    size = len(head)
    r0 = t0 - kv.token_start  # kv's arrays start at its token_start (a block multiple)
    for number, array in arrays:
        if number >= 7:  # scales cover the blocks the tokens touch
            b0, b1 = r0 // layout_block_size, -(-(r0 + tc) // layout_block_size)
            src = _field_views(array, g0, lc, b0, b1 - b0)
        else:
            src = _field_views(array, g0, lc, r0, tc)
        if not src.size:
            continue
        tag = bytes([number << 3 | _LEN]) + _varint(src.size)
        fields.append((tag, src))
        size += len(tag) + src.size
    outer = bytes([_BLOCKS << 3 | _LEN]) + _varint(size)
    message = _Message(len(outer) + size)
    dst = message.array
    pos = len(outer) + len(head)
    dst[:pos] = np.frombuffer(outer + head, np.uint8)
    for tag, src in fields:
        dst[pos:pos + len(tag)] = np.frombuffer(tag, np.uint8)
        pos += len(tag)
        np.copyto(dst[pos:pos + src.size].reshape(src.shape), src)  # the one copy of these bytes
        pos += src.size
    return message.done()


class _Message:
    """A `bytes` of n bytes, filled through `array` (writable uint8 [n]) before anyone else sees it.

    grpcio sends only `bytes`, which Python code cannot write, so on CPython the object is made as C code
    makes one (PyBytes_FromStringAndSize(NULL, n): allocated, not yet filled) and its contents are
    exposed to numpy until `done()` hands it over. Elsewhere, or if this CPython's bytes object is not
    laid out as checked at import, a plain array is filled and copied into bytes once more.
    """

    def __init__(self, n: int) -> None:
        if _IN_PLACE:
            self._bytes = _new_bytes(None, n)
            contents = (ctypes.c_char * n).from_address(id(self._bytes) + _BYTES_DATA)
            self.array = np.frombuffer(contents, np.uint8)
        else:
            self._bytes = None
            self.array = np.empty(n, np.uint8)

    def done(self) -> bytes:
        out = self.array.tobytes() if self._bytes is None else self._bytes
        self.array = None  # type: ignore[assignment]  # no writes once the bytes are out
        return out


_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.restype = ctypes.py_object
_new_bytes.argtypes = (ctypes.c_char_p, ctypes.c_ssize_t)
_BYTES_DATA = sys.getsizeof(b"") - 1
"""Where a bytes object's contents start, from its address (CPython: the header, then the bytes and a NUL)."""


def _check_in_place() -> bool:
    if sys.implementation.name != "cpython":
        return False
    try:
        probe = _new_bytes(None, 5)
        (ctypes.c_char * 5).from_address(id(probe) + _BYTES_DATA).value = b"probe"
        return probe == b"probe"
    except Exception:  # noqa: BLE001 (any surprise: use the copying fallback)
        return False


_IN_PLACE = _check_in_place()


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
