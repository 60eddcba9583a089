"""The n-gram proposer (vLLM's `ngram`, prompt lookup decoding): the sequence's last n tokens looked up in
its earlier tokens (prompt and outputs), longest n first; the tokens that followed their latest earlier
occurrence with k tokens after it (else their earliest, which has the most) are the proposal: in a loop the
latest occurrence ends just before the suffix, so recency alone would propose one token. No model, no
state: a function of the tokens so far."""

from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, k: int, min_n: int, max_n: int):
        self.k = k
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: list[int], k: int | None = None) -> list[int]:
        """Up to k (default: the proposer's) tokens to follow `token_ids`; [] when no suffix n-gram recurs."""
        k = self.k if k is None else k
        if k <= 0 or len(token_ids) < self.min_n + 1:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)  # [L]
        L = len(tokens)
        ends = np.flatnonzero(tokens[: L - 1] == tokens[L - 1])  # earlier positions holding the last token
        found = None
        for n in range(1, min(self.max_n, L - 1) + 1):
            if n > 1:  # the matches of the (n - 1)-gram that extend to the n-gram
                ends = ends[ends >= n - 1]
                ends = ends[tokens[ends - (n - 1)] == tokens[L - n]]
            if not len(ends):
                break
            if n >= self.min_n:
                found = ends
        if found is None:
            return []
        full = found[L - (found + 1) >= k]  # occurrences followed by k tokens
        start = int(full[-1] if len(full) else found[0]) + 1
        return tokens[start : start + k].tolist()
