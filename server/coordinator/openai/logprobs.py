"""Logprobs in OpenAI's two shapes, from the `TokenLogprob`s the workers return.

- Completions (legacy): `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`, one entry per
  token; with `echo` the prompt's tokens come first and the very first has no logprob (null). Each
  `top_logprobs` entry maps token text to logprob and, as OpenAI and vLLM do, holds the chosen token
  too (so up to logprobs + 1 entries).
- Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}`.

Token text is each id's own text (`Tokenizer.token_text`: its bytes as UTF-8, a SentencePiece "▁" a space),
special tokens included; chat's `bytes` are the token's bytes (`Tokenizer.token_bytes`), so that the tokens of
a character spelt in several join to it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.v1 import generation_pb2

TokenText = Callable[[int], str]
TokenBytes = Callable[[int], bytes]


@dataclass
class CompletionLogprobs:
    """Accumulates the legacy completions shape; `text_offset` counts from `start_offset`."""

    token_text: TokenText
    offset: int = 0
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)

    def add_first_prompt_token(self, token_id: int) -> None:
        self._append(self.token_text(token_id), None, None)

    def add(self, entries: Sequence[generation_pb2.TokenLogprob]) -> None:
        for e in entries:
            text = self.token_text(e.token_id)
            top = {self.token_text(t): lp for t, lp in zip(e.top_token_ids, e.top_logprobs)}
            top.setdefault(text, e.logprob)
            self._append(text, e.logprob, top)

    def _append(self, text: str, logprob: float | None, top: dict[str, float] | None) -> None:
        self.tokens.append(text)
        self.token_logprobs.append(logprob)
        self.top_logprobs.append(top)
        self.text_offset.append(self.offset)
        self.offset += len(text)

    def take(self) -> dict[str, Any]:
        """What was added since the last take (a streamed chunk's share), in OpenAI's shape."""
        out = {"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top_logprobs,
               "text_offset": self.text_offset}
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []
        return out


def chat_logprobs(entries: Sequence[generation_pb2.TokenLogprob], token_text: TokenText,
                  token_bytes: TokenBytes | None = None) -> dict[str, Any]:
    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(token_id)
        raw = token_bytes(token_id) if token_bytes is not None else text.encode()
        return {"token": text, "logprob": logprob, "bytes": list(raw)}

    return {"content": [
        {**item(e.token_id, e.logprob),
         "top_logprobs": [item(t, lp) for t, lp in zip(e.top_token_ids, e.top_logprobs)]}
        for e in entries
    ]}
