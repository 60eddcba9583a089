"""Which worker of a tier takes the next request: pluggable policies, named in the config.

A policy is a function of the routable workers (and, for decode, the tokens the request's KV holds)
that returns one of them, or None when none can take the request now.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from pdserve.server.coordinator.router import Worker

PrefillPolicyName = Literal["least-queued"]
DecodePolicyName = Literal["most-free-blocks", "power-of-two"]

PrefillPolicy = Callable[[list["Worker"]], "Worker | None"]
DecodePolicy = Callable[[list["Worker"], int], "Worker | None"]


def least_queued(workers: list[Worker]) -> Worker | None:
    """Fewest queued prefill tokens, then fewest in-flight requests."""
    return min(workers, key=lambda w: (w.queued_prefill_tokens(), w.inflight), default=None)


def _fits(worker: Worker, tokens: int) -> bool:
    return worker.under_running_cap() and worker.free_kv_blocks() >= worker.blocks_for(tokens)


LARGE_POOL = 16
"""From this many fitting decode workers on, `most-free-blocks` samples two (power of two choices)."""


def _emptiest(fitting: list[Worker]) -> Worker | None:
    return min(fitting, key=lambda w: (-w.free_kv_blocks(), w.inflight), default=None)


def most_free_blocks(workers: list[Worker], tokens: int, rng: random.Random = random.Random()) -> Worker | None:
    """Most free KV blocks among the workers under their running-request cap with room for `tokens`.

    In a large pool every coordinator would herd onto the same emptiest worker between load reports,
    so there it takes the better of two random fitting workers instead.
    """
    fitting = [w for w in workers if _fits(w, tokens)]
    if len(fitting) >= LARGE_POOL:
        return _emptiest(rng.sample(fitting, 2))
    return _emptiest(fitting)


def power_of_two(workers: list[Worker], tokens: int, rng: random.Random = random.Random()) -> Worker | None:
    """Two random fitting workers, the one with more free blocks: O(1) and no herd on the emptiest."""
    fitting = [w for w in workers if _fits(w, tokens)]
    return _emptiest(fitting if len(fitting) <= 2 else rng.sample(fitting, 2))


PREFILL_POLICIES: dict[str, PrefillPolicy] = {"least-queued": least_queued}
DECODE_POLICIES: dict[str, DecodePolicy] = {"most-free-blocks": most_free_blocks, "power-of-two": power_of_two}
