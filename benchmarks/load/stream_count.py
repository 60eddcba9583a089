"""What the relay benchmark's clients received, and every stream checked against what the workers sent."""

from __future__ import annotations


class StreamCount:
    """Running totals of one case's client streams (read before and after the measured window).

    A mismatch is a stream whose tokens differ from what the fake workers generate for it: exactly
    `max_tokens` (ignore_eos), and the server's own usage where it reports one. The benchmark fails on one.
    """

    def __init__(self) -> None:
        self.tokens = 0
        self.messages = 0
        """Responses that carried tokens (gRPC messages or SSE events)."""
        self.requests = 0
        """Requests that ended whole and checked: their tokens equal max_tokens (and the usage)."""
        self.errors = 0
        self.first_error = ""
        self.mismatches = 0
        self.first_mismatch = ""

    @classmethod
    def total(cls, parts: list[dict]) -> StreamCount:
        """The sum of several clients' counts (each a `vars()` of one), first messages of the first that has one."""
        out = cls()
        for part in parts:
            for name, value in part.items():
                setattr(out, name, getattr(out, name) + value if isinstance(value, int) else getattr(out, name) or value)
        return out

    def error(self, what: str) -> None:
        self.errors += 1
        self.first_error = self.first_error or what[:300]

    def mismatch(self, what: str) -> None:
        self.mismatches += 1
        self.first_mismatch = self.first_mismatch or what[:300]

    def ended(self, tokens: int, max_tokens: int, what: str) -> None:
        """A stream ended whole after `tokens` tokens."""
        if tokens == max_tokens:
            self.requests += 1
        else:
            self.mismatch(f"{what}: a stream ended after {tokens} tokens; it asked for (and the workers "
                          f"generate) {max_tokens}")
