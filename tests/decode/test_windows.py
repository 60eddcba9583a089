"""stale_blocks: the prompt blocks some windowed layer got no KV for, exactly what the prefill tier skips
(`KvLayout.stale_tokens`), by `blocks_behind_windows`' rule."""

from __future__ import annotations

from pdserve.kvcache.layout import KvLayout
from pdserve.server.decode.windows import stale_blocks


def test_stale_blocks_are_those_the_narrowest_window_never_reads_again():
    mixed = KvLayout.of(4, 2, 8, 4, "float32", (16, None, 8, None))  # Gemma-like: local and global layers
    assert [stale_blocks(mixed, n) for n in (7, 8, 11, 12, 24, 25)] == [0, 0, 1, 1, 4, 4]
    every = KvLayout.of(2, 2, 8, 4, "float32", (8, 8))
    assert stale_blocks(every, 12) == 1 and stale_blocks(every, 13) == 1 and stale_blocks(every, 15) == 2
    assert stale_blocks(KvLayout.of(2, 2, 8, 4, "float32"), 100) == 0  # no window: every block read again
    for layout in (mixed, every, KvLayout.of(3, 1, 8, 16, "bfloat16", (24, 40, 0))):
        for n in range(1, 120):
            assert stale_blocks(layout, n) == max(layout.stale_tokens(n)) // layout.block_size, (layout, n)
