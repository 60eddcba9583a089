"""vLLM's KV cache groups as pdserve needs them: which table each layer's blocks are in, each layer's window,
and how many of vLLM's blocks a prompt takes.

vLLM keeps one block table per KV cache group (`KVCacheConfig.kv_cache_groups`, each a list of layer names
and one spec). A model whose layers all attend alike has one group; under vLLM's hybrid allocator Gemma 2/3's
full-attention and sliding-window layers are in groups of their own, and a windowed group's table holds
vLLM's null block for every block wholly behind the window (`SlidingWindowManager`: the same
max(0, n - W + 1) // B leading blocks of an n-token prompt as `KvLayout.stale_tokens`, which the prefill
tier therefore never sends). A full-attention spec that still carries a window (a windowed layer in a group
of full ones, when vLLM's hybrid allocator is off) holds every block, and its attention reads the window.

No vLLM import: the config is read by its attributes (`layer_names`, `kv_cache_spec.block_size`,
`kv_cache_spec.sliding_window`), so the start-up's checks are tested without vLLM.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def layer_index(name: str) -> int:
    """The decoder layer of an attention module's name ('model.layers.3.self_attn.attn' -> 3)."""
    found = _LAYER_INDEX.findall(f".{name}.")
    if not found:
        raise ValueError(f"no layer index in vLLM's layer name {name!r}")
    return int(found[0])


@dataclass(frozen=True)
class CacheGroups:
    layer_group: tuple[int, ...]
    """Decoder layer i's group."""
    block_sizes: tuple[int, ...]
    """Group g's block size (tokens)."""
    layer_windows: tuple[int, ...]
    """Decoder layer i's sliding window in vLLM's attention (0: full attention)."""
    freed_windows: tuple[int, ...]
    """Group g's window when vLLM frees its blocks behind it (a sliding-window group), else 0."""

    @classmethod
    def of(cls, kv_cache_config, num_layers: int, block_size: int) -> CacheGroups:
        """From vLLM's KVCacheConfig (None: one full-attention group of every layer, blocks of `block_size`)."""
        groups = [] if kv_cache_config is None else list(kv_cache_config.kv_cache_groups)
        if not groups:
            return cls((0,) * num_layers, (block_size,), (0,) * num_layers, (0,))
        layer_group: dict[int, int] = {}
        windows: dict[int, int] = {}
        for g, group in enumerate(groups):
            per_layer = getattr(group.kv_cache_spec, "kv_cache_specs", None) or {}  # UniformTypeKVCacheSpecs'
            for name in group.layer_names:
                layer_group[layer_index(name)] = g
                windows[layer_index(name)] = _window(per_layer.get(name, group.kv_cache_spec))
        if sorted(layer_group) != list(range(num_layers)):
            raise ValueError(f"vLLM's KV cache groups cover layers {sorted(layer_group)}, the model has "
                             f"{num_layers}")
        freed = tuple(_window(g.kv_cache_spec) if _frees_behind_window(g.kv_cache_spec) else 0 for g in groups)
        return cls(tuple(layer_group[i] for i in range(num_layers)),
                   tuple(g.kv_cache_spec.block_size for g in groups),
                   tuple(windows[i] for i in range(num_layers)), freed)

    def check_windows(self, windows: tuple[int, ...], num_layers: int) -> None:
        """Refuses a vLLM whose layers' windows are not pdserve's (`KvLayout.windows`; () none): the prefill
        tier would skip blocks vLLM reads, or send what it never reads, and the tokens would differ."""
        ours = windows or (0,) * num_layers
        if tuple(ours) != self.layer_windows:
            show = lambda ws: ",".join(map(str, ws))  # noqa: E731
            raise ValueError(f"vLLM attends with layer windows {show(self.layer_windows)}, pdserve's config "
                             f"of the checkpoint {show(ours)}: the KV the prefill tier sends would not be what "
                             f"vLLM reads; use --engine native for this checkpoint")

    def blocks_for(self, num_tokens: int) -> int:
        """vLLM's blocks an n-token prompt takes over all groups: every block of a full-attention group's
        table, a sliding-window group's less those behind the window (null blocks)."""
        total = 0
        for size, window in zip(self.block_sizes, self.freed_windows):
            blocks = -(-num_tokens // size)
            total += blocks - (max(0, num_tokens - window + 1) // size if window else 0)
        return total


def _window(spec) -> int:
    return getattr(spec, "sliding_window", None) or 0


def _frees_behind_window(spec) -> bool:
    """vLLM's SlidingWindowSpec (or a subclass): its manager replaces the blocks behind the window by nulls."""
    return any(c.__name__ == "SlidingWindowSpec" for c in type(spec).__mro__)
