"""Which worker of a tier takes the next request: pluggable policies, named in the config
(vocabulary.PrefillPolicy / DecodePolicy), each picked by a function here (PREFILL_PICKERS / DECODE_PICKERS).

A picker is a function of the routable workers (and, for decode, the tokens the request's KV holds
and its prompt) that returns one of them, or None when none can take the request now. A decode worker
takes a request when its prompt's blocks are free and it is under its running cap; failing that, one
with room in its own waiting queue takes it (it admits in arrival order as blocks free up).
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Callable
from typing import TYPE_CHECKING

from pdserve.kvcache.prefix_cache import block_hashes

if TYPE_CHECKING:
    from pdserve.server.choices import DecodePolicy, PrefillPolicy
    from pdserve.server.coordinator.worker_pool import Worker

PickPrefill = Callable[[list["Worker"]], "Worker | None"]
"""(workers) -> a worker or None."""
PickDecode = Callable[..., "Worker | None"]
"""(workers, tokens, *, prompt=None) -> a worker or None."""


def least_queued(workers: list[Worker]) -> Worker | None:
    """Fewest queued prefill tokens, then fewest in-flight requests."""
    return min(workers, key=lambda w: (w.queued_prefill_tokens(), w.inflight), default=None)


def _fits(worker: Worker, tokens: int) -> bool:
    return worker.under_running_cap() and worker.free_kv_blocks() >= worker.blocks_for(tokens)


def _shortest_queue(workers: list[Worker]) -> Worker | None:
    """None fits now: the worker whose own waiting queue has room and is shortest."""
    room = [w for w in workers if w.has_queue_room()]
    return min(room, key=lambda w: (w.queued(), -w.free_kv_blocks()), default=None)


LARGE_POOL = 16
"""From this many fitting decode workers on, `most-free-blocks` samples two (power of two choices)."""


def _emptiest(fitting: list[Worker]) -> Worker | None:
    return min(fitting, key=lambda w: (-w.free_kv_blocks(), w.inflight), default=None)


def most_free_blocks(workers: list[Worker], tokens: int, rng: random.Random = random.Random(), *,
                     prompt: list[int] | None = None) -> Worker | None:
    """Most free KV blocks among the workers under their running-request cap with room for `tokens`.

    In a large pool every coordinator would herd onto the same emptiest worker between load reports,
    so there it takes the better of two random fitting workers instead.
    """
    fitting = [w for w in workers if _fits(w, tokens)]
    if not fitting:
        return _shortest_queue(workers)
    if len(fitting) >= LARGE_POOL:
        return _emptiest(rng.sample(fitting, 2))
    return _emptiest(fitting)


def power_of_two(workers: list[Worker], tokens: int, rng: random.Random = random.Random(), *,
                 prompt: list[int] | None = None) -> Worker | None:
    """Two random fitting workers, the one with more free blocks: O(1) and no herd on the emptiest."""
    fitting = [w for w in workers if _fits(w, tokens)]
    if not fitting:
        return _shortest_queue(workers)
    return _emptiest(fitting if len(fitting) <= 2 else rng.sample(fitting, 2))


ROUTE_BLOCKS = 4
"""Prefix-aware routing keys a prompt by the chained hash of its first (up to) this many full blocks."""
LOAD_SLACK = 1.25
"""A worker may take up to this times the mean in-flight load (plus one) before its prefixes spill over."""


def route_key(prompt: list[int], block_size: int) -> bytes | None:
    """The hash of the prompt's leading full blocks (as decode workers' prefix caches name them), or None."""
    hashes = block_hashes(prompt, block_size, limit=ROUTE_BLOCKS)
    return hashes[-1] if hashes else None


def _rank(key: bytes, worker: Worker) -> bytes:
    return hashlib.blake2b(key + worker.address.encode(), digest_size=8).digest()


def prefix_aware(workers: list[Worker], tokens: int, rng: random.Random = random.Random(), *,
                 prompt: list[int] | None = None) -> Worker | None:
    """The worker most likely to hold the prompt's prefix, under a bounded load; else most-free-blocks.

    Rendezvous hashing of the prompt's leading blocks orders the workers the same way on every
    coordinator, and a pool change moves only the keys of the workers that came or went. A worker
    takes a key while it fits and its in-flight load stays within LOAD_SLACK of the mean (consistent
    hashing with bounded loads), so one hot prefix spills to the next worker in its order.
    """
    key = route_key(prompt, workers[0].block_size()) if prompt and workers else None
    if key is None:
        return most_free_blocks(workers, tokens, rng, prompt=prompt)
    bound = math.ceil(LOAD_SLACK * (sum(w.inflight for w in workers) + 1) / len(workers))
    for worker in sorted(workers, key=lambda w: _rank(key, w), reverse=True):
        if worker.inflight + 1 <= bound and _fits(worker, tokens):
            return worker
    return most_free_blocks(workers, tokens, rng, prompt=prompt)


PREFILL_PICKERS: dict[PrefillPolicy, PickPrefill] = {"least-queued": least_queued}
DECODE_PICKERS: dict[DecodePolicy, PickDecode] = {
    "prefix-aware": prefix_aware, "most-free-blocks": most_free_blocks, "power-of-two": power_of_two,
}
