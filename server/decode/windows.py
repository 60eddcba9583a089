"""Which of a prompt's blocks its windowed layers never got KV for (the prefill tier sends none behind a layer's
sliding window), by the rule of `kvcache/layout.py` `blocks_behind_windows`."""

from __future__ import annotations

from pdserve.kvcache.layout import KvLayout, blocks_behind_windows


def stale_blocks(layout: KvLayout, num_prompt_tokens: int) -> int:
    """Leading blocks of an n-token prompt behind some windowed layer's window for every query after the prompt:
    the prefill tier sent that layer no KV for them (`KvLayout.stale_tokens`), so no other sequence may reuse
    them from the prefix cache (`Sequence.num_stale_blocks`). 0 when no layer is windowed."""
    return max((blocks_behind_windows((w,), layout.block_size, num_prompt_tokens) for w in layout.windows if w),
               default=0)
