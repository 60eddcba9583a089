"""KvLayout validation, its proto round trip, and check_handshake's messages."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from pdserve.kvcache.layout import HandshakeError, KvLayout, blocks_behind_windows, check_handshake
from pdserve.v1 import worker_pb2 as pb

LAYOUT = KvLayout(num_layers=2, num_kv_heads=4, head_dim=8, block_size=16, dtype="bfloat16")


def test_derived_sizes():
    assert LAYOUT.np_dtype == np.dtype(ml_dtypes.bfloat16)
    assert LAYOUT.bytes_per_token == 2 * 2 * 4 * 8 * 2
    assert [LAYOUT.num_blocks(n) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]
    assert LAYOUT.describe() == "layers=2 kv_heads=4 head_dim=8 block_size=16 dtype=bfloat16 scales=none"
    fp8 = KvLayout(2, 4, 8, 16, "fp8_e4m3", "block_head")
    assert fp8.np_dtype == np.dtype(ml_dtypes.float8_e4m3fn)
    assert fp8.bytes_per_token == 2 * 2 * 4 * 8


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(dtype="float64"),
            r"kv dtype 'float64' is not one of float32, bfloat16, float16, fp8_e4m3, int8",
        ),
        (dict(num_layers=0), r"every KV layout dimension must be positive"),
        (dict(head_dim=-8), r"every KV layout dimension must be positive"),
        (dict(block_size=0), r"every KV layout dimension must be positive"),
        (dict(dtype="int8"), r"kv dtype int8 needs scale granularity block_head, others none"),
        (dict(dtype="fp8_e4m3"), r"kv dtype fp8_e4m3 needs scale granularity block_head"),
        (
            dict(scale_granularity="block_head"),
            r"kv dtype bfloat16 needs scale granularity block_head, others none",
        ),
    ],
)
def test_invalid_layouts_are_refused(kwargs, message):
    fields = dict(num_layers=2, num_kv_heads=4, head_dim=8, block_size=16, dtype="bfloat16") | kwargs
    with pytest.raises(ValueError, match=message):
        KvLayout(**fields)


@pytest.mark.parametrize(
    "layout",
    [LAYOUT, KvLayout(32, 8, 128, 16, "int8", "block_head"), KvLayout(1, 1, 1, 1, "float32")],
)
def test_proto_round_trip(layout):
    msg = layout.to_proto()
    assert KvLayout.from_proto(pb.KvLayout.FromString(msg.SerializeToString())) == layout


def test_proto_without_scale_granularity_means_none():
    msg = pb.KvLayout(num_layers=2, num_kv_heads=4, head_dim=8, block_size=16, dtype="float16")
    assert KvLayout.from_proto(msg) == KvLayout(2, 4, 8, 16, "float16", "none")


def test_proto_with_bad_fields_is_refused():
    with pytest.raises(ValueError, match=r"kv dtype '' is not one of"):
        KvLayout.from_proto(pb.KvLayout())


def test_handshake_passes_when_model_and_layout_match():
    check_handshake(LAYOUT, "a" * 64, KvLayout(2, 4, 8, 16, "bfloat16"), "a" * 64)


def test_handshake_names_both_fingerprints():
    ours, theirs = "0123456789abcdef" + "0" * 48, "fedcba9876543210" + "1" * 48
    with pytest.raises(HandshakeError) as err:
        check_handshake(LAYOUT, ours, LAYOUT, theirs, peer="prefill worker")
    assert str(err.value) == (
        "model fingerprint mismatch: prefill worker serves fedcba9876543210…, this worker "
        "0123456789abcdef…; both tiers must load the same checkpoint"
    )


def test_handshake_names_both_layouts():
    theirs = KvLayout(2, 4, 8, 32, "fp8_e4m3", "block_head")
    with pytest.raises(HandshakeError) as err:
        check_handshake(LAYOUT, "f" * 64, theirs, "f" * 64)
    assert str(err.value) == (
        "KV layout mismatch: sender sends [layers=2 kv_heads=4 head_dim=8 block_size=32 dtype=fp8_e4m3 "
        "scales=block_head], this worker holds [layers=2 kv_heads=4 head_dim=8 block_size=16 "
        "dtype=bfloat16 scales=none]"
    )
    assert isinstance(err.value, ValueError)


def test_layer_windows_travel_in_the_handshake():
    windowed = KvLayout.of(4, 2, 8, 16, "int8", windows=(24, None, 24, None))
    assert windowed.windows == (24, 0, 24, 0) and "windows=24,0,24,0" in windowed.describe()
    assert KvLayout.from_proto(windowed.to_proto()) == windowed
    assert KvLayout.from_proto(KvLayout.of(4, 2, 8, 16, "int8").to_proto()).windows == ()
    with pytest.raises(HandshakeError, match=r"sends \[.*block_head\], this worker holds \[.*windows=24,0,24,0\]"):
        check_handshake(windowed, "f", KvLayout.of(4, 2, 8, 16, "int8"), "f")
    with pytest.raises(ValueError, match="one per layer"):
        KvLayout.of(4, 2, 8, 16, "int8", windows=(24, 24))
    # A 100-token prompt, window 24, blocks of 16: the next query reads 77.., so blocks 0-3 are stale.
    assert windowed.stale_tokens(100) == (64, 0, 64, 0) and windowed.stale_tokens(24) == (0, 0, 0, 0)


def test_blocks_behind_every_layers_window():
    """A query at p reads keys p - W < j: with windows 8 and 16 (the widest counts) and blocks of 4, queries from
    position 27 on read keys from 12 on, so blocks 0-2 are behind; a full-attention layer keeps every block."""
    assert [blocks_behind_windows((8, 16), 4, q) for q in (0, 15, 18, 19, 27, 30)] == [0, 0, 0, 1, 3, 3]
    assert blocks_behind_windows((8, 0), 4, 100) == blocks_behind_windows((), 4, 100) == 0
    layout = KvLayout.of(2, 2, 8, 4, "float32", windows=(8, 16))
    assert layout.blocks_behind_windows(27) == 3 == min(layout.stale_tokens(27)) // 4
