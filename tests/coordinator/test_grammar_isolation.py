"""A served coordinator survives the requests that used to kill it: specs that crash llguidance are refused with
400 / INVALID_ARGUMENT on every public front (the crash kills a grammar child, not the coordinator), specs over
the limits are refused naming the field and the flag, and the next request is served."""

from __future__ import annotations

import json

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc.aio as triton
from tritonclient.utils import InferenceServerException

from pdserve.v1 import generation_pb2, generation_pb2_grpc
from tests.coordinator.fakes import start_fake_pools
from tests.coordinator.test_openai import MODEL, model_dir  # noqa: F401 (fixture)
from tests.structured.test_limits import chained_defs, chained_rules

LARK_BOMB = chained_rules(3000)
DEFS_BOMB = chained_defs(1500)


@pytest.fixture
async def unlimited(model_dir):
    """A coordinator whose limits let the crashing specs reach its (one) grammar child."""
    pools = await start_fake_pools(model_dir, http_port=0, grammar_processes=1, max_spec_bytes=2**22,
                                   max_schema_defs=100_000, max_grammar_rules=100_000)
    yield pools
    await pools.stop()


async def _ok(client: httpx.AsyncClient, pools) -> None:
    pools.prefill.first_token_id = 5
    pools.decode.events = [[6]]
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2,
                                                   "structured_outputs": {"regex": "[ab]+"}})
    assert r.status_code == 200, r.text


async def test_specs_that_crash_the_grammar_compiler_are_400_on_every_front(unlimited):
    pools = unlimited
    coordinator = pools.coordinator
    checker = coordinator.service.checker
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{coordinator.http.port}", timeout=60) as client:
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2,
                                                       "structured_outputs": {"grammar": LARK_BOMB}})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "structured_outputs.grammar"
        assert "grammar too complex: the grammar compiler crashed (signal SIGSEGV)" in error["message"]
        r = await client.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": DEFS_BOMB}}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_format.json_schema.schema", r.text
        assert "crashed" in r.json()["error"]["message"]
        await _ok(client, pools)

        async with grpc.aio.insecure_channel(f"127.0.0.1:{coordinator.port}") as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            request = generation_pb2.GenerateRequest(text="x", sampling=generation_pb2.SamplingParams(
                max_tokens=2, structured=generation_pb2.StructuredOutput(grammar=LARK_BOMB)))
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in stub.Generate(request, timeout=60):
                    pass
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert e.value.details().startswith("structured.grammar: grammar too complex: the grammar compiler crashed")

        kserve = triton.InferenceServerClient(f"127.0.0.1:{coordinator.port}")
        try:
            sampling = {"max_tokens": 2, "structured_outputs": {"json": DEFS_BOMB}}
            with pytest.raises(InferenceServerException) as e:
                await kserve.infer(MODEL, [
                    triton.InferInput("text_input", [1], "BYTES").set_data_from_numpy(np.array([b"x"], dtype=object)),
                    triton.InferInput("sampling_parameters", [1], "BYTES").set_data_from_numpy(
                        np.array([json.dumps(sampling).encode()], dtype=object))])
            assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
            assert e.value.message().startswith("structured_outputs.json: grammar too complex")
        finally:
            await kserve.close()
        assert checker.pool.crashes == 4  # each one a grammar child's death, never this process's
        await _ok(client, pools)  # and the coordinator serves on
    assert len(pools.decode.requests) == 2  # only the good requests reached a worker
    assert all(not r.sampling.structured.grammar for r in pools.decode.requests)


def deep_schema(levels: int) -> dict:
    """An object schema nesting `levels` objects (2 JSON levels each)."""
    deep: dict = {"type": "object"}
    for _ in range(levels):
        deep = {"type": "object", "properties": {"a": deep}}
    return deep


def _tool(parameters: dict) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


async def test_specs_over_the_limits_are_refused_naming_the_field_and_flag(model_dir):
    pools = await start_fake_pools(model_dir, http_port=0, max_tools=2, max_schema_depth=32)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{pools.coordinator.http.port}",
                                     timeout=60) as client:
            r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2,
                                                           "structured_outputs": {"grammar": LARK_BOMB}})
            assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs.grammar"
            assert "3002 rules; the limit is 1024 (--max-grammar-rules)" in r.json()["error"]["message"]
            r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2,
                                                           "response_format": {"type": "json_schema", "json_schema": {
                                                               "name": "x", "schema": chained_defs(700)}}})
            assert r.status_code == 400 and "701 $defs/definitions; the limit is 256 (--max-schema-defs)" in \
                r.json()["error"]["message"], r.text
            chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}
            r = await client.post("/v1/chat/completions", json={**chat, "tools": [_tool(deep_schema(20))]})
            assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].function.parameters", r.text
            assert "the limit is 32 (--max-schema-depth)" in r.json()["error"]["message"]
            # deeper than any request body may nest: refused while the body is read, naming the path
            r = await client.post("/v1/chat/completions", json={**chat, "tools": [_tool(deep_schema(300))]})
            assert r.status_code == 400 and r.json()["error"]["param"].startswith("tools[0].function.parameters")
            assert "nested deeper than 128 levels" in r.json()["error"]["message"]
            small = {"type": "function", "function": {"name": "g", "parameters": {"type": "object"}}}
            r = await client.post("/v1/chat/completions", json={**chat, "tools": [small] * 3})
            assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
            assert "3 tools; the limit is 2 (--max-tools)" in r.json()["error"]["message"]
            assert pools.coordinator.service.checker.pool.crashes == 0 and not pools.decode.requests
            await _ok(client, pools)
    finally:
        await pools.stop()
