"""Server-sent events: each chunk `data: <json>` and a blank line; the stream ends with `data: [DONE]`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from json.encoder import encode_basestring  # type: ignore[attr-defined]  # json.dumps' own (C) string escaper
from typing import Any


def sse_event(data: dict[str, Any] | str) -> bytes:
    """One event; a lone surrogate an error message quotes goes out as its JSON escape (still valid JSON)."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {text}\n\n".encode("utf-8", "backslashreplace")


TEXT_MARK = "\x00pdserve:text\x00"
"""Stands for the text while a choice's TextChunk is rendered (once); it must not occur elsewhere in a chunk."""


@dataclass(frozen=True)
class TextChunk:
    """An SSE chunk that only adds text, as the bytes around the text's JSON string: rendered once per
    choice, then filled per response without a dict or json.dumps (the same bytes as `sse_event(body)`)."""

    head: bytes
    tail: bytes

    @classmethod
    def of(cls, body: dict[str, Any]) -> TextChunk:
        """From a chunk `body` whose text is `TEXT_MARK`."""
        head, mark, tail = sse_event(body).partition(json.dumps(TEXT_MARK, ensure_ascii=False).encode())
        assert mark and mark not in tail, "the text mark must appear once in the chunk"
        return cls(head, tail)

    def render(self, text: str) -> bytes:
        return b"".join((self.head, encode_basestring(text).encode(), self.tail))
