"""vLLM's KV cache groups read for the connector and the engine (no vllm needed: the config by its attributes)."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from pdserve.kvcache.layout import KvLayout
from pdserve.server.decode.vllm.cache_groups import CacheGroups, layer_index


@dataclass
class FullAttentionSpec:  # vLLM's names: the class name tells a group whose blocks behind a window are freed
    block_size: int
    sliding_window: int | None = None


@dataclass
class SlidingWindowSpec:
    block_size: int
    sliding_window: int


def config(*groups: tuple[list[int], object]):
    return SimpleNamespace(kv_cache_groups=[
        SimpleNamespace(layer_names=[f"model.layers.{i}.self_attn.attn" for i in layers], kv_cache_spec=spec)
        for layers, spec in groups])


def test_layer_index_is_the_decoder_layer_in_vllms_name():
    assert layer_index("model.layers.3.self_attn.attn") == 3
    assert layer_index("model.layers.12.self_attn.attn") == 12
    with pytest.raises(ValueError, match="no layer index"):
        layer_index("lm_head")


def test_one_full_group_is_every_layer_in_one_table():
    groups = CacheGroups.of(config(([0, 1], FullAttentionSpec(32))), 2, 32)
    assert groups == CacheGroups((0, 0), (32,), (0, 0), (0,))
    assert CacheGroups.of(None, 2, 32) == groups  # no config: the same
    assert groups.blocks_for(1) == 1 and groups.blocks_for(64) == 2 and groups.blocks_for(65) == 3
    groups.check_windows((), 2)


def test_gemmas_hybrid_groups_take_blocks_in_each_table_less_the_windows_null_blocks():
    """Gemma 2 under vLLM's hybrid allocator: local layers 0 and 2 in a sliding-window group, global 1 and 3 in
    a full one. A 100-token prompt, window 24, blocks of 32: the full table 4 blocks, the windowed one 4 less
    the 2 wholly behind the window (the next query reads keys 77..100): the same blocks the prefill tier skips."""
    groups = CacheGroups.of(config(([1, 3], FullAttentionSpec(32)), ([0, 2], SlidingWindowSpec(32, 24))), 4, 32)
    assert groups.layer_group == (1, 0, 1, 0) and groups.layer_windows == (24, 0, 24, 0)
    assert groups.freed_windows == (0, 24)
    assert groups.blocks_for(100) == 4 + 2
    layout = KvLayout.of(4, 2, 32, 32, "float32", windows=(24, None, 24, None))
    assert layout.stale_tokens(100) == (64, 0, 64, 0)
    assert groups.blocks_for(20) == 2  # shorter than the window: a block in each
    groups.check_windows(layout.windows, 4)


def test_a_window_in_a_full_group_holds_every_block():
    """vLLM's hybrid allocator off: a windowed layer's spec is a full one that still carries its window."""
    groups = CacheGroups.of(config(([0, 1], FullAttentionSpec(32, 24))), 2, 32)
    assert groups.layer_windows == (24, 24) and groups.freed_windows == (0,)
    assert groups.blocks_for(100) == 4
    groups.check_windows((24, 24), 2)


def test_windows_that_differ_from_pdserves_are_refused_naming_both():
    groups = CacheGroups.of(config(([0, 1], SlidingWindowSpec(32, 24))), 2, 32)
    with pytest.raises(ValueError, match=r"vLLM attends with layer windows 24,24, pdserve's config of the "
                                         r"checkpoint 0,0: .* use --engine native"):
        groups.check_windows((), 2)
    with pytest.raises(ValueError, match="layer windows 24,24, pdserve's config of the checkpoint 16,16"):
        groups.check_windows((16, 16), 2)


def test_groups_that_miss_a_layer_are_refused():
    with pytest.raises(ValueError, match=r"cover layers \[0\], the model has 2"):
        CacheGroups.of(config(([0], FullAttentionSpec(32))), 2, 32)
