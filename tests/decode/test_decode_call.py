"""One Decode call on its own (no Steps stream), through the servicer's units: admission's refusals keep their
status codes and messages, a local prefill streams transformers' tokens on the call, a KV that never arrives
ends the call DEADLINE_EXCEEDED with every block back."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.kvcache.wire import PROTOCOL_VERSION
from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.v1 import worker_pb2 as pb
from tests.decode.test_engine import _greedy, _hf_greedy
from tests.decode.test_steps import MAX_TOKENS, PROMPTS, _decode, _messages, worker  # noqa: F401 (the fixture)


def _all_back(engine) -> bool:
    return engine.pool.num_free + engine.scheduler.cache.num_evictable == engine.pool.num_total


async def _until_all_back(engine) -> None:
    for _ in range(100):
        if not engine.sequences and _all_back(engine):
            return
        await asyncio.sleep(0.05)


async def test_a_local_prefill_streams_its_tokens_on_the_call(worker):
    path, engine, stub, _ = worker
    messages = await asyncio.wait_for(_messages(stub.Decode(_decode("a", ""))), 60)
    kinds = [m.WhichOneof("event") for m in messages]
    assert kinds == ["reserved"] + ["tokens"] * (len(kinds) - 2) + ["finished"]
    assert messages[0].reserved.num_blocks == 2 and messages[0].reserved.cached_blocks == 0
    assert [t for m in messages[1:-1] for t in m.tokens.token_ids] == _hf_greedy(path, PROMPTS["a"], MAX_TOKENS)
    assert messages[-1].finished.reason == gen_pb.FINISH_REASON_LENGTH and messages[-1].finished.message == ""
    await _until_all_back(engine)
    assert not engine.sequences and _all_back(engine)


async def test_a_kv_that_stalls_past_its_lease_ends_the_call_deadline_exceeded_and_frees_the_blocks(worker):
    _, engine, stub, (service, _) = worker
    request = pb.DecodeRequest(request_id="late", prompt_token_ids=PROMPTS["b"], sampling=_greedy(MAX_TOKENS),
                               transfer_token=b"t" * 16, lease_seconds=0.2)
    call = stub.Decode(request)
    assert (await call.read()).WhichOneof("event") == "reserved"
    service.receiver.begin(pb.KvHeader(  # the prefill worker begins, then sends nothing: the lease runs out
        request_id="late", attempt=0, transfer_token=b"t" * 16, fingerprint=pb.ModelFingerprint(digest="digest"),
        layout=engine.layout.to_proto(), num_tokens=len(PROMPTS["b"]), protocol_version=PROTOCOL_VERSION))
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await asyncio.wait_for(_messages(call), 60)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert e.value.details() == "KV for late did not arrive within 0.2 s"
    await _until_all_back(engine)
    assert not engine.sequences and _all_back(engine)


async def test_admission_refuses_with_the_status_that_says_why(worker):
    _, engine, stub, (service, _) = worker
    bad = _decode("a", "")
    bad.sampling.max_tokens = 0
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await _messages(stub.Decode(bad))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    long = _decode("a", "")
    long.prompt_token_ids[:] = [5] * engine.max_model_len
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await _messages(stub.Decode(long))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt_token_ids" in e.value.details()
    held = stub.Decode(pb.DecodeRequest(request_id="held", prompt_token_ids=PROMPTS["b"], sampling=_greedy(4),
                                        transfer_token=b"t" * 16, lease_seconds=30))
    assert (await asyncio.wait_for(held.read(), 60)).WhichOneof("event") == "reserved"  # decoding here: its KV awaited
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await _messages(stub.Decode(pb.DecodeRequest(request_id="held", prompt_token_ids=PROMPTS["a"],
                                                     sampling=_greedy(4), transfer_token=b"u" * 16)))
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert e.value.details() == "request held is already decoding here"
    held.cancel()
    service.draining = True
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await _messages(stub.Decode(_decode("b", "")))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert e.value.details() == "decode worker is draining; pick another"
    await _until_all_back(engine)
    assert not engine.sequences and _all_back(engine)
