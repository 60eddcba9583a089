"""A Route: one attempt's decode events, taken all at once, and its stall limit (one timer per route)."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.v1 import worker_pb2
from pdserve.server.coordinator.steps_stream import Route


def tokens(*ids: int) -> worker_pb2.SequenceEvent:
    return worker_pb2.SequenceEvent(request_id="r", tokens=worker_pb2.TokenEvent(token_ids=ids))


async def test_take_returns_everything_put_since_in_order():
    route = Route()
    route.put(tokens(1))
    route.put(tokens(2, 3))
    assert [list(e.tokens.token_ids) for e in await route.take(None)] == [[1], [2, 3]]
    waiting = asyncio.ensure_future(route.take(5.0))
    await asyncio.sleep(0)
    route.put(tokens(4))
    route.put(tokens(5))
    assert [list(e.tokens.token_ids) for e in await asyncio.wait_for(waiting, 5)] == [[4], [5]]
    route.close()


async def test_a_wait_past_its_limit_raises_timeout_even_after_longer_waits():
    """The timer armed for a long limit is moved up for a shorter one (the stall limit after the KV's)."""
    route = Route()
    waiting = asyncio.ensure_future(route.take(60.0))
    await asyncio.sleep(0)
    route.put(tokens(1))
    assert len(await waiting) == 1
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(route.take(0.05), 5)  # not the 60 s timer's
    route.close()


async def test_a_put_before_the_limit_ends_the_wait_and_a_later_wait_gets_its_own_limit():
    route = Route()
    for i in range(5):  # each wait shorter than the limit, together longer: no timeout
        waiting = asyncio.ensure_future(route.take(1.0))
        await asyncio.sleep(0.25)
        route.put(tokens(i))
        assert len(await waiting) == 1
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(route.take(0.05), 5)
    route.close()


async def test_a_failure_put_on_the_route_is_taken_like_an_event():
    route = Route()
    route.put(tokens(1))
    route.put(ConnectionError("gone"))
    items = await route.take(1.0)
    assert isinstance(items[1], ConnectionError) and list(items[0].tokens.token_ids) == [1]
    route.close()
