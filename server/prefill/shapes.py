"""The prefill tier's static shapes, in one jax-free module: what a prompt pads to, the packed buffer's sizes
and the context sizes a step compiles for.

Every shape a prefill worker runs is one of these, so every program is compiled before serving (warmup.py)
and a TPU never recompiles mid-traffic. The engine (`engine.py`), its runner and warm-up, and the planner's
simulated prefill worker (`server/plan/workers.py`) all take them from here.
"""

from __future__ import annotations

from collections.abc import Sequence

CONTEXT_BUCKET = 256
"""The smallest context bucket (all earlier tokens a step's segments read, together)."""


def pow2(n: int) -> int:
    """The smallest power of two >= n (n >= 1)."""
    return 1 << (n - 1).bit_length()


def bucket_length(n: int, max_len: int, min_bucket: int = 16) -> int:
    """The padded length for an n-token prompt: a power of two >= n and >= min_bucket, capped at max_len."""
    if not 1 <= n <= max_len:
        raise ValueError(f"prompt length {n} is outside [1, {max_len}]")
    return min(max(min_bucket, pow2(n)), max_len)


def buckets(smallest: int, largest: int, growth: int = 2) -> list[int]:
    """smallest, smallest * growth, ... below `largest`, then `largest`."""
    out = []
    b = smallest
    while b < largest:
        out.append(b)
        b *= growth
    return [*out, largest]


def token_buckets(max_batch_tokens: int, max_batch_size: int, max_len: int, min_bucket: int) -> list[int]:
    """The packed buffer's sizes: powers of two up to what a step can fill (the token budget, or
    max_batch_size prompts of max_len)."""
    largest = min(max_batch_tokens, pow2(max_batch_size) * max_len)
    return buckets(min(min_bucket, largest), largest)


def context_buckets(max_len: int, has_context: bool) -> list[int]:
    """0, then context sizes growing 4x up to max_len when steps can read earlier KV (chunked prompts or a
    prefix cache): padded context costs little (attention skips key blocks no query reads), a shape costs a
    compile."""
    return [0, *buckets(min(CONTEXT_BUCKET, max_len), max_len, growth=4)] if has_context else [0]


def padded(sizes: Sequence[int], n: int) -> int:
    """The first of `sizes` (ascending) that holds n; n itself past the largest."""
    return next((b for b in sizes if b >= n), n)
