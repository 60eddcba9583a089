"""One sequence's structured-output state: an llguidance matcher advanced by every token it outputs.

Made by `Grammars.constraint` from a compiled grammar; a tier fills the next token's mask row from it before
sampling (`fill`) and advances it with the token sampled (`advance`). A preempted sequence keeps it; a
migrated one (its outputs so far at the end of its prompt) gets a fresh one that `replay`s them."""

from __future__ import annotations

from collections.abc import Iterable

import llguidance
import numpy as np

from pdserve.server.structured.bitmask import clear_from


class Constraint:
    def __init__(self, matcher: llguidance.LLMatcher, num_tokens: int):
        self.matcher = matcher
        self.num_tokens = num_tokens
        """The tokenizer's ids: a mask allows none at or past it (the model's padding of the vocabulary)."""

    def fill(self, row: np.ndarray) -> None:
        """The next token's allowed ids into `row`, int32 [words] (contiguous)."""
        self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        clear_from(row, self.num_tokens)

    def advance(self, token: int) -> bool:
        """Takes the sampled token; False: the grammar does not allow it (the matcher is in error now)."""
        return self.matcher.consume_token(token) and not self.matcher.is_error()

    def replay(self, tokens: Iterable[int]) -> None:
        """Takes the tokens a sequence already output (a migration's, a re-prefill's); ValueError if the
        grammar does not allow them."""
        tokens = list(tokens)
        if tokens and self.matcher.try_consume_tokens(tokens) != len(tokens):
            raise ValueError(f"the {len(tokens)} outputs so far do not fit the grammar: {self.error}")

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more (the sequence stops, finish_reason stop)."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        return self.matcher.get_error()

    @property
    def hit_limit(self) -> bool:
        """The matcher is in error because the grammar outgrew one of llguidance's parser limits (a row's
        items, lexer fuel, ...): the request's fault, never a token the mask allowed being refused."""
        return is_limit_error(self.error)


LIMIT_ERROR_MARKS = ("max is", "fuel", "limit", "too many", "too large", "too complex")
"""Words llguidance's parser-limit errors carry ("Current row has 20001 items; max is 2000", "lexer fuel")."""


def is_limit_error(message: str) -> bool:
    message = message.lower()
    return any(mark in message for mark in LIMIT_ERROR_MARKS)
