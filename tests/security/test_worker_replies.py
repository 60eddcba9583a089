"""The coordinator checks what workers answer too: a token id outside the vocabulary from a prefill or
decode worker is that worker's failure (retried, then refused naming it), never a crash of the stream."""

from __future__ import annotations

import grpc
import pytest

from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.v1 import generation_pb2_grpc
from tests.coordinator.fakes import start_fake_pools


@pytest.mark.parametrize("liar", ["prefill", "decode"])
async def test_token_ids_outside_the_vocabulary_are_the_workers_failure(tiny_model, liar):
    pools = await start_fake_pools(tiny_model("llama"))
    if liar == "prefill":
        pools.prefill.first_token_id, pools.decode.events = 10**6, [[5]]
    else:
        pools.prefill.first_token_id, pools.decode.events = 4, [[5], [512]]
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{pools.coordinator.port}") as ch:
            call = generation_pb2_grpc.GenerationStub(ch).Generate(gen_pb.GenerateRequest(
                token_ids=gen_pb.TokenIds(ids=[3, 4, 5]), sampling=gen_pb.SamplingParams(max_tokens=10)), timeout=30)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in call:
                    pass
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert f"{liar} worker" in e.value.details() and "outside the vocabulary" in e.value.details()
    finally:
        await pools.stop()
