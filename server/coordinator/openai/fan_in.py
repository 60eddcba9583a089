"""The n > 1 fan-in: every choice's stream driven on its own, their responses into one queue."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from pdserve.v1 import generation_pb2
from pdserve.server.coordinator.openai.errors import error_of

Item = tuple[int, generation_pb2.GenerateResponse | Exception | None]
"""(choice, its next response, the failure that ended it, or None when it finished)."""


class Choices:
    """Every choice's stream driven by a task of its own from the start, into one queue in arrival
    order: a following choice waits for choice 0's prompt KV to reach its decode worker, so choice 0
    must go on whether or not its output has been read yet."""

    def __init__(self, streams: list[AsyncIterator[generation_pb2.GenerateResponse]]):
        self.streams = streams
        self._items: asyncio.Queue[Item] = asyncio.Queue()
        self._pumps = [asyncio.create_task(self._pump(i)) for i in range(len(streams))]

    async def _pump(self, i: int) -> None:
        try:
            async for response in self.streams[i]:
                self._items.put_nowait((i, response))
        except Exception as e:  # InvalidRequest or RequestFailed: the client's status; else a bug (500)
            self._items.put_nowait((i, e))
            return
        self._items.put_nowait((i, None))

    async def next(self) -> Item:
        return await self._items.get()

    async def until_each_answered(self) -> list[Item]:
        """What arrives until every choice has answered once; a failure before then raises ApiError
        (the HTTP status: no output has gone out)."""
        early: list[Item] = []
        answered: set[int] = set()
        while len(answered) < len(self.streams):
            i, item = await self.next()
            if isinstance(item, Exception):
                raise error_of(item) from item
            early.append((i, item))
            answered.add(i)
        return early

    async def close(self) -> None:
        """Stops every choice still running: closing its stream cancels its worker calls."""
        for pump in self._pumps:
            pump.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)
        for stream in self.streams:
            await stream.aclose()
