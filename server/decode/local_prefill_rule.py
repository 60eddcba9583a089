"""Conditional disaggregation on the decode worker: when a prompt is computed here instead of on the prefill tier.

The coordinator sends its thresholds with each request (`DecodeRequest.local_prefill_max_uncached`, `_min_cached`,
from its --conditional-disagg-* flags); the scheduler applies them when it admits the request, the moment it knows
which of the prompt's blocks its prefix cache holds, and `reserved.local_prefill` tells the coordinator what it
chose. A conversation's next turn lands here (the router's prefix hash), finds its history cached (the answers
too: `Scheduler.finished_step`), and computes only the new turn's tokens, with no round trip through the prefill
tier and no KV on the wire.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.v1 import worker_pb2 as pb


@dataclass(frozen=True)
class LocalPrefillRule:
    max_uncached: int
    """Prefill here when fewer than this many of the prompt's tokens are not cached (> 0)."""
    min_cached: int = 1
    """... and at least this many are (1: any full block; 0: a prompt the worker holds nothing of, too)."""

    @classmethod
    def of(cls, request: pb.DecodeRequest) -> LocalPrefillRule | None:
        """The request's rule; None when it asks for none (or for a local prefill whatever is cached)."""
        if request.local_prefill or not request.local_prefill_max_uncached:
            return None
        return cls(request.local_prefill_max_uncached, request.local_prefill_min_cached)

    def local(self, num_prompt_tokens: int, num_cached_tokens: int) -> bool:
        """Whether a prompt of which num_cached_tokens (leading) are cached here is computed here."""
        return (num_cached_tokens >= self.min_cached
                and num_prompt_tokens - num_cached_tokens < self.max_uncached)
