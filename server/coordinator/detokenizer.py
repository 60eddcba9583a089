"""Token ids to text, one piece at a time, and stop strings found across piece boundaries."""

from __future__ import annotations

from typing import Protocol

from tokenizers import Tokenizer as HfTokenizer
from tokenizers.decoders import DecodeStream

PROMPT_CONTEXT = 5
"""Prompt tokens decoded in front of the output, so the first output piece gets its spacing right."""


MAX_CHAR_TOKENS = 3
"""An incomplete UTF-8 character at the tail has at most 3 bytes, so it lies in the last 3 tokens."""


class Decoder(Protocol):
    """The model's tokenizer (`Tokenizer`): `hf` is its `tokenizers.Tokenizer`."""

    hf: HfTokenizer

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Output ids to text deltas through `tokenizers`' DecodeStream, never splitting a multi-byte character.

    DecodeStream holds back ids whose bytes do not yet make a whole character, decoding only a short
    window each step. What it lacks is added here: ids that can never complete a character (invalid
    bytes) are let go as U+FFFD once more than MAX_CHAR_TOKENS wait, and `flush` gives what is held
    at the end of the output.
    """

    def __init__(self, tokenizer: Decoder, prompt_ids: list[int]):
        self.tokenizer = tokenizer
        self.context = list(prompt_ids[-PROMPT_CONTEXT:])
        """The last ids whose text is out (prompt ids at first), for the spacing of what follows."""
        self.held: list[int] = []
        """Ids DecodeStream holds back: their text is not out yet."""
        self.stream = DecodeStream(self.context, skip_special_tokens=True)

    def push(self, ids: list[int]) -> str:
        """Takes new output ids; returns the text they complete (possibly ""). Several ids (a step's merged
        events) go through DecodeStream in one call; should their tail be an incomplete character, they
        go again one by one (a fresh stream from the context), so each is held exactly as alone."""
        if len(ids) > 1:
            chunk = self.stream.step(self.tokenizer.hf, list(ids))
            if chunk is not None:
                self.context = (self.context + self.held + list(ids))[-PROMPT_CONTEXT:]
                self.held = []
                return chunk
            again, self.held = [*self.held, *ids], []
            self.stream = DecodeStream(self.context, skip_special_tokens=True)
            return self._push_each(again)
        return self._push_each(ids)

    def _push_each(self, ids: list[int]) -> str:
        pieces = []
        for i in ids:
            chunk = self.stream.step(self.tokenizer.hf, i)
            if chunk is None:
                self.held.append(i)
                if len(self.held) > MAX_CHAR_TOKENS:
                    pieces.append(self._let_go(len(self.held) - MAX_CHAR_TOKENS))
            else:
                self.context = (self.context + self.held + [i])[-PROMPT_CONTEXT:]
                self.held = []
                pieces.append(chunk)
        return "".join(pieces)

    def flush(self) -> str:
        """At the end of the output: whatever is held back (an incomplete character decodes as U+FFFD)."""
        text, self.held = self._text(self.held), []
        return text

    def _text(self, ids: list[int]) -> str:
        """The text `ids` add after the context."""
        if not ids:
            return ""
        before = self.tokenizer.decode(self.context)
        return self.tokenizer.decode(self.context + ids)[len(before) :]

    def _let_go(self, n: int) -> str:
        """The first n held ids hold bytes that never become a character: out they go, and a fresh
        stream takes the rest."""
        gone, rest = self.held[:n], self.held[n:]
        text = self._text(gone)
        self.context = (self.context + gone)[-PROMPT_CONTEXT:]
        self.held = []
        self.stream = DecodeStream(self.context, skip_special_tokens=True)
        return text + self.push(rest)


class StopStringMatcher:
    """Finds stop strings in streamed text; holds back text that could still begin one."""

    def __init__(self, stops: list[str]):
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        self.stops = list(stops)
        self.held = ""
        self.stopped = False
        self.matched: str | None = None
        """The stop string found (the earliest in the text; the first listed on a tie)."""

    def feed(self, text: str) -> tuple[str, bool]:
        """Appends text; returns (the text now safe to emit, whether a stop string was found).

        On a stop the text is cut right before the earliest stop string, and the matcher stays
        stopped: further feeds return ("", True).
        """
        if self.stopped:
            return "", True
        if not self.stops:
            return text, False
        buf = self.held + text
        hits = [(i, n, s) for n, (i, s) in enumerate((buf.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            at, _, self.matched = min(hits)
            self.stopped, self.held = True, ""
            return buf[:at], True
        keep = self._longest_stop_prefix_suffix(buf)
        self.held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """At the end of the output: the held-back text, which can no longer become a stop string."""
        held, self.held = self.held, ""
        return "" if self.stopped else held

    def _longest_stop_prefix_suffix(self, buf: str) -> int:
        """Length of the longest tail of buf that is a proper prefix of some stop string."""
        best = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(buf)), best, -1):
                if buf.endswith(stop[:k]):
                    best = k
                    break
        return best


class Completion:
    """One request's output as the client sees it: every id, and the text up to the first stop string."""

    def __init__(self, tokenizer: Decoder, prompt_ids: list[int], stops: list[str], min_tokens: int = 0):
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
        self.matcher = StopStringMatcher(stops)
        self.num_tokens = 0
        self.min_tokens = min_tokens
        """Stop strings are looked for from the min_tokens-th token's text on (vLLM's min_tokens)."""

    @property
    def stopped(self) -> bool:
        """A stop string was found: later ids are not part of the output."""
        return self.matcher.stopped

    def add(self, ids: list[int]) -> tuple[list[int], str]:
        """Takes new ids; returns those that belong to the output and the text now safe to send.

        With stop strings the ids go one at a time, so the output ends at the id that completed one.
        """
        if not self.matcher.stops:
            self.num_tokens += len(ids)
            return list(ids), self.detokenizer.push(list(ids))
        taken: list[int] = []
        pieces: list[str] = []
        for i in ids:
            if self.stopped:
                break
            taken.append(i)
            text = self.detokenizer.push([i])
            if self.num_tokens + len(taken) >= self.min_tokens:
                text, _ = self.matcher.feed(text)
            pieces.append(text)
        self.num_tokens += len(taken)
        return taken, "".join(pieces)

    def finish(self) -> str:
        """At the end: the held-back text (an incomplete last character, a possible stop prefix)."""
        text, stopped = self.matcher.feed(self.detokenizer.flush())
        return text if stopped else text + self.matcher.flush()
