"""The fake decode engine keeps the engine contract with outputs checkable by hand: the first token, then
`token` each step, until max_tokens; an abort ends a sequence at once and frees it."""

from __future__ import annotations

import asyncio

from pdserve.server.decode.fake_engine import FakeEngine
from pdserve.server.decode.sequence import SeqState
from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.v1 import worker_pb2 as pb


def _request(rid: str, max_tokens: int) -> pb.DecodeRequest:
    return pb.DecodeRequest(request_id=rid, prompt_token_ids=[3, 4, 5],
                            sampling=gen_pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True))


async def _drain(queue: asyncio.Queue) -> list[int]:
    tokens: list[int] = []
    while (item := await asyncio.wait_for(queue.get(), 10)) is not None:
        tokens += item
    return tokens


async def test_every_step_appends_the_token_until_max_tokens():
    engine = FakeEngine(vocab_size=100, token=42, step_s=0)
    short, long = engine.add(_request("short", 2)), engine.add(_request("long", 5))
    assert short.state is SeqState.WAITING_KV and short.admitted.done() and engine.position(short) == 0
    engine.start(short, 7)
    engine.start(long, 9)
    assert await _drain(short.events) == [42]  # the first token is the prefill tier's to send
    assert await _drain(long.events) == [42, 42, 42, 42]
    assert short.output_ids == [7, 42] and long.output_ids == [9, 42, 42, 42, 42]
    assert short.finish_reason == long.finish_reason == gen_pb.FINISH_REASON_LENGTH
    assert engine.sequences == {} and engine.running == []
    assert engine.load().running_requests == 0
    await engine.close()


async def test_a_one_token_request_ends_at_start_and_an_abort_frees_its_sequence():
    engine = FakeEngine(vocab_size=100, token=42, step_s=60)  # no step runs within this test
    one = engine.add(_request("one", 1))
    engine.start(one, 7)
    assert await _drain(one.events) == [] and one.output_ids == [7] and "one" not in engine.sequences
    held = engine.add(_request("held", 8))
    engine.start(held, 7)
    assert engine.load().running_requests == 1
    assert engine.abort("held") and not engine.abort("held")
    assert await _drain(held.events) == [] and held.finish_reason == gen_pb.FINISH_REASON_ABORT
    assert engine.running == [] and engine.sequences == {}
    await engine.close()
