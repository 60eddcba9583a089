"""The prefill tier's static shapes, in one jax-free module: what a prompt pads to, the packed buffer's sizes
and the context sizes a step compiles for, and which of them a serving worker has compiled so far.

Every shape a prefill worker runs is one of these, so a TPU never recompiles mid-traffic. A worker serves
once the few shapes that can serve any prompt are compiled (warmup.py) and compiles the others while it
serves; meanwhile a step packs only into the shapes already compiled (`CompiledShapes`: a prompt is
chunked into a compiled token bucket, a context padded to a compiled context bucket), so no step ever
waits for a compile. The engine (`engine.py`), its runner and warm-up, and the planner's simulated
prefill worker (`server/plan/workers.py`) all take them from here.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

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


@dataclass(frozen=True, order=True)
class StepShape:
    """The static shape of one step: XLA compiles each once."""

    tokens: int
    """The packed buffer's token slots (a token bucket)."""
    context: int
    """Context slots (a context bucket; 0 when no segment has earlier tokens)."""


def prompt_shapes(num_tokens: int, computed: int, chunk: int, token_sizes: Sequence[int],
                  context_sizes: Sequence[int]) -> list[StepShape]:
    """The shapes a prompt of `num_tokens`, `computed` of them cached, runs in alone, chunk by chunk of at
    most `chunk` tokens, with every shape compiled: what it asks of the compiles."""
    shapes = []
    while computed < num_tokens:
        n = min(chunk, num_tokens - computed)
        shapes.append(StepShape(padded(token_sizes, n), padded(context_sizes, computed)))
        computed += n
    return shapes


class CompiledShapes:
    """The step shapes, and the (rows, prompt length) of penalized sampling, a worker's programs are
    compiled for; it grows as compiles finish (`add`, on any thread: readers see one whole set or the next).

    A step packs into the smallest compiled shape that holds it (`step_shape`); the scheduler asks how
    many tokens a step reading a context may pack (`room`), so it cuts a prompt into chunks that fit;
    penalized sampling pads its rows and prompts to a compiled pair (`penalized_shape`)."""

    def __init__(self, steps: Iterable[StepShape] = (), penalized: Iterable[tuple[int, int]] = ()):
        self.penalized: frozenset[tuple[int, int]] = frozenset(penalized)
        self._set_steps(frozenset(steps))
        self._adding = threading.Lock()
        """Held while a set is replaced: compiles finishing on two threads at once both land."""

    def _set_steps(self, steps: frozenset[StepShape]) -> None:
        contexts = sorted({s.context for s in steps})
        rooms = [max(s.tokens for s in steps if s.context >= c) for c in contexts]
        self.steps = steps  # first: a step `room` packs always finds its shape in `steps`
        self._rooms = (contexts, rooms)  # one assignment: a reader on another thread sees both lists or neither

    @classmethod
    def every(cls, token_sizes: Sequence[int], context_sizes: Sequence[int], rows: Sequence[int],
              lengths: Sequence[int]) -> CompiledShapes:
        """Every shape of the grid (a fully compiled worker's, or one that compiles on first use)."""
        return cls([StepShape(t, c) for c in context_sizes for t in token_sizes],
                   [(r, n) for r in rows for n in lengths])

    def add(self, key: StepShape | tuple[int, int]) -> None:
        """A step shape, or penalized sampling's (rows, length), is compiled now."""
        with self._adding:
            if isinstance(key, StepShape):
                self._set_steps(self.steps | {key})
            else:
                self.penalized = self.penalized | {key}

    def room(self, context: int) -> int:
        """The most token slots a step reading `context` tokens of earlier KV may pack (0: no compiled
        shape holds that context)."""
        contexts, rooms = self._rooms  # ascending contexts; the most token slots of a shape holding each
        i = bisect.bisect_left(contexts, context)
        return rooms[i] if i < len(rooms) else 0

    def step_shape(self, tokens: int, context: int) -> StepShape | None:
        """The smallest compiled shape (fewest token slots, then context slots) that holds a step of
        `tokens` packed tokens reading `context` (None: none does)."""
        return min((s for s in self.steps if s.tokens >= tokens and s.context >= context), default=None)

    def penalized_shape(self, rows: int, length: int) -> tuple[int, int] | None:
        """The smallest compiled (rows, prompt length) of penalized sampling that holds `rows` prompts of
        up to `length` tokens (padded rows and tokens change nothing: sampler.penalize masks them)."""
        return min(((r, n) for r, n in self.penalized if r >= rows and n >= length),
                   key=lambda p: (p[1], p[0]), default=None)
