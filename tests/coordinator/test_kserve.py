"""KServe v2 gRPC on the coordinator through tritonclient.grpc.aio, against scripted in-process workers."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import prometheus_client
import pytest
import tritonclient.grpc.aio as triton
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from pdserve.v1 import generation_pb2
from pdserve.server.coordinator.main import Coordinator
from pdserve.server.model.tokenizer import Tokenizer
from tests.coordinator.fakes import FakeDecode, FakePrefill, start_fake_pools, wait_for

FinishReason = generation_pb2.FinishReason
MODEL = "llama-float32"


@dataclass
class Cluster:
    coordinator: Coordinator
    prefill: FakePrefill
    decode: FakeDecode
    tokenizer: Tokenizer
    address: str

    def script(self, ids: list[int], finish: int | None = FinishReason.FINISH_REASON_LENGTH) -> None:
        self.prefill.first_token_id = ids[0]
        self.decode.events = [[i] for i in ids[1:]]
        self.decode.finish = finish


@pytest.fixture(scope="module")
def model_dir(tiny_model) -> Path:
    return tiny_model("llama")


@pytest.fixture
async def cluster(model_dir):
    pools = await start_fake_pools(model_dir)
    coordinator = pools.coordinator
    yield Cluster(
        coordinator, pools.prefill, pools.decode, Tokenizer.from_dir(model_dir), f"127.0.0.1:{coordinator.port}"
    )
    await pools.stop()


@pytest.fixture
async def client(cluster):
    c = triton.InferenceServerClient(cluster.address)
    yield c
    await c.close()


def inputs(
    prompt: str, stream: bool | None = None, sampling: dict | None = None, exclude_input: bool | None = None
) -> list[triton.InferInput]:
    out = [
        triton.InferInput("text_input", [1], "BYTES").set_data_from_numpy(
            np.array([prompt.encode()], dtype=object)
        )
    ]
    if stream is not None:
        out.append(triton.InferInput("stream", [1], "BOOL").set_data_from_numpy(np.array([stream])))
    if sampling is not None:
        out.append(
            triton.InferInput("sampling_parameters", [1], "BYTES").set_data_from_numpy(
                np.array([json.dumps(sampling).encode()], dtype=object)
            )
        )
    if exclude_input is not None:
        out.append(
            triton.InferInput("exclude_input_in_output", [1], "BOOL").set_data_from_numpy(
                np.array([exclude_input])
            )
        )
    return out


def text(result) -> str:
    return result.as_numpy("text_output")[0].decode()


async def _requests(*items: dict):
    for item in items:
        yield item


async def test_health_and_metadata(client):
    assert await client.is_server_live() and await client.is_server_ready()
    assert await client.is_model_ready(MODEL) and not await client.is_model_ready("other")
    meta = await client.get_model_metadata(MODEL, as_json=True)
    assert meta["name"] == MODEL and meta["versions"] == ["1"]
    assert {i["name"]: i["datatype"] for i in meta["inputs"]} == {
        "text_input": "BYTES",
        "stream": "BOOL",
        "sampling_parameters": "BYTES",
        "exclude_input_in_output": "BOOL",
        "return_finish_reason": "BOOL",
        "return_cumulative_logprob": "BOOL",
        "return_logprobs": "BOOL",
        "return_num_input_tokens": "BOOL",
        "return_num_output_tokens": "BOOL",
    }
    assert {o["name"]: o["datatype"] for o in meta["outputs"]} == {
        "text_output": "BYTES",
        "finish_reason": "BYTES",
        "cumulative_logprob": "FP32",
        "logprobs": "BYTES",
        "num_input_tokens": "UINT32",
        "num_output_tokens": "UINT32",
    }
    config = (await client.get_model_config(MODEL, as_json=True))["config"]
    assert config["model_transaction_policy"]["decoupled"] is True
    assert (await client.get_server_metadata(as_json=True))["name"] == "pdserve"
    with pytest.raises(InferenceServerException) as e:
        await client.get_model_metadata("other")
    assert "unknown model" in e.value.message()


async def test_stream_infer_streams_deltas_and_marks_the_final_response(cluster, client):
    ids = cluster.tokenizer.encode(" return x + 1")
    cluster.script(ids)
    request = {
        "model_name": MODEL,
        "request_id": "k-1",
        "inputs": inputs("def f(x):", stream=True, sampling={"max_tokens": len(ids), "temperature": 0}),
    }
    results = []
    async for result, error in client.stream_infer(_requests(request)):
        assert error is None
        results.append(result)
    assert "".join(text(r) for r in results) == " return x + 1"
    response = results[-1].get_response()
    assert response.id == "k-1" and response.parameters["triton_final_response"].bool_param
    assert not any(r.get_response().parameters["triton_final_response"].bool_param for r in results[:-1])
    assert results[-1].as_numpy("finish_reason")[0] == b"length"
    assert results[-1].as_numpy("num_output_tokens")[0] == len(ids)
    assert results[0].as_numpy("finish_reason") is None
    sampling = cluster.decode.requests[0].sampling
    assert (sampling.max_tokens, sampling.temperature) == (len(ids), 0.0)
    assert list(cluster.decode.requests[0].prompt_token_ids) == cluster.tokenizer.encode("def f(x):")


async def test_model_infer_answers_the_whole_text_with_the_prompt_unless_excluded(cluster, client):
    cluster.script(cluster.tokenizer.encode(" = 3"), FinishReason.FINISH_REASON_STOP)
    result = await client.infer(MODEL, inputs("x"), parameters={"max_tokens": 7, "top_k": "5", "seed": 11})
    assert text(result) == "x = 3" and result.as_numpy("finish_reason")[0] == b"stop"
    sampling = cluster.decode.requests[0].sampling
    assert (sampling.max_tokens, sampling.top_k, sampling.seed) == (7, 5, 11)
    result = await client.infer(MODEL, inputs("x", exclude_input=True, sampling={"max_tokens": 3}))
    assert text(result) == " = 3"
    assert cluster.decode.requests[1].sampling.max_tokens == 3


async def test_skip_special_tokens_false_puts_their_text_in_the_output(cluster, client):
    eos = cluster.tokenizer.eos_token_ids[0]
    for sampling, tail in [({}, ""), ({"skip_special_tokens": False}, "<|endoftext|>")]:
        cluster.script([*cluster.tokenizer.encode(" = 3"), eos], FinishReason.FINISH_REASON_STOP)
        result = await client.infer(MODEL, inputs("x", exclude_input=True, sampling=sampling))
        assert text(result) == " = 3" + tail


@pytest.mark.parametrize(
    "build, words",
    [
        (lambda: [], "'text_input'"),
        (lambda: inputs("x", sampling={"max_tokens": 0}), "max_tokens must be >= 1"),
        (lambda: inputs("x", sampling={"temperature": "hot"}), "not a valid float"),
        (lambda: inputs("x", sampling={"frequency_penalty": 2.5}), "frequency_penalty must lie in [-2, 2]"),
        (lambda: inputs("x", sampling={"n": 2}), "n=2 is not supported"),
        (lambda: inputs("x", sampling={"best": 2}), "unknown sampling parameter 'best'"),
        (lambda: inputs("x", stream=True), "needs ModelStreamInfer"),
        (
            lambda: [
                triton.InferInput("text_input", [2], "BYTES").set_data_from_numpy(
                    np.array([b"a", b"b"], dtype=object)
                )
            ],
            "batches are not supported",
        ),
        (
            lambda: [
                triton.InferInput("prompt", [1], "BYTES").set_data_from_numpy(np.array([b"a"], dtype=object))
            ],
            "unknown input 'prompt'",
        ),
    ],
)
async def test_bad_requests_are_invalid_argument_and_the_server_keeps_serving(cluster, client, build, words):
    before = _failures()
    with pytest.raises(InferenceServerException) as e:
        await client.infer(MODEL, build())
    assert _failures() - before == 1
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT" and words in e.value.message()
    assert cluster.decode.requests == []
    cluster.script([5, 6])
    result = await client.infer(MODEL, inputs("x", exclude_input=True, sampling={"max_tokens": 2}))
    assert result.as_numpy("num_output_tokens")[0] == 2


def _failures() -> float:
    sample = prometheus_client.REGISTRY.get_sample_value(
        "pdserve_request_failure_total", {"model_name": MODEL, "role": "coordinator", "code": "INVALID_ARGUMENT"}
    )
    return sample or 0.0


async def test_a_bad_request_on_a_stream_gets_an_error_response_and_the_stream_goes_on(cluster, client):
    cluster.script([5, 6])
    bad = {"model_name": MODEL, "request_id": "bad", "inputs": inputs("x", sampling={"top_p": 2})}
    good = {
        "model_name": MODEL,
        "request_id": "good",
        "inputs": inputs("x", stream=True, sampling={"max_tokens": 2}),
    }
    got = [(r, e) async for r, e in client.stream_infer(_requests(bad, good))]
    errors = [e for _, e in got if e is not None]
    assert len(errors) == 1 and "INVALID_ARGUMENT: top_p must lie in (0, 1]" in errors[0].message()
    finals = [
        r for r, _ in got if r is not None and r.get_response().parameters["triton_final_response"].bool_param
    ]
    assert [r.get_response().id for r in finals] == ["good"]


async def test_admission_rejection_keeps_its_status(cluster, client):
    cluster.decode.refuse = grpc.StatusCode.RESOURCE_EXHAUSTED  # the worker is full: the request would queue,
    cluster.coordinator.service.router.decode_queue.max_size = 0  # but the coordinator's queue takes none
    with pytest.raises(InferenceServerException) as e:
        await client.infer(MODEL, inputs("x"))
    assert e.value.status() == "StatusCode.RESOURCE_EXHAUSTED"


async def test_cancelling_a_stream_cancels_the_request(cluster, client):
    cluster.script([5, 6, 7], finish=None)
    request = {"model_name": MODEL, "inputs": inputs("x", stream=True)}

    async def requests():
        yield request
        await asyncio.Event().wait()  # keep the request side open

    responses = client.stream_infer(requests())
    first, error = await anext(responses)
    assert error is None and first is not None
    responses.cancel()
    assert await wait_for(cluster.decode.cancelled)


def _reflect(address: str) -> tuple[set[str], list[str], bool]:
    with grpc.insecure_channel(address) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        services = set(db.get_services())
        methods = [
            m.name for m in db.FindFileContainingSymbol("inference.GRPCInferenceService").service[0].method
        ]
        live = service_pb2_grpc.GRPCInferenceServiceStub(channel).ServerLive(
            service_pb2.ServerLiveRequest(), timeout=5
        )
    return services, methods, live.live


async def test_reflection_lists_every_service(cluster):
    # a blocking client, off the event loop the coordinator serves on
    services, methods, live = await asyncio.to_thread(_reflect, cluster.address)
    assert {
        "pdserve.v1.Generation",
        "inference.GRPCInferenceService",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    } <= services
    assert {"ModelInfer", "ModelStreamInfer", "ModelMetadata", "ServerReady"} <= set(methods)
    assert live


def _returns(**flags: bool) -> list[triton.InferInput]:
    return [triton.InferInput(f"return_{name}", [1], "BOOL").set_data_from_numpy(np.array([value]))
            for name, value in flags.items()]


async def test_triton_vllm_backend_return_inputs_choose_the_outputs(cluster, client):
    """What clients written for Triton's vLLM backend send: return_* switches, exclude_input_in_output."""
    ids = cluster.tokenizer.encode(" print(1)")[:3]
    cluster.script(ids)
    asked = inputs("x", exclude_input=True, sampling={"max_tokens": 3, "logprobs": 1})
    asked += _returns(finish_reason=True, num_output_tokens=True, num_input_tokens=False, logprobs=True,
                      cumulative_logprob=True)
    result = await client.infer(MODEL, asked)
    names = {o.name for o in result.get_response().outputs}
    assert names == {"text_output", "finish_reason", "num_output_tokens", "logprobs", "cumulative_logprob"}
    assert text(result) == cluster.tokenizer.decode(ids)  # the prompt excluded
    assert result.as_numpy("finish_reason")[0] == b"length" and result.as_numpy("num_output_tokens")[0] == 3
    assert result.as_numpy("cumulative_logprob")[0] == pytest.approx(sum(-i / 100 for i in ids))
    logprobs = json.loads(result.as_numpy("logprobs")[0])
    assert logprobs == [{str(i): {"logprob": pytest.approx(-i / 100), "rank": 1,
                                  "decoded_token": cluster.tokenizer.decode([i])}} for i in ids]
    assert cluster.decode.requests[-1].sampling.logprobs == 1

    cluster.script(ids)
    result = await client.infer(MODEL, inputs("x", exclude_input=True, sampling={"max_tokens": 3})
                                + _returns(finish_reason=False, num_output_tokens=False))
    assert {o.name for o in result.get_response().outputs} == {"text_output"}
    assert not cluster.decode.requests[-1].sampling.HasField("logprobs")  # none asked for, none computed


async def test_structured_outputs_reach_the_workers_and_a_bad_spec_is_invalid_argument(cluster, client):
    cluster.script([5, 6])
    await client.infer(MODEL, inputs("x", sampling={"max_tokens": 2, "structured_outputs": {"choice": ["a", "b"]}}))
    want = generation_pb2.StructuredOutput(choice=generation_pb2.Choices(choices=["a", "b"]))
    assert cluster.decode.requests[-1].sampling.structured == want
    assert cluster.prefill.requests[-1].sampling.structured == want
    await client.infer(MODEL, inputs("x"), parameters={"max_tokens": 2, "structured_outputs": '{"regex": "[ab]+"}'})
    assert cluster.decode.requests[-1].sampling.structured == generation_pb2.StructuredOutput(regex="[ab]+")
    sent = len(cluster.decode.requests)
    for sampling, words in [({"structured_outputs": {"regex": "(a"}}, "structured_outputs.regex: "),
                            ({"structured_outputs": ["a"]}, "structured_outputs: a JSON object")]:
        with pytest.raises(InferenceServerException) as e:
            await client.infer(MODEL, inputs("x", sampling=sampling))
        assert e.value.status() == "StatusCode.INVALID_ARGUMENT" and words in e.value.message(), e.value.message()
    assert len(cluster.decode.requests) == sent
