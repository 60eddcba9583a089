"""Token ids to text, one piece at a time, and stop strings found across piece boundaries."""

from __future__ import annotations

import os
from typing import Protocol

PROMPT_CONTEXT = 5
"""Prompt tokens decoded in front of the output, so the first output piece gets its spacing right."""

MAX_HELD = 16
"""Ids held back at most. An incomplete UTF-8 character at the tail has at most 3 bytes, so ids are held
only while the tokens around it cut characters apart; past this many (a model chaining such tokens) the
oldest go out as they decode alone, so the window, and each step's decode, stays short."""

MAX_RUN = 64
"""A run of byte pieces is held whole up to this many ids (16 characters or more; text has spaces and
common characters between, a piece that ends the run); past it, it goes out as it decodes so far, so what is
held and each step's work stay bounded, and only a byte that later makes the run invalid could then
differ from the whole decode. The prompt's ids are read back at most this far for the start of its run."""

REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    """The model's tokenizer (`Tokenizer`). A tokenizer may also name its byte pieces and special tokens
    (`byte_pieces`, `special_ids`: `Tokenizer`'s); one that does not has neither."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Output ids to text deltas, never splitting a multi-byte character.

    The text given out is a function of the ids alone, not of how they arrive (one per event, or a step's
    merged events): ids go through one at a time. After each, the text of context + held ids is decoded;
    its last character, if U+FFFD, may be an incomplete character that later bytes complete, so only what
    comes before it is sure. The longest run of held ids whose own text is a prefix of that sure text is
    given out and joins the context (its last PROMPT_CONTEXT to 2 * PROMPT_CONTEXT ids, for the spacing
    of what follows). So the pieces joined equal the decode of the whole output, invalid bytes included
    (as U+FFFD, at once when they can no longer become a character), and `flush` gives what is held at
    the end.

    Byte fallback (SentencePiece's `<0xXX>` pieces: Llama 2, Mistral, Gemma) decodes a run of byte pieces
    as a whole: its UTF-8 text, or one U+FFFD per byte when the run is not valid UTF-8, so a byte that
    comes later can still turn the run's characters into U+FFFDs. A run is therefore held until a piece
    that is not a byte ends it (special tokens that are skipped do not end it; up to MAX_RUN ids), and ids
    are only given out up to such a piece; with no byte pieces in the vocabulary (byte-level BPE) nothing
    changes.
    """

    def __init__(self, tokenizer: Decoder, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.byte_pieces: dict[int, int] = getattr(tokenizer, "byte_pieces", {})
        """Ids the decoder reads as one byte each (byte fallback), and their byte; empty for byte-level BPE."""
        self.invisible: frozenset[int] = getattr(tokenizer, "special_ids", frozenset()) \
            if skip_special_tokens else frozenset()
        """Ids the decode drops (special tokens when skipped): they neither end a byte run nor begin one."""
        self.in_run = False
        """The last visible id held is a byte piece: the run's text is not settled yet."""
        self.context = self._prompt_context(prompt_ids)
        """The last ids whose text is out (prompt ids at first)."""
        self.context_text = self._decode(self.context)
        self.held: list[int] = []
        """Ids whose text is not out yet."""

    def _prompt_context(self, prompt_ids: list[int]) -> list[int]:
        """The prompt's last PROMPT_CONTEXT ids, or from the start of its last run of byte pieces when they
        begin inside it (output bytes may continue that run, which decodes as a whole)."""
        start = max(0, len(prompt_ids) - PROMPT_CONTEXT)

        def in_run(token: int) -> bool:
            return token in self.byte_pieces or token in self.invisible

        while start > 0 and self.byte_pieces and len(prompt_ids) - start < MAX_RUN \
                and in_run(prompt_ids[start]) and in_run(prompt_ids[start - 1]):
            start -= 1
        return list(prompt_ids[start:])

    def push(self, ids: list[int]) -> str:
        """Takes new output ids; returns the text they complete (possibly "")."""
        return "".join(self._push_one(i) for i in ids)

    def flush(self) -> str:
        """At the end of the output: whatever is held back (an incomplete character decodes as U+FFFD)."""
        return self._give_out(len(self.held), self._decode(self.context + self.held))

    def _push_one(self, token: int) -> str:
        self.held.append(token)
        if self.byte_pieces and token not in self.invisible:
            self.in_run = token in self.byte_pieces
        if self.in_run:  # no decode: the run's text waits for the piece that ends it
            return "" if len(self.held) <= MAX_RUN else self._run_overflow()
        text = self._decode(self.context + self.held)
        if not text.endswith(REPLACEMENT):
            return self._give_out(len(self.held), text)
        sure = text[:-1]
        for n in range(len(self.held) - 1, max(0, len(self.held) - 1 - MAX_HELD), -1):
            if not self._can_cut(n):
                continue
            part = self._decode(self.context + self.held[:n])
            if sure.startswith(part) and len(part) >= len(self.context_text):
                return self._give_out(n, part)
        if len(self.held) > MAX_HELD:
            n = len(self.held) - MAX_HELD
            while n > 1 and not self._can_cut(n):
                n -= 1
            return self._give_out(n, self._decode(self.context + self.held[:n]))
        return ""

    def _run_overflow(self) -> str:
        """A run past MAX_RUN ids: its whole characters go out (an incomplete one has at most 3 bytes); when
        none do, the run is not UTF-8 and never will be, so its bytes go out as U+FFFDs, one each, as the
        whole decode has them. What is held of the run begins on a character's first byte (where the last
        ids given out ended)."""
        data, ends = bytearray(), []
        for i, token in enumerate(self.held):
            if token in self.byte_pieces:
                data.append(self.byte_pieces[token])
                ends.append(i + 1)
            elif token not in self.invisible:  # a piece that ended an earlier run: this one begins after it
                data, ends = bytearray(), []
        for k in range(len(data), max(0, len(data) - 4), -1):
            try:
                data[:k].decode("utf-8")
            except UnicodeDecodeError:
                continue
            n = ends[k - 1]
            return self._give_out(n, self._decode(self.context + self.held[:n]))
        return self._give_out(len(self.held), self._decode(self.context + self.held))

    def _can_cut(self, n: int) -> bool:
        """The first n held ids can go out alone: they do not end inside a run of byte pieces."""
        if not self.byte_pieces:
            return True
        for token in reversed(self.held[:n]):
            if token not in self.invisible:
                return token not in self.byte_pieces
        return True

    def _give_out(self, n: int, text: str) -> str:
        """The first n held ids, whose text with the context is `text`, go out and join the context."""
        piece = text[_common_prefix(self.context_text, text):]
        given = self.held[:n]
        self.context, self.held, self.context_text = self.context + given, self.held[n:], text
        if len(self.context) <= 2 * PROMPT_CONTEXT:  # the window is cut back now and then, not every id
            return piece
        if not self.in_run:
            self.context = self.context[-PROMPT_CONTEXT:]
        elif len(self.context) > 2 * MAX_RUN:
            # inside a run that may go on (it decodes as a whole): back to the ids just given out, which
            # begin where the last ones ended, on a character's first byte
            self.context = given
        else:
            return piece
        self.context_text = self._decode(self.context)
        return piece

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""


def _common_prefix(a: str, b: str) -> int:
    """len(a) when b begins with a, as it does but where the context's text ended in an incomplete
    character (a prompt given as ids) that the output's first bytes complete."""
    return len(a) if b.startswith(a) else len(os.path.commonprefix([a, b]))


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

    def __init__(self, tokenizer: Decoder, prompt_ids: list[int], stops: list[str], min_tokens: int = 0,
                 skip_special_tokens: bool = True):
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
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
