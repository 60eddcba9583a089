"""SharedPrompt: the choices of one request with `n` > 1 share their prompt's KV, as vLLM V1's do.

vLLM V1 fans a request with n > 1 out into n child requests that share the prompt through prefix
caching. pdserve does the same across its tiers, with the tiers' own prefix caches:
1. Choice 0 (the leader) runs as any request: its prefill worker P computes the prompt, stores its
   full blocks in its prefix KV (`--prefix-cache-bytes`) and pushes the KV to its decode worker D.
2. D's first event after the prefill answered means the KV is on D: D registered the prompt's full
   blocks in its prefix cache when the sequence started (a running sequence's full blocks are shared
   by reference). The leader says so here (`place`).
3. The followers (choices 1..n-1) wait for that, then take the same D when it has room for what is
   their own (the prompt's last, partial block and their outputs) and the same P when it has a slot:
   D reuses the full blocks, so P sends only the partial block's KV, and P's prefix KV spares
   computing the rest. A follower whose D is full or gone, or a leader that ends without placing its
   KV (failed, cancelled, or finished before), sends the followers the normal way: never a failure
   of the client's request.
4. From there each choice is a request of its own: its sampling (seed + i), retries, migrations and
   cancellation are its own.

Every choice's stream must be read concurrently (the followers wait for the leader to go on).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.server.coordinator.admission import Deadline
    from pdserve.server.coordinator.worker_pool import Worker


@dataclass(frozen=True)
class Placement:
    """Where the leader's prompt KV is: its decode worker, and the prefill worker that computed it."""

    decode: Worker
    prefill: Worker | None
    """None: the decode worker prefilled it itself (no prefill worker was alive)."""
    shared_blocks: int
    """The prompt's full blocks a follower on `decode` reuses (its last token is always computed)."""

    def takes(self, num_tokens: int) -> bool:
        """The leader's decode worker can hold one more choice of `num_tokens` now (the blocks that are
        the choice's own: the shared ones are held already)."""
        decode = self.decode
        own = decode.blocks_for(num_tokens, self.shared_blocks)
        return decode.routable and decode.under_running_cap() and decode.free_kv_blocks() >= own


class SharedPrompt:
    """One request's n choices of one prompt: choice 0 places its KV, the others follow it there."""

    def __init__(self) -> None:
        self._placed: asyncio.Future[Placement | None] = asyncio.get_running_loop().create_future()

    def place(self, decode: Worker, prefill: Worker | None, num_prompt_tokens: int) -> None:
        """The leader's prompt KV is on `decode` (first call only)."""
        if not self._placed.done():
            shared = (num_prompt_tokens - 1) // decode.block_size()
            self._placed.set_result(Placement(decode, prefill, shared))

    def abandon(self) -> None:
        """The leader ended without placing its KV: the followers go the normal way."""
        if not self._placed.done():
            self._placed.set_result(None)

    async def placement(self, deadline: Deadline) -> Placement | None:
        """Where the leader's KV is, once it is there; None when it never will be. Raises RequestFailed
        when the deadline passes first."""
        await asyncio.wait([self._placed], timeout=deadline.check())
        deadline.check()
        return self._placed.result()

    def placed(self) -> Placement | None:
        """The placement so far (None: not yet, or never)."""
        return self._placed.result() if self._placed.done() else None
