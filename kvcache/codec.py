"""KV arrays <-> KvBlocks messages: whole blocks of tokens, layer groups when a block is too big.

A piece is the KV of layers [layer_start, +l) for tokens [token_start, +n). Its bytes are the arrays'
raw C-order bytes in the layout's dtype, so bf16 and fp8 travel bit-exact. Quantized dtypes carry
float32 scales [l, blocks covered, Hkv] beside them. An MLA latent layout's V is empty ([l, n, 1, 0], and its
scales [l, blocks, 0]): a piece carries the latent entries alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np

from pdserve.kvcache.layout import QUANTIZED, KvLayout
from pdserve.kvcache.tensors import KvTensors
from pdserve.v1 import worker_pb2 as pb

MAX_CHUNK_BYTES = 4 * 2**20
"""Messages of up to 4 MiB: grpcio's per-message cost (Python objects, completion-queue round trips) then
weighs little against the bytes (1 -> 4 MiB: 1.70 -> 1.45 CPU s/GB, benchmarks/README), and a KvChunk
still fits grpcio's default 4 MiB receive limit, whatever the receiver's server options."""
_ENVELOPE_BYTES = 64  # KvBlocks fields (<= 48 bytes) + the KvChunk wrapper (<= 6): a KvChunk fits too
_SCALE_DTYPE = np.dtype(np.float32)


KvPiece = KvTensors
"""A received piece: KvTensors whose arrays are read-only views on the message's bytes."""

Piece = tuple[int, int, int, int]
"""(layer_start, layer_count, token_start, token_count)"""


def iter_pieces(
    layout: KvLayout,
    num_tokens: int,
    max_chunk_bytes: int = MAX_CHUNK_BYTES,
    layers: tuple[int, int] | None = None,
    token_start: int = 0,
) -> Iterator[Piece]:
    """(layer_start, layer_count, token_start, token_count) of every piece, token-major.

    layers: (start, count) of the layer group to cover; default all the layout's layers.
    token_start: the first token to cover (a block multiple: the tokens before it are held already).
    Pieces hold as many whole blocks of all the group's layers as fit; when one block of them does
    not fit, the layers split into even groups. Only a piece ending at num_tokens may be partial.
    Raises ValueError at once (not on iteration) when one block of one layer cannot fit.
    """
    first, count = layers or (0, layout.num_layers)
    layers_per_group, tokens_per_piece = _plan(layout, max_chunk_bytes, count)
    return (
        (
            layer_start,
            min(layers_per_group, first + count - layer_start),
            token_start,
            min(tokens_per_piece, num_tokens - token_start),
        )
        for token_start in range(token_start, num_tokens, tokens_per_piece)
        for layer_start in range(first, first + count, layers_per_group)
    )


def plan_tensors(layout: KvLayout, kv: KvTensors, max_chunk_bytes: int = MAX_CHUNK_BYTES,
                 skip_tokens: int = 0, stale_tokens: tuple[int, ...] = ()) -> list[Piece]:
    """The pieces of a layer group of the prompt's tokens [kv.token_start, +n), its arrays checked first.

    kv.token_start: a block multiple (a chunked prefill sends its chunks as they come); the pieces
    name the prompt's token positions. skip_tokens: the leading tokens (whole blocks) of the prompt
    the receiver holds already; no piece covers them. stale_tokens: per layer (of the model), the leading
    tokens (whole blocks) behind its sliding window (`KvLayout.stale_tokens`); no piece covers them either,
    so the group's layers go in runs of equal staleness.
    """
    if kv.token_start % layout.block_size or kv.token_start < 0:
        raise ValueError(f"a piece of KV starts on a block boundary (block size {layout.block_size}), "
                         f"not at token {kv.token_start}")
    _check_group(layout, kv)
    end = kv.token_start + kv.num_tokens
    if skip_tokens % layout.block_size or skip_tokens < 0:
        raise ValueError(f"cannot skip {skip_tokens} tokens: whole blocks of the prompt only")
    stale = stale_tokens[kv.layer_start : kv.layer_start + kv.num_layers] or (0,) * kv.num_layers
    if any(s % layout.block_size for s in stale):
        raise ValueError(f"stale tokens {list(stale)}: whole blocks of the prompt only")
    pieces: list[Piece] = []
    start = 0
    while start < kv.num_layers:  # each run of layers with the same stale prefix
        count = next((i for i in range(start, kv.num_layers) if stale[i] != stale[start]), kv.num_layers) - start
        first = max(kv.token_start, skip_tokens, stale[start])
        if first < end:
            pieces += iter_pieces(layout, end, max_chunk_bytes, (kv.layer_start + start, count), first)
        start += count
    return pieces


def encode_chunks(
    layout: KvLayout,
    k: np.ndarray,
    v: np.ndarray,
    *,
    k_scales: np.ndarray | None = None,
    v_scales: np.ndarray | None = None,
    max_chunk_bytes: int = MAX_CHUNK_BYTES,
) -> Iterator[pb.KvChunk]:
    """k, v: [L, T, Hkv, D] for the true length T, as KvChunks of at most max_chunk_bytes (each piece's
    KvBlocks inside the KvChunk the stream sends), encoded lazily. The arrays and the limit are checked
    at the call (ValueError), before the first message.

    Filled in place: wrapping a finished KvBlocks (`KvChunk(blocks=msg)`) copies its bytes again,
    which cost more than the encoding itself (2.9 ms vs 0.34 ms per 4 MiB).
    """
    num_tokens = _check_arrays(layout, k, v, k_scales, v_scales)
    pieces = iter_pieces(layout, num_tokens, max_chunk_bytes)
    return _encode(layout, pieces, k, v, k_scales, v_scales)


def _encode(
    layout: KvLayout,
    pieces: Iterator[Piece],
    k: np.ndarray,
    v: np.ndarray,
    k_scales: np.ndarray | None,
    v_scales: np.ndarray | None,
    layer_offset: int = 0,
    token_offset: int = 0,
) -> Iterator[pb.KvChunk]:
    """pieces index the arrays; the messages name layers layer_offset + their index, tokens
    token_offset + theirs (a block multiple)."""
    bs = layout.block_size
    for l0, lc, t0, tc in pieces:
        chunk = pb.KvChunk()
        msg = chunk.blocks
        msg.layer_start, msg.layer_count, msg.token_start, msg.token_count = l0 + layer_offset, lc, t0 + token_offset, tc
        msg.k = k[l0 : l0 + lc, t0 : t0 + tc].tobytes()
        msg.v = v[l0 : l0 + lc, t0 : t0 + tc].tobytes()
        if k_scales is not None and v_scales is not None:
            b0, b1 = t0 // bs, -(-(t0 + tc) // bs)
            msg.k_scales = k_scales[l0 : l0 + lc, b0:b1].tobytes()
            msg.v_scales = v_scales[l0 : l0 + lc, b0:b1].tobytes()
        yield chunk


def decode_blocks(layout: KvLayout, msg: pb.KvBlocks) -> KvPiece:
    """Checks the piece's place and byte sizes against the layout (ValueError saying what is wrong)."""
    lc, tc = msg.layer_count, msg.token_count
    where = f"piece layers {msg.layer_start}+{lc} tokens {msg.token_start}+{tc}"
    if lc == 0 or tc == 0:
        raise ValueError(f"{where}: a piece needs at least one layer and one token")
    if msg.layer_start + lc > layout.num_layers:
        raise ValueError(f"{where}: the layout has only {layout.num_layers} layers")
    if msg.token_start % layout.block_size:
        raise ValueError(f"{where}: token_start must be a multiple of the block size {layout.block_size}")
    kv_shape = (lc, tc, layout.num_kv_heads, layout.head_dim)
    k = _view(where, "k", msg.k, layout.np_dtype, kv_shape, layout.dtype)  # read each field once: upb copies
    v = _view(where, "v", msg.v, layout.np_dtype, (*kv_shape[:3], layout.value_dim), layout.dtype)
    k_scales_bytes, v_scales_bytes = msg.k_scales, msg.v_scales
    if layout.dtype not in QUANTIZED:
        if k_scales_bytes or v_scales_bytes:
            raise ValueError(f"{where}: {layout.dtype} KV carries no scales, but the piece has some")
        return KvPiece(msg.layer_start, msg.token_start, k, v, None, None)
    scale_shape = (lc, layout.num_blocks(tc), layout.num_kv_heads)
    k_scales = _view(where, "k_scales", k_scales_bytes, _SCALE_DTYPE, scale_shape, "float32")
    v_scales = _view(where, "v_scales", v_scales_bytes, _SCALE_DTYPE, (*scale_shape[:2], layout.value_heads), "float32")
    return KvPiece(msg.layer_start, msg.token_start, k, v, k_scales, v_scales)


def _view(where: str, name: str, data: bytes, dtype: np.dtype, shape: tuple[int, ...], dtype_name: str):
    """A read-only array over the message's bytes, once their size is right."""
    expected = int(np.prod(shape)) * dtype.itemsize
    if len(data) != expected:
        raise ValueError(
            f"{where}: {name} has {len(data)} bytes, expected {expected} for {dtype_name} {shape}"
        )
    return np.frombuffer(data, dtype=dtype).reshape(shape)


def _plan(layout: KvLayout, max_chunk_bytes: int, num_layers: int) -> tuple[int, int]:
    """(layers per group, tokens per piece) covering num_layers in messages of at most max_chunk_bytes."""
    budget = max_chunk_bytes - _ENVELOPE_BYTES
    per_layer_block = _piece_payload(layout, 1, layout.block_size)
    if per_layer_block > budget:
        raise ValueError(
            f"one block of one layer takes {per_layer_block} bytes, over the {max_chunk_bytes}-byte "
            f"chunk limit ({layout.describe()}); raise the limit or use a smaller block size"
        )
    max_layers = min(num_layers, budget // per_layer_block)
    num_groups = -(-num_layers // max_layers)
    layers_per_group = -(-num_layers // num_groups)
    blocks_per_piece = max(1, budget // (layers_per_group * per_layer_block))
    return layers_per_group, blocks_per_piece * layout.block_size


def kv_bytes(layout: KvLayout, num_tokens: int) -> int:
    """Host bytes of a whole prompt's KV in the wire format, scales included."""
    return _piece_payload(layout, layout.num_layers, num_tokens)


def _piece_payload(layout: KvLayout, num_layers: int, num_tokens: int) -> int:
    kv = num_layers * num_tokens * layout.num_kv_heads * (layout.head_dim + layout.value_dim) * layout.np_dtype.itemsize
    if layout.dtype not in QUANTIZED:
        return kv
    heads = layout.num_kv_heads + layout.value_heads
    return kv + num_layers * layout.num_blocks(num_tokens) * heads * _SCALE_DTYPE.itemsize


def _check_group(layout: KvLayout, kv: KvTensors) -> None:
    count = kv.k.shape[0] if kv.k.ndim == 4 else 0
    if count == 0 or kv.layer_start < 0 or kv.layer_start + count > layout.num_layers:
        raise ValueError(
            f"a layer group of k {kv.k.shape} from layer {kv.layer_start} does not fit the layout's "
            f"{layout.num_layers} layers"
        )
    _check_arrays(dataclasses.replace(layout, num_layers=count, windows=()), kv.k, kv.v, kv.k_scales, kv.v_scales)


def _check_arrays(
    layout: KvLayout, k: np.ndarray, v: np.ndarray, k_scales: np.ndarray | None, v_scales: np.ndarray | None
) -> int:
    if k.ndim != 4 or v.shape != (*k.shape[:3], layout.value_dim):
        want = "both be [L, T, Hkv, D]" if not layout.latent else "be [L, T, 1, latent] and [L, T, 1, 0] (no V)"
        raise ValueError(f"k and v must {want}, got {k.shape} and {v.shape}")
    num_layers, num_tokens, heads, head_dim = k.shape
    if (num_layers, heads, head_dim) != (layout.num_layers, layout.num_kv_heads, layout.head_dim):
        raise ValueError(
            f"k and v are {k.shape}, the layout wants [{layout.num_layers}, T, "
            f"{layout.num_kv_heads}, {layout.head_dim}]"
        )
    if k.dtype != layout.np_dtype or v.dtype != layout.np_dtype:
        raise ValueError(f"k and v are {k.dtype}/{v.dtype}, the layout wants {layout.dtype}: quantize first")
    if layout.dtype not in QUANTIZED:
        if k_scales is not None or v_scales is not None:
            raise ValueError(f"{layout.dtype} KV takes no scales")
        return num_tokens
    for name, scales, count in (("k_scales", k_scales, heads), ("v_scales", v_scales, layout.value_heads)):
        scale_shape = (num_layers, layout.num_blocks(num_tokens), count)
        if scales is None or scales.shape != scale_shape or scales.dtype != _SCALE_DTYPE:
            got = "nothing" if scales is None else f"{scales.dtype} {scales.shape}"
            raise ValueError(
                f"{layout.dtype} KV needs {name} float32 {scale_shape} (per block, per head), got {got}"
            )
    return num_tokens
