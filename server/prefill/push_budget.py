"""PushBudget: the KV pushes a prefill worker holds in flight, bounded by count and host bytes.

A push holds the host copy of its prompt's KV from the moment its prefill begins until the decode
worker has it all. At the bound, new prompts wait here, before the engine, so the worker takes no new
work rather than buffering KV without limit; the coordinator sees them as queued prefill tokens.
"""

from __future__ import annotations

import asyncio


class PushBudget:
    def __init__(self, max_pushes: int, max_bytes: int) -> None:
        self.max_pushes = max_pushes
        self.max_bytes = max_bytes
        self.pushes = 0
        self.bytes = 0
        self.peak_bytes = 0
        """The most host bytes held at once (for tests and metrics)."""
        self.waiting_tokens = 0
        """Prompt tokens waiting here for room."""
        self._room = asyncio.Condition()

    def too_big(self, nbytes: int) -> str | None:
        """Why a push of nbytes can never fit, or None."""
        if nbytes > self.max_bytes:
            return (f"the prompt's KV takes {nbytes} bytes on the host, over this prefill worker's "
                    f"--max-push-bytes {self.max_bytes}")
        return None

    async def acquire(self, nbytes: int, num_tokens: int = 0) -> None:
        """Waits until one more push of nbytes fits both bounds, then holds it (call release after)."""
        if (reason := self.too_big(nbytes)) is not None:
            raise ValueError(reason)
        self.waiting_tokens += num_tokens
        try:
            async with self._room:
                await self._room.wait_for(lambda: self.pushes < self.max_pushes
                                          and self.bytes + nbytes <= self.max_bytes)
                self.pushes += 1
                self.bytes += nbytes
                self.peak_bytes = max(self.peak_bytes, self.bytes)
        finally:
            self.waiting_tokens -= num_tokens

    async def release(self, nbytes: int) -> None:
        async with self._room:
            self.pushes -= 1
            self.bytes -= nbytes
            self._room.notify_all()
