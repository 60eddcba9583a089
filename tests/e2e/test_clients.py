"""The clients people already have, unmodified, against `pdserve up --http-port`: the openai SDK,
tritonclient (grpc and grpc.aio) and a gRPC reflection client. Greedy text through each front equals
the pdserve.v1 path's text for the same prompt. After each test every decode block is free again.
"""

from __future__ import annotations

import asyncio
import json
import queue

import grpc
import httpx
import numpy as np
import openai
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.grpc.aio as triton_aio
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from pdserve.server.client import build_request, stream
from pdserve.server.coordinator.chat_template import ChatTemplate
from pdserve.server.launcher import free_port
from tests.e2e.cluster import pdserve_up, wait_all_blocks_free

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    http_port = free_port()
    with pdserve_up(
        model_dir,
        tmp_path_factory.mktemp("up"),
        prefill_workers=1,
        decode_workers=1,
        extra_args=["--http-port", str(http_port)],
    ) as state:
        state["http"] = f"http://127.0.0.1:{http_port}"
        state["model"] = model_dir.name
        yield state


@pytest.fixture(autouse=True)
def no_leaked_blocks(cluster):
    yield
    pairs = wait_all_blocks_free(cluster["decode"])
    assert all(free == total for free, total in pairs), f"leaked KV blocks (free, total): {pairs}"


@pytest.fixture
def sdk(cluster):
    with openai.OpenAI(
        base_url=f"{cluster['http']}/v1", api_key="unused", max_retries=0, timeout=60
    ) as client:
        yield client


def generation_text(addr: str, **kw) -> str:
    """The reference: pdserve.v1.Generation, greedy, not stopping at EOS (random weights)."""
    request = build_request(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, **kw)
    return "".join(m.text for m in stream(addr, request, timeout=60))


def test_openai_sdk_streams_a_completion_equal_to_the_generation_path(cluster, sdk):
    prompt = "def fibonacci(n):"
    chunks = list(
        sdk.completions.create(
            model=cluster["model"],
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == generation_text(cluster["coordinator"], prompt=prompt)
    assert len(text) > 0
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    whole = sdk.completions.create(
        model=cluster["model"],
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert whole.choices[0].text == text


def test_openai_sdk_streams_a_chat_completion_equal_to_the_generation_path(cluster, sdk, model_dir):
    messages = [{"role": "user", "content": "Write a loop."}]
    chunks = list(
        sdk.chat.completions.create(
            model=cluster["model"],
            messages=messages,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    _, ids = ChatTemplate.from_dir(model_dir).encode(messages)
    assert text == generation_text(cluster["coordinator"], token_ids=ids)
    assert len(text) > 0 and chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"


def _triton_inputs(module, prompt: str, streaming: bool) -> list:
    text_input = module.InferInput("text_input", [1], "BYTES")
    text_input.set_data_from_numpy(np.array([prompt.encode()], dtype=object))
    flag = module.InferInput("stream", [1], "BOOL")
    flag.set_data_from_numpy(np.array([streaming]))
    sampling = module.InferInput("sampling_parameters", [1], "BYTES")
    params = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    sampling.set_data_from_numpy(np.array([json.dumps(params).encode()], dtype=object))
    return [text_input, flag, sampling]


def test_tritonclient_grpc_stream_infer_equals_the_generation_path(cluster):
    prompt = "import numpy as np"
    results: queue.Queue = queue.Queue()
    client = triton_grpc.InferenceServerClient(cluster["coordinator"])
    try:
        assert client.is_server_ready() and client.is_model_ready(cluster["model"])
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        client.async_stream_infer(
            cluster["model"], _triton_inputs(triton_grpc, prompt, True), request_id="t-1"
        )
        pieces = []
        while True:
            result, error = results.get(timeout=60)
            assert error is None
            pieces.append(result.as_numpy("text_output")[0].decode())
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
        client.stop_stream()
    finally:
        client.close()
    assert "".join(pieces) == generation_text(cluster["coordinator"], prompt=prompt)
    assert result.as_numpy("finish_reason")[0] == b"length" and result.get_response().id == "t-1"


async def test_tritonclient_grpc_aio_streams_and_reads_model_metadata(cluster):
    prompt = "class Point:"
    client = triton_aio.InferenceServerClient(cluster["coordinator"])
    try:
        assert await client.is_server_ready()
        meta = await client.get_model_metadata(cluster["model"], as_json=True)
        assert meta["name"] == cluster["model"]
        assert {"text_input", "stream", "sampling_parameters"} <= {i["name"] for i in meta["inputs"]}

        async def requests():
            yield {"model_name": cluster["model"], "inputs": _triton_inputs(triton_aio, prompt, True)}

        pieces = []
        async for result, error in client.stream_infer(requests()):
            assert error is None
            pieces.append(result.as_numpy("text_output")[0].decode())
        whole = await client.infer(cluster["model"], _triton_inputs(triton_aio, prompt, False))
    finally:
        await client.close()
    expected = await asyncio.to_thread(generation_text, cluster["coordinator"], prompt=prompt)
    assert "".join(pieces) == expected
    assert whole.as_numpy("text_output")[0].decode() == prompt + expected


def _services(address: str) -> set[str]:
    with grpc.insecure_channel(address) as channel:
        return set(ProtoReflectionDescriptorDatabase(channel).get_services())


def test_reflection_lists_the_services_of_every_process(cluster):
    common = {"grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}
    assert {"pdserve.v1.Generation", "inference.GRPCInferenceService", *common} <= _services(
        cluster["coordinator"]
    )
    for address in cluster["prefill"]:
        assert {"pdserve.v1.Prefill", "pdserve.v1.Control", *common} <= _services(address)
    for address in cluster["decode"]:
        assert {"pdserve.v1.Decode", "pdserve.v1.Control", *common} <= _services(address)


def test_bad_requests_get_each_fronts_error_and_the_server_keeps_serving(cluster, sdk):
    r = httpx.post(
        f"{cluster['http']}/v1/completions",
        timeout=30,
        json={"model": cluster["model"], "prompt": "x", "top_p": 1.5},
    )
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error" and "top_p" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError):
        sdk.chat.completions.create(model=cluster["model"], messages=[{"role": "user", "content": "x"}], n=17)
    client = triton_grpc.InferenceServerClient(cluster["coordinator"])
    try:
        bad = triton_grpc.InferInput("text_input", [1], "BYTES")
        bad.set_data_from_numpy(np.array([b""], dtype=object))
        with pytest.raises(triton_grpc.InferenceServerException) as e:
            client.infer(cluster["model"], [bad])
        assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
    finally:
        client.close()
    ok = sdk.completions.create(
        model=cluster["model"], prompt="x", max_tokens=2, extra_body={"ignore_eos": True}
    )
    assert ok.usage.completion_tokens == 2


def test_http_client_disconnect_mid_stream_frees_the_blocks(cluster):
    body = {
        "model": cluster["model"],
        "prompt": "while True:",
        "max_tokens": 400,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", f"{cluster['http']}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        first = next(r.iter_lines())
        assert first.startswith("data: ") and "text_completion" in first
    # the autouse fixture checks that the decode worker got every block back
