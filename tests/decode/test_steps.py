"""Batched decode streams: one StepBatch per step for every request riding a coordinator's Steps stream."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.kvcache.receiver import KvReceiver
from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.v1 import worker_pb2 as pb
from pdserve.v1 import worker_pb2_grpc
from pdserve.server.decode.service import DecodeService
from pdserve.server.serving import new_server
from tests.decode.test_engine import _engine, _greedy, _hf_greedy

PROMPTS = {"a": [5, 9, 13, 2, 7], "b": [11, 3, 8]}
MAX_TOKENS = 6


@pytest.fixture
async def worker(tiny_model):
    path = tiny_model("llama")
    engine = _engine(path, num_blocks=32)
    service = DecodeService(engine, KvReceiver(engine.layout, "digest", engine), fingerprint="digest", description="")
    server, _, port = new_server([], 0)
    worker_pb2_grpc.add_DecodeServicer_to_server(service, server)
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield path, engine, worker_pb2_grpc.DecodeStub(channel)
    await channel.close()
    await server.stop(0)
    await engine.close()


def _decode(rid: str, stream_id: str) -> pb.DecodeRequest:
    return pb.DecodeRequest(request_id=rid, prompt_token_ids=PROMPTS[rid], sampling=_greedy(MAX_TOKENS),
                            transfer_token=b"t" * 16, lease_seconds=5, local_prefill=True, steps_stream_id=stream_id)


async def _messages(call) -> list[pb.DecodeResponse]:
    out = []
    while (m := await call.read()) is not grpc.aio.EOF:
        out.append(m)
    return out


async def test_requests_on_one_steps_stream_share_a_message_per_step_and_get_transformers_tokens(worker):
    path, engine, stub = worker
    steps = stub.Steps(pb.StepsRequest(stream_id="c1"))
    assert await steps.read() == pb.StepBatch()  # open
    calls = [stub.Decode(_decode(rid, "c1")) for rid in PROMPTS]
    batches = []
    while sum(e.WhichOneof("event") == "finished" for b in batches for e in b.events) < len(PROMPTS):
        batches.append(await asyncio.wait_for(steps.read(), 60))
    # the calls carry `reserved` only and end OK once `finished` is on the stream
    for call in calls:
        assert [m.WhichOneof("event") for m in await _messages(call)] == ["reserved"]
        assert await call.code() == grpc.StatusCode.OK
    for rid, prompt in PROMPTS.items():
        events = [e for b in batches for e in b.events if e.request_id == rid]
        assert [e.WhichOneof("event") for e in events] == ["tokens"] * MAX_TOKENS + ["finished"]
        assert [t for e in events[:-1] for t in e.tokens.token_ids] == _hf_greedy(path, prompt, MAX_TOKENS)
        assert events[-1].finished.reason == gen_pb.FINISH_REASON_LENGTH
    # once both run, each step's tokens for both requests travel in one message
    assert any({e.request_id for e in b.events if e.WhichOneof("event") == "tokens"} == set(PROMPTS) for b in batches)
    steps.cancel()


async def test_the_steps_stream_closing_ends_its_requests_unavailable_and_frees_their_blocks(worker):
    _, engine, stub = worker
    steps = stub.Steps(pb.StepsRequest(stream_id="c2"))
    await steps.read()
    request = _decode("a", "c2")
    request.sampling.max_tokens = 10_000 - len(PROMPTS["a"])  # runs until the stream closes
    engine.max_model_len = 10_000
    call = stub.Decode(request)
    assert (await call.read()).WhichOneof("event") == "reserved"
    while not any(e.WhichOneof("event") == "tokens" for e in (await steps.read()).events):
        pass
    steps.cancel()  # the coordinator went away
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await _messages(call)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "Steps stream c2 closed" in e.value.details()
    for _ in range(100):
        if not engine.sequences and engine.pool.num_free + engine.scheduler.cache.num_evictable == engine.pool.num_total:
            break
        await asyncio.sleep(0.05)
    assert not engine.sequences
    assert engine.pool.num_free + engine.scheduler.cache.num_evictable == engine.pool.num_total


async def test_a_decode_naming_no_open_stream_is_refused_and_a_stream_id_is_taken_once(worker):
    _, _, stub = worker
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await _messages(stub.Decode(_decode("a", "nope")))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "no Steps stream 'nope' is open here" in e.value.details()
    first = stub.Steps(pb.StepsRequest(stream_id="c3"))
    await first.read()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.Steps(pb.StepsRequest(stream_id="c3")).read()
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
    first.cancel()
