"""Batched decode streams: one StepBatch per step for every request riding a coordinator's Steps stream."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.kvcache.receiver import KvReceiver
from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.v1 import worker_pb2 as pb
from pdserve.v1 import worker_pb2_grpc
from pdserve.server.decode.sequence import Sequence
from pdserve.server.decode.service import DecodeService
from pdserve.server.decode.steps_stream import StepSink, StepStream
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
    yield path, engine, worker_pb2_grpc.DecodeStub(channel), (service, server)
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
    path, engine, stub, _ = worker
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
        # tokens events (one per step, or several steps' joined when this reader fell behind), then finished
        assert [e.WhichOneof("event") for e in events] == ["tokens"] * (len(events) - 1) + ["finished"]
        assert [t for e in events[:-1] for t in e.tokens.token_ids] == _hf_greedy(path, prompt, MAX_TOKENS)
        assert events[-1].finished.reason == gen_pb.FINISH_REASON_LENGTH
    # once both run, each step's tokens for both requests travel in one message
    assert any({e.request_id for e in b.events if e.WhichOneof("event") == "tokens"} == set(PROMPTS) for b in batches)
    steps.cancel()


async def test_the_steps_stream_closing_ends_its_requests_unavailable_and_frees_their_blocks(worker):
    _, engine, stub, _ = worker
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


async def test_a_draining_worker_ends_its_steps_stream_ok_after_the_last_finished_event(worker):
    """SIGTERM while the coordinator reads slowly: the requests finish, then the stream sends its last
    batch and ends OK before the server stops (a stop cutting it off would migrate a finished request)."""
    path, engine, stub, (service, server) = worker
    steps = stub.Steps(pb.StepsRequest(stream_id="c4"))
    assert await steps.read() == pb.StepBatch()
    calls = [stub.Decode(_decode(rid, "c4")) for rid in PROMPTS]
    for call in calls:  # the requests run; the coordinator reads nothing of the stream meanwhile
        assert [m.WhichOneof("event") for m in await _messages(call)] == ["reserved"]
    service.draining = True
    assert not engine.sequences
    await asyncio.wait_for(service.end_streams(10), 30)
    await server.stop(1.0)
    batches = []
    while (batch := await steps.read()) is not grpc.aio.EOF:
        batches.append(batch)
    assert await steps.code() == grpc.StatusCode.OK
    for rid, prompt in PROMPTS.items():
        events = [e for b in batches for e in b.events if e.request_id == rid]
        assert [t for e in events[:-1] for t in e.tokens.token_ids] == _hf_greedy(path, prompt, MAX_TOKENS)
        assert events[-1].WhichOneof("event") == "finished"
    assert not service.step_streams


async def test_a_decode_naming_no_open_stream_is_refused_and_a_stream_id_is_taken_once(worker):
    _, _, stub, _ = worker
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


async def test_steps_that_pile_up_before_a_batch_is_sent_join_each_requests_tokens_in_order():
    """The coordinator is behind (the batch not yet taken): each request's tokens of the steps meanwhile
    travel as one event, logprobs with them; a service event (queued) or a sent batch starts a new one."""
    stream = StepStream("s")
    batches = stream.batches()
    assert await anext(batches) == pb.StepBatch()
    seqs = {rid: Sequence(rid, prompt, _greedy(MAX_TOKENS), frozenset(), 64, block_table=[0])
            for rid, prompt in PROMPTS.items()}
    sinks = {rid: StepSink(stream, seq) for rid, seq in seqs.items()}
    seqs["a"].logprobs = [gen_pb.TokenLogprob(token_id=t, logprob=-t) for t in (1, 2, 3)]
    for step in ([1, 1], [2, 2], [3, 3]):  # three engine steps: a then b each time
        for (rid, sink), token in zip(sinks.items(), step):
            sink.put_nowait([token + (10 if rid == "b" else 0)])
    assert sinks["a"].pending_tokens() == 3
    sinks["b"].send(queued=pb.Queued(position=0))
    sinks["b"].put_nowait([14])
    batch = await anext(batches)
    assert [(e.request_id, e.WhichOneof("event"), list(e.tokens.token_ids)) for e in batch.events] == [
        ("a", "tokens", [1, 2, 3]), ("b", "tokens", [11, 12, 13]), ("b", "queued", []), ("b", "tokens", [14])]
    assert [lp.token_id for lp in batch.events[0].tokens.logprobs] == [1, 2, 3] and not seqs["a"].logprobs
    assert sinks["a"].pending_tokens() == 0  # sent: the next step starts a new event
    sinks["a"].put_nowait([4])
    seqs["a"].finish_reason = gen_pb.FINISH_REASON_LENGTH
    sinks["a"].put_nowait(None)
    batch = await anext(batches)
    assert [(e.WhichOneof("event"), list(e.tokens.token_ids)) for e in batch.events] == [("tokens", [4]), ("finished", [])]
